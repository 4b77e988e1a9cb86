"""The bindings loader fails loudly; the KV-event ledger attributes blocks to tenants per tier."""

from __future__ import annotations

import types

import pytest

from engines.trtllm.bindings import BindingError, load_executor_bindings, probe_cache_salt
from engines.trtllm.kv_ledger import TenantBlockLedger
from tests.engines.triton import fake_trtllm


def test_missing_tensorrt_llm_names_the_module_and_the_image():
    def importer(name):
        raise ModuleNotFoundError(f"No module named '{name.split('.')[0]}'")

    with pytest.raises(BindingError, match=r"tensorrt_llm\.bindings\.executor.*trtllm-python-py3"):
        load_executor_bindings(importer)


def test_a_binding_without_a_required_name_is_refused():
    module = fake_trtllm.make_module()
    del module.KvCacheRetentionConfig.TokenRangeRetentionConfig
    with pytest.raises(BindingError, match="KvCacheRetentionConfig.TokenRangeRetentionConfig"):
        load_executor_bindings(lambda _: module)
    bare = types.ModuleType("tensorrt_llm.bindings.executor")
    with pytest.raises(BindingError, match="Executor, ExecutorConfig, KvCacheConfig"):
        load_executor_bindings(lambda _: bare)


def test_a_kv_config_keyword_the_binding_lacks_fails_at_start_naming_it():
    from engines.spec import load_bundled_spec
    from engines.triton.params import ServingParams
    from engines.trtllm.executor_args import make_executor

    module = fake_trtllm.make_module()
    original = module.KvCacheConfig

    def without_onboard(**kwargs):  # what a build after PR #12449 accepts
        if "onboard_blocks" in kwargs:
            raise TypeError("__init__(): incompatible function arguments")
        return original(**kwargs)

    module.KvCacheConfig = without_onboard
    params = ServingParams.from_spec(load_bundled_spec("llama-3.1-8b-instruct-fp8kv"), engine_dir="/e")
    make_executor(module, params)  # default onboarding: the keyword is not sent
    object.__setattr__(params, "onboard_blocks", False)
    with pytest.raises(BindingError, match="KvCacheConfig rejected keywords .*onboard_blocks"):
        make_executor(module, params)


def test_version_check():
    from engines.trtllm.bindings import check_version, executor_version

    module = fake_trtllm.make_module(version="1.2.1")
    assert executor_version(module) == "1.2.1"  # bindings.cpp: m.attr("__version__") = tle::version()
    assert check_version(module, "1.2.1") == "1.2.1"
    with pytest.raises(BindingError, match="TensorRT-LLM 1.2.1 but the engine spec pins 1.2.0"):
        check_version(module, "1.2.0")
    assert check_version(fake_trtllm.make_module(version=None), "1.2.1") is None


def test_a_binding_without_orchestrator_mode_is_refused():
    module = fake_trtllm.make_module()
    module.CommunicationMode = type("CommunicationMode", (), {"LEADER": 0})
    with pytest.raises(BindingError, match="CommunicationMode.ORCHESTRATOR"):
        load_executor_bindings(lambda _: module)


def test_salt_probe():
    assert probe_cache_salt(fake_trtllm.make_module(salt_supported=True)) is True
    assert probe_cache_salt(fake_trtllm.make_module(salt_supported=False)) is False


kv = fake_trtllm.make_module().kv_cache


def stored(parent, block_hash, tokens, level=0):
    return kv.KVCacheStoredData(parent, [kv.KVCacheStoredBlockData(block_hash, [kv.UniqueToken(t) for t in tokens], level, 35)])


def test_ledger_attributes_roots_by_tokens_and_children_by_parent():
    ledger = TenantBlockLedger(tokens_per_block=2)
    ledger.apply_one(kv.KVCacheCreatedData([10, 40]))
    ledger.note_request("a", [1, 2, 3, 4, 5])
    ledger.note_request("b", [1, 2, 9, 9])  # same first block, queued after a
    ledger.apply_one(stored(None, 11, [1, 2]))  # first stored root with tokens 1,2 -> a (FIFO)
    ledger.apply_one(stored(11, 12, [3, 4]))  # child inherits a
    ledger.apply_one(stored(None, 21, [1, 2]))  # second root with the same tokens (another salt) -> b
    ledger.apply_one(stored(21, 22, [9, 9]))
    ledger.apply_one(stored(999, 30, [7, 7]))  # unknown parent: unattributed
    assert ledger.tenants() == {"a": [2, 0], "b": [2, 0]}
    assert ledger.tier_blocks() == [5, 0]
    assert ledger.level_capacity == [10, 40]

    ledger.apply_one(kv.KVCacheUpdatedData(12, kv.KVCacheEventDiffInt(0, 1)))
    ledger.apply_one(kv.KVCacheUpdatedData(12, None, kv.KVCacheEventDiffInt(35, 80)))  # priority-only update
    assert ledger.tenants()["a"] == [1, 1] and ledger.offloaded == 1
    ledger.apply_one(kv.KVCacheUpdatedData(12, kv.KVCacheEventDiffInt(1, 0)))
    assert ledger.onboarded == 1 and ledger.tenants()["a"] == [2, 0]
    ledger.apply_one(kv.KVCacheRemovedData([21, 22, 404]))
    assert ledger.evicted == 2 and "b" not in ledger.tenants()
    assert ledger.tier_blocks() == [3, 0]


def test_ledger_forgets_requests_that_stored_nothing_and_stays_bounded():
    ledger = TenantBlockLedger(tokens_per_block=2, max_pending=3)
    ledger.note_request("a", [1, 2])
    ledger.forget_request("a", [1, 2])  # its root was reused: no stored event will come
    ledger.note_request("b", [1, 2])
    ledger.apply_one(stored(None, 5, [1, 2]))
    assert ledger.tenants() == {"b": [1, 0]}
    for i in range(10):
        ledger.note_request("c", [100 + i, 0])
    assert ledger._pending_total == 3
    ledger.note_request("d", [1])  # shorter than a block: never stored, never expected
    assert ledger._pending_total == 3
