"""The retention policies the simulator compares, and the plug-in point for more.

A policy turns a trace request into a :class:`RetentionPlan` and says how the pool is
shaped for it (host tier or not, offload threshold). Built-ins:

* ``lru``            — every block at the default priority 35, no host tier: plain LRU
                        prefix caching (vLLM-style automatic prefix caching);
* ``trtllm-default`` — TensorRT-LLM defaults with a host tier: priority 35 everywhere,
                        ``secondary_offload_min_priority`` 30 (code default), so every
                        evicted block is offloaded;
* ``class``          — retention classes from a mapping of tenants / prefix groups to
                        system/context/turn/decode priorities and durations, through the
                        same planner the gateway uses;
* ``adaptive``       — adaptive retention with selection (``retention/policy/selection.py``): the
                        tenant's static class (``trtllm-default`` without ``--classes``),
                        adaptive's bands or (GPU-only pools) ``protect``, whichever wins on
                        sampled shadow pools; the same code the gateway runs for ``adaptive``
                        classes;
* ``adaptive-bands`` — adaptive's bands alone, no selection (``retention/policy/adaptive.py``);
* ``protect``        — the ``protect`` candidate alone, no selection (``retention/policy/protect.py``);
* ``<any of these>+hints`` — the policy with the trace's client cache hints on top, within
                        the class's hint rules (``retention/simulation/hinted.py``);
* ``<any of these>+conv`` — the policy with the conversation and tool-loop hold on top
                        (requests offering tools or storing their response held for the
                        tenant's measured gap, within the class's hint rules;
                        ``retention/simulation/conversational.py``);
* ``<any of these>+conv+demote`` — the same, and every delete replayed as a demote request
                        (the deleted conversation's own blocks re-claimed at priority 0;
                        ``retention/policy/demote.py``);
* ``<any of these>+conv+end`` / ``+conv+demote+end`` — and a tool-offering request whose
                        response is a message (``output_kind``: the run ended) answered at
                        completion by a demote request for its conversation's own blocks,
                        where the hold duel holds its conversation;
* ``<any of these>+end``  — that end-of-run demote without the hold: the policy's plans
                        unchanged, and every run that ends in a message (no duel to gate it)
                        answered by the demote of its own blocks;
* plug-ins passed to :func:`make_policy` in a ``registry``.

Offline reference policies that need the whole request list (``oracle-reuse``,
``oracle-reuse-within-<T>s``, ``oracle-next-use``) live in ``retention/simulation/oracle.py``; they
implement the same :class:`SimPolicy` protocol and are built by ``bench/retention/simulate.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from retention.policy.adaptive import adaptive_policy
from retention.policy.hint_plan import HINTS_OFF, HintPolicy
from retention.policy.conversation import ConversationLedger
from retention.simulation.conversational import ConversationPolicy
from retention.simulation.hinted import HintedPolicy
from retention.policy.protect import ProtectPolicy
from retention.policy.selection import AdaptiveSelectPolicy
from retention.policy.planner import QuotaState, RetentionClassSpec, SegmentRetention, Segments, plan_retention
from retention.pool import Allocation, BlockPool
from retention.policy.quota import QuotaTracker
from retention.trace import TraceRequest
from retention.types import DEFAULT_PLAN, TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY, RetentionPlan, RetentionPlanError


class SimPolicy(Protocol):
    name: str
    uses_host: bool
    offload_min_priority: int

    def plan(self, request: TraceRequest, hashes: list[int], *, now: float, pool: BlockPool) -> RetentionPlan: ...

    def observe(
        self, request: TraceRequest, hashes: list[int], allocation: Allocation | None, *, now: float, pool: BlockPool
    ) -> None: ...


@dataclass(slots=True)
class FixedPolicy:
    """Same plan for every request (``lru``, ``trtllm-default``)."""

    name: str
    uses_host: bool
    offload_min_priority: int = TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY
    fixed: RetentionPlan = DEFAULT_PLAN

    def plan(self, request: TraceRequest, hashes: list[int], *, now: float, pool: BlockPool) -> RetentionPlan:
        return self.fixed

    def observe(self, request, hashes, allocation, *, now, pool) -> None:  # noqa: ANN001 - protocol
        return None


class ClassMappingError(ValueError):
    """A class mapping is malformed; the message names the key."""


def _segment(data: Any, where: str) -> SegmentRetention:
    if not isinstance(data, Mapping) or "priority" not in data:
        raise ClassMappingError(f"{where} must be a mapping with a priority (and optional duration_ms)")
    unknown = set(data) - {"priority", "duration_ms"}
    if unknown:
        raise ClassMappingError(f"{where} has unknown keys {sorted(unknown)}")
    try:
        return SegmentRetention(data["priority"], data.get("duration_ms"))
    except RetentionPlanError as exc:
        raise ClassMappingError(f"{where}: {exc}") from None


@dataclass(frozen=True, slots=True)
class ClassMapping:
    """Tenants and prefix groups (first hash id) mapped to retention classes."""

    classes: dict[str, RetentionClassSpec]
    default: str
    offload_min_priority: int = TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY
    tenants: dict[str, str] = field(default_factory=dict)
    prefix_groups: dict[int, str] = field(default_factory=dict)
    quotas: dict[str, float] = field(default_factory=dict)  # tenant -> share of GPU blocks
    quota_hysteresis: float = 0.1
    hints: dict[str, HintPolicy] = field(default_factory=dict)  # class -> its client-hint rules (default: off)

    @classmethod
    def from_dict(cls, data: Any) -> ClassMapping:
        """Build from a parsed YAML/JSON document::

            offload_min_priority: 35
            default: standard
            classes:
              premium: {system: {priority: 90}, context: {priority: 60, duration_ms: 600000},
                        turn: {priority: 40, duration_ms: 30000}, decode: {priority: 35}}
              standard: {...,                # optional: client hints (retention/policy/hint_plan.py)
                         hints: {enabled: true, max_ttl_ms: 3600000, max_priority: 60, quota_fraction: 0.5}}
            tenants: {acme: premium}
            prefix_groups: {0: premium}      # requests whose first hash id is 0
            quotas: {noisy: 0.5}             # optional: share of GPU blocks (retention/policy/quota.py)
            quota_hysteresis: 0.1
        """
        if not isinstance(data, Mapping):
            raise ClassMappingError("the class mapping must be a mapping")
        unknown = set(data) - {
            "classes", "default", "offload_min_priority", "tenants", "prefix_groups", "quotas", "quota_hysteresis",
        }
        if unknown:
            raise ClassMappingError(f"unknown top-level keys {sorted(unknown)}")
        raw_classes = data.get("classes")
        if not isinstance(raw_classes, Mapping) or not raw_classes:
            raise ClassMappingError("classes must be a non-empty mapping of class name -> segments")
        classes: dict[str, RetentionClassSpec] = {}
        hints: dict[str, HintPolicy] = {}
        for name, spec in raw_classes.items():
            if not isinstance(spec, Mapping) or set(spec) - {"hints"} != {"system", "context", "turn", "decode"}:
                raise ClassMappingError(f"classes.{name} needs exactly system, context, turn and decode (and "
                                        "optional hints)")
            if "hints" in spec:
                hints[str(name)] = _hint_policy(spec["hints"], f"classes.{name}.hints")
            classes[str(name)] = RetentionClassSpec(
                *(_segment(spec[s], f"classes.{name}.{s}") for s in ("system", "context", "turn", "decode"))
            )
        default = data.get("default", next(iter(classes)))
        threshold = data.get("offload_min_priority", TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or not 0 <= threshold <= 101:
            raise ClassMappingError("offload_min_priority must be an integer within [0, 101]")
        if not isinstance(default, str):
            raise ClassMappingError("default must be a class name")
        for field in ("tenants", "prefix_groups", "quotas"):
            if not isinstance(data.get(field) or {}, Mapping):
                raise ClassMappingError(f"{field} must be a mapping")
        tenants = {str(k): str(v) for k, v in (data.get("tenants") or {}).items()}
        try:
            groups = {int(k): str(v) for k, v in (data.get("prefix_groups") or {}).items()}
        except (TypeError, ValueError):
            raise ClassMappingError("prefix_groups keys must be integer hash ids") from None
        for where, target in [("default", default), *((f"tenants.{k}", v) for k, v in tenants.items()),
                              *((f"prefix_groups.{k}", v) for k, v in groups.items())]:
            if target not in classes:
                raise ClassMappingError(f"{where} names unknown class {target!r}")
        quotas: dict[str, float] = {}
        for tenant, fraction in (data.get("quotas") or {}).items():
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ClassMappingError(f"quotas.{tenant} must be a fraction within (0, 1]")
            quotas[str(tenant)] = float(fraction)
        hysteresis = data.get("quota_hysteresis", 0.1)
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, (int, float)) or not 0 <= hysteresis < 1:
            raise ClassMappingError("quota_hysteresis must be within [0, 1)")
        return cls(classes, str(default), threshold, tenants, groups, quotas, float(hysteresis), hints)

    def class_name_for(self, request: TraceRequest) -> str:
        if request.hash_ids and request.hash_ids[0] in self.prefix_groups:
            return self.prefix_groups[request.hash_ids[0]]
        if request.tenant is not None and request.tenant in self.tenants:
            return self.tenants[request.tenant]
        return self.default

    def class_for(self, request: TraceRequest) -> RetentionClassSpec:
        return self.classes[self.class_name_for(request)]

    def hints_for(self, request: TraceRequest) -> HintPolicy:
        """The request's class's hint rules (off when the class declares none)."""
        return self.hints.get(self.class_name_for(request), HINTS_OFF)


def _hint_policy(data: Any, where: str) -> HintPolicy:
    if not isinstance(data, Mapping):
        raise ClassMappingError(f"{where} must be a mapping")
    unknown = set(data) - {"enabled", "max_ttl_ms", "max_priority", "quota_fraction"}
    if unknown:
        raise ClassMappingError(f"{where} has unknown keys {sorted(unknown)}")
    try:
        return HintPolicy(**{"enabled": True, **data})
    except RetentionPlanError as exc:
        raise ClassMappingError(f"{where}: {exc}") from None


def trace_segments(request: TraceRequest, block_size: int) -> Segments:
    """Segment boundaries: the trace's own fields, else everything but the last hash block is context."""
    n = request.input_length
    if request.context_tokens is not None or request.system_tokens is not None:
        context = request.context_tokens if request.context_tokens is not None else (request.system_tokens or 0)
        return Segments(request.system_tokens or 0, context, n)
    context = min(n, (len(request.hash_ids) - 1) * block_size)
    return Segments(0, context, n)


QuotaLookup = Callable[[str | None, BlockPool], QuotaState]


@dataclass(slots=True)
class ClassPolicy:
    """Classes through the gateway's planner; with ``mapping.quotas``, over-quota demotion too."""

    mapping: ClassMapping
    block_size: int = 512
    quota: QuotaLookup | None = None  # override; default: a QuotaTracker when the mapping has quotas
    name: str = "class"
    uses_host: bool = True
    tracker: QuotaTracker | None = None
    demotions: int = 0  # requests planned while their tenant was over quota

    @property
    def offload_min_priority(self) -> int:
        return self.mapping.offload_min_priority

    def _quota_state(self, tenant: str | None, pool: BlockPool) -> QuotaState:
        if self.quota is not None:
            return self.quota(tenant, pool)
        if not self.mapping.quotas:
            return QuotaState()
        if self.tracker is None:
            self.tracker = QuotaTracker(pool.config.primary_blocks, dict(self.mapping.quotas), self.mapping.quota_hysteresis)
        self.tracker.update(pool.tenant_blocks())
        return self.tracker.state(tenant)

    def plan(self, request: TraceRequest, hashes: list[int], *, now: float, pool: BlockPool) -> RetentionPlan:
        state = self._quota_state(request.tenant, pool)
        self.demotions += state.over_quota
        return plan_retention(
            self.mapping.class_for(request), trace_segments(request, self.block_size),
            offload_min_priority=self.mapping.offload_min_priority, quota=state,
        )

    def observe(self, request, hashes, allocation, *, now, pool) -> None:  # noqa: ANN001 - protocol
        return None


PolicyFactory = Callable[..., SimPolicy]


def builtin_policy(name: str, *, mapping: ClassMapping | None = None, block_size: int = 512) -> SimPolicy:
    """``lru``, ``trtllm-default`` or ``class`` (needs ``mapping``); else a registered policy."""
    if name == "lru":
        return FixedPolicy("lru", uses_host=False)
    if name == "trtllm-default":
        return FixedPolicy("trtllm-default", uses_host=True)
    if name == "class":
        if mapping is None:
            raise ClassMappingError("the class policy needs a class mapping (--classes FILE)")
        return ClassPolicy(mapping, block_size)
    raise KeyError(name)


def policy_names() -> tuple[str, ...]:
    """The built-in names; each also as ``<name>+hints`` (the trace's cache hints on top) and
    ``<name>+conv`` (the conversation and tool-loop hold on top) and ``<name>+end`` (the
    end-of-run demote alone)."""
    return ("lru", "trtllm-default", "class", "adaptive", "adaptive-bands", "protect")


def make_policy(
    name: str, *, mapping: ClassMapping | None = None, block_size: int = 512, registry: Mapping[str, PolicyFactory] | None = None
) -> SimPolicy:
    """Resolve a policy by name; ``registry`` supplies plug-ins (e.g. ``adaptive``).

    ``<name>+hints`` is ``<name>`` with the trace's client cache hints on top
    (``retention/simulation/hinted.py``); ``<name>+conv`` with the conversation and tool-loop
    hold (``retention/simulation/conversational.py``); ``<name>+end`` with the end-of-run demote
    and no hold."""
    if name.endswith("+conv+end") or name.endswith("+conv+demote+end"):
        conv = make_policy(name[: -len("+end")], mapping=mapping, block_size=block_size, registry=registry)
        conv.end_demote = "duel"  # type: ignore[attr-defined]
        return conv
    if name.endswith("+end"):  # the end demote alone: no hold, so no duel gates it
        inner = make_policy(name[: -len("+end")], mapping=mapping, block_size=block_size, registry=registry)
        rules, quotas = (None, {}) if mapping is None else (mapping.hints_for, dict(mapping.quotas))
        return ConversationPolicy(inner, rules, quotas, ledger=ConversationLedger(duel=None), end_demote="always",
                                  hold=False)
    if name.endswith("+conv+demote"):
        conv = make_policy(name[: -len("+demote")], mapping=mapping, block_size=block_size, registry=registry)
        conv.demote = True  # type: ignore[attr-defined]
        return conv
    if name.endswith("+conv"):
        inner = make_policy(name[: -len("+conv")], mapping=mapping, block_size=block_size, registry=registry)
        if mapping is None:
            return ConversationPolicy(inner)
        return ConversationPolicy(inner, mapping.hints_for, dict(mapping.quotas))
    if name.endswith("+hints"):
        inner = make_policy(name[: -len("+hints")], mapping=mapping, block_size=block_size, registry=registry)
        if mapping is None:
            return HintedPolicy(inner)
        return HintedPolicy(inner, mapping.hints_for, dict(mapping.quotas))
    try:
        return builtin_policy(name, mapping=mapping, block_size=block_size)
    except KeyError:
        pass
    if registry and name in registry:
        return registry[name](mapping=mapping, block_size=block_size)
    if name == "adaptive":
        static = builtin_policy("class" if mapping is not None else "trtllm-default", mapping=mapping, block_size=block_size)
        return AdaptiveSelectPolicy(static)
    if name == "adaptive-bands":
        policy = adaptive_policy(mapping=mapping, block_size=block_size)
        policy.name = "adaptive-bands"
        return policy
    if name == "protect":
        return ProtectPolicy(offload_min_priority=mapping.offload_min_priority if mapping is not None else 30)
    raise ClassMappingError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
