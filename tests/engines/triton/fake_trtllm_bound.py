"""What the classes of one ``fake_trtllm`` module share: ``Bindings``, and how a class is bound to it.

The real ``tensorrt_llm.bindings.executor`` is one module; the double makes a fresh one per test
(``fake_trtllm.make_module``). Invariants:

* every class of a module is a fresh subclass (``bind``) or a fresh enum (``fresh_enum``), made by
  that ``make_module`` call, so ``isinstance`` checks accept only objects of the same module, as the
  per-call classes of a closure did;
* every ``Bound`` class of a module points at the same ``Bindings``: one construction log
  (``calls``, which is ``module.calls``), one list of executors (``module.executors``) and the options
  ``make_module`` was given;
* the classes in the ``fake_trtllm_*`` modules are templates: use them only through a module
  (an unbound one has no ``_bindings``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from tests.engines.triton.fake_trtllm_config import (
        ExecutorConfig, GuidedDecodingConfig, KvCacheConfig, OrchestratorConfig, ParallelConfig)
    from tests.engines.triton.fake_trtllm_executor import Executor
    from tests.engines.triton.fake_trtllm_kv_events import (
        KVCacheCreatedData, KVCacheEvent, KVCacheEventDiffInt, KVCacheEventManager, KVCacheRemovedData,
        KVCacheStoredBlockData, KVCacheStoredData, KVCacheUpdatedData, UniqueToken)
    from tests.engines.triton.fake_trtllm_request import (
        GuidedDecodingParams, KvCacheRetentionConfig, OutputConfig, Request, SamplingConfig, TokenRangeRetentionConfig)
    from tests.engines.triton.fake_trtllm_response import KvCacheMetrics, RequestPerfMetrics, Response, Result
    from tests.engines.triton.fake_trtllm_stats import IterationStats, KvCacheStats


@dataclass(slots=True, eq=False)
class Bindings:
    """One fake module's options, logs and classes (the classes are set by ``make_module`` right after)."""

    calls: list[tuple[str, dict[str, Any]]]  # (class name, kwargs) of every construction, in order
    executors: list[Any]  # every Executor constructed, in order
    salt_supported: bool  # Request takes cache_salt_id
    primary_blocks: int  # GPU pool size (KVCacheCreatedData, KvCacheStats.max_num_blocks)
    secondary_blocks: int  # host pool size (KVCacheCreatedData only)
    kv_cache_stats: bool  # IterationStats.kv_cache_stats is filled (else None)
    event_lag: int  # get_latest_events calls that miss an iteration's events (FakeEventQueue lag)

    # enums
    ModelType: type[enum.Enum] = field(init=False)
    CommunicationMode: type[enum.Enum] = field(init=False)
    GuideType: type[enum.Enum] = field(init=False)
    GuidedDecodingBackend: type[enum.Enum] = field(init=False)
    FinishReason: type[enum.Enum] = field(init=False)
    # configuration (executorConfig.cpp)
    KvCacheConfig: type[KvCacheConfig] = field(init=False)
    ExecutorConfig: type[ExecutorConfig] = field(init=False)
    OrchestratorConfig: type[OrchestratorConfig] = field(init=False)
    ParallelConfig: type[ParallelConfig] = field(init=False)
    GuidedDecodingConfig: type[GuidedDecodingConfig] = field(init=False)
    # requests and responses (request.cpp)
    TokenRangeRetentionConfig: type[TokenRangeRetentionConfig] = field(init=False)
    KvCacheRetentionConfig: type[KvCacheRetentionConfig] = field(init=False)
    SamplingConfig: type[SamplingConfig] = field(init=False)
    OutputConfig: type[OutputConfig] = field(init=False)
    GuidedDecodingParams: type[GuidedDecodingParams] = field(init=False)
    Request: type[Request] = field(init=False)
    KvCacheMetrics: type[KvCacheMetrics] = field(init=False)
    RequestPerfMetrics: type[RequestPerfMetrics] = field(init=False)
    Result: type[Result] = field(init=False)
    Response: type[Response] = field(init=False)
    # KV cache events (bindings.cpp kv_cache.*) and stats
    UniqueToken: type[UniqueToken] = field(init=False)
    KVCacheCreatedData: type[KVCacheCreatedData] = field(init=False)
    KVCacheStoredBlockData: type[KVCacheStoredBlockData] = field(init=False)
    KVCacheStoredData: type[KVCacheStoredData] = field(init=False)
    KVCacheRemovedData: type[KVCacheRemovedData] = field(init=False)
    KVCacheEventDiffInt: type[KVCacheEventDiffInt] = field(init=False)
    KVCacheUpdatedData: type[KVCacheUpdatedData] = field(init=False)
    KVCacheEvent: type[KVCacheEvent] = field(init=False)
    KVCacheEventManager: type[KVCacheEventManager] = field(init=False)
    KvCacheStats: type[KvCacheStats] = field(init=False)
    IterationStats: type[IterationStats] = field(init=False)
    Executor: type[Executor] = field(init=False)


class Bound:
    """A class whose instances use their module's ``Bindings`` (set on the subclass ``bind`` makes)."""

    _bindings: ClassVar[Bindings]


T = TypeVar("T", bound=type)
E = TypeVar("E", bound=enum.Enum)


def bind(template: T, bindings: Bindings, *, name: str | None = None, **attributes: Any) -> T:
    """A fresh subclass of ``template`` named ``name`` (default: the template's name), bound to
    ``bindings``; ``attributes`` are set on it (nested names such as
    ``KvCacheRetentionConfig.TokenRangeRetentionConfig``)."""
    name = name or template.__name__
    return type(name, (template,), {"_bindings": bindings, "__module__": template.__module__, "__qualname__": name,
                                    **attributes})


def fresh_enum(template: type[E]) -> type[E]:
    """A new enum with ``template``'s name, members and values (its members are not ``template``'s)."""
    return enum.Enum(template.__name__, [(member.name, member.value) for member in template],
                     module=template.__module__, qualname=template.__qualname__)
