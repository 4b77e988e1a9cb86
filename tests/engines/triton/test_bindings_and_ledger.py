"""The bindings loader fails loudly; the KV-event ledger attributes blocks to tenants per tier."""

from __future__ import annotations

import types

import pytest

from engines.trtllm.bindings import BindingError, load_executor_bindings, probe_cache_salt
from engines.trtllm.block_key import trt_root_hash
from engines.trtllm.kv_ledger import TenantBlockLedger
from tests.engines.triton import fake_trtllm

OPEN_END = 2**31 - 1  # SizeType32 max: what kvgate sends for an open-ended range


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


def test_a_kv_config_keyword_the_binding_lacks_fails_at_start_naming_it(tmp_path):
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
    fake_trtllm.write_engine_config(tmp_path)
    params = ServingParams.from_spec(load_bundled_spec("llama-3.1-8b-instruct-fp8kv"), engine_dir=str(tmp_path))
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


def root(tokens, salt=None):
    """The block_hash TensorRT-LLM gives this first block under ``salt`` (engines/trtllm/block_key.py)."""
    return trt_root_hash(tokens, salt)


def test_ledger_attributes_roots_by_their_salted_hash_and_children_by_parent():
    ledger = TenantBlockLedger(tokens_per_block=2)
    ledger.apply_one(kv.KVCacheCreatedData([10, 40]))
    ledger.note_request("a", [1, 2, 3, 4, 5], salt="salt-a")
    ledger.note_request("b", [1, 2, 9, 9], salt="salt-b")  # same first block, another salt
    ledger.apply_one(stored(None, root([1, 2], "salt-b"), [1, 2]))  # b's root first: matched by hash, not by order
    ledger.apply_one(stored(root([1, 2], "salt-b"), 22, [9, 9]))
    ledger.apply_one(stored(None, root([1, 2], "salt-a"), [1, 2]))
    ledger.apply_one(stored(root([1, 2], "salt-a"), 12, [3, 4]))  # child inherits a
    ledger.apply_one(stored(999, 30, [7, 7]))  # unknown parent: unattributed
    ledger.apply_one(stored(None, root([1, 2], "salt-c"), [1, 2]))  # nobody noted salt-c: unattributed
    assert ledger.tenants() == {"a": [2, 0], "b": [2, 0]}
    assert ledger.tier_blocks() == [6, 0]
    assert ledger.level_capacity == [10, 40]

    ledger.apply_one(kv.KVCacheUpdatedData(12, kv.KVCacheEventDiffInt(0, 1)))
    ledger.apply_one(kv.KVCacheUpdatedData(12, None, kv.KVCacheEventDiffInt(35, 80)))  # priority-only update
    assert ledger.tenants()["a"] == [1, 1] and ledger.offloaded == 1
    ledger.apply_one(kv.KVCacheUpdatedData(12, kv.KVCacheEventDiffInt(1, 0)))
    assert ledger.onboarded == 1 and ledger.tenants()["a"] == [2, 0]
    ledger.apply_one(kv.KVCacheRemovedData([root([1, 2], "salt-b"), 22, 404]))
    assert ledger.evicted == 2 and "b" not in ledger.tenants()
    assert ledger.tier_blocks() == [4, 0]


def test_ledger_counts_lost_events_and_keeps_attributing_under_prefixes_cached_before(caplog):
    """The executor's buffer drops its oldest events past event_buffer_max_size (kvCacheEventManager.cpp
    KVCacheEventManager::worker): a gap in event ids, counted and logged. The blocks are kept: a block
    stored later under a prefix cached before the gap (reused, so sending no event) is its tenant's."""
    ledger = TenantBlockLedger(tokens_per_block=2)
    ledger.note_request("a", [1, 2, 3, 4, 5], salt="salt-a")
    ledger.apply([types.SimpleNamespace(event_id=0, data=stored(None, root([1, 2], "salt-a"), [1, 2])),
                  types.SimpleNamespace(event_id=1, data=stored(root([1, 2], "salt-a"), 12, [3, 4]))])
    assert ledger.tenants() == {"a": [2, 0]} and ledger.gaps == 0
    with caplog.at_level("WARNING", logger="kvgate.trtllm.ledger"):  # event 2 was discarded
        ledger.apply([types.SimpleNamespace(event_id=3, data=stored(12, 13, [5, 6]))])
    assert ledger.gaps == 1 and "events 2..2 were lost" in caplog.text
    assert ledger.tenants() == {"a": [3, 0]}  # the new block hangs under a's prefix: a's


def test_ledger_shared_roots_go_to_the_oldest_pending_tenant_and_stay_bounded():
    ledger = TenantBlockLedger(tokens_per_block=2, max_pending=3)
    ledger.note_request("a", [1, 2])  # no salt (shared isolation): same hash for every tenant
    ledger.forget_request("a", [1, 2])  # its root was reused: no stored event will come
    ledger.note_request("b", [1, 2])
    ledger.apply_one(stored(None, root([1, 2]), [1, 2]))
    assert ledger.tenants() == {"b": [1, 0]}
    for i in range(10):
        ledger.note_request("c", [100 + i, 0])
    assert ledger._pending_total == 3
    ledger.note_request("d", [1])  # shorter than a block: never matched
    assert ledger._pending_total == 3


def test_a_root_event_later_than_its_request_is_still_attributed_to_its_salt():
    # Before: forget_request dropped the expectation and a late root went to the next pending request
    # with the same first block, whatever its salt.
    ledger = TenantBlockLedger(tokens_per_block=2)
    ledger.note_request("a", [1, 2, 3], salt="salt-a")
    ledger.forget_request("a", [1, 2, 3], salt="salt-a")  # finished; its events are still in flight
    ledger.note_request("b", [1, 2, 4], salt="salt-b")
    ledger.apply_one(stored(None, root([1, 2], "salt-a"), [1, 2]))
    assert ledger.tenants() == {"a": [1, 0]}


# --- what the stricter double refuses or does silently, each as the real bindings ------------

def _executor(tmp_path, *, engine=None, primary_blocks=64, event_lag=0, **kv):
    from engines.spec import load_bundled_spec
    from engines.triton.params import ServingParams
    from engines.trtllm.executor_args import make_executor

    module = fake_trtllm.make_module(primary_blocks=primary_blocks, event_lag=event_lag)
    fake_trtllm.write_engine_config(tmp_path, **(engine or {}))
    params = ServingParams.from_spec(load_bundled_spec("llama-3.1-8b-instruct-fp8kv"), engine_dir=str(tmp_path))
    for key, value in kv.items():
        object.__setattr__(params, key, value)
    return module, make_executor(module, params)


def test_executor_aborts_without_onboarding_on_a_paged_context_engine(tmp_path):
    # trtGptModelInflightBatching.cpp: TLLM_CHECK_WITH_INFO(!getPagedContextFMHA(), "KV cache blocks need
    # to be onboarded if context FMHA.")
    with pytest.raises(RuntimeError, match="KV cache blocks need to be onboarded if context FMHA"):
        _executor(tmp_path, onboard_blocks=False)
    _, executor = _executor(tmp_path / "plain", engine={"paged_context_fmha": False}, onboard_blocks=False)
    assert executor.block_reuse is False  # no check without paged context FMHA, and no reuse either


def test_executor_runs_without_reuse_on_an_engine_without_paged_context_fmha(tmp_path):
    module, executor = _executor(tmp_path, engine={"paged_context_fmha": False})
    assert executor.warnings == [
        # executorImpl.cpp fixExecutorConfig: kvgate asks for chunked context (executor_args.py)
        "Chunked context is not supported for this configuration and will be disabled. Related configs: RNNBased: 0, "
        "KVCacheEnabled: 1, PagedContextFMHA: 0",
        "Fixing executorConfig: KV cache reuse disabled because model was not built with paged context FMHA support",
    ]
    prompt = list(range(64))
    for _ in range(2):
        executor.enqueue_request(module.Request(input_token_ids=prompt, max_tokens=1))
    metrics = [r.result.request_perf_metrics.kv_cache_metrics for r in executor.await_responses()]
    assert [m.num_reused_blocks for m in metrics] == [0, 0]  # the same prompt twice, nothing reused
    events = executor.get_kv_cache_event_manager().get_latest_events(timeout_ms=0.0)
    assert [type(e.data).__name__ for e in events] == ["KVCacheCreatedData"]


def test_sampling_config_regularization_and_checks():
    module = fake_trtllm.make_module()
    # unset top_k/top_p are 0 / 0.0 (defaultDecodingParams.h): greedy, whatever the temperature
    assert module.SamplingConfig(temperature=0.8).greedy is True
    assert module.SamplingConfig(temperature=0.8, top_p=1.0).greedy is False
    top_k_only = module.SamplingConfig(temperature=0.8, top_k=40)
    assert (top_k_only.effective_top_k, top_k_only.effective_top_p, top_k_only.greedy) == (40, 1.0, False)
    for bad in ({"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"temperature": -0.1}):  # samplingConfig.cpp TLLM_CHECKs
        with pytest.raises(RuntimeError):
            module.SamplingConfig(**bad)


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(32, 32)], "positive, non-zero length"),
        ([(40, 32)], "positive, non-zero length"),
        ([(-1, 32)], "non-negative"),
        ([(0, 64), (32, 96)], "non-overlapping"),
        ([(0, OPEN_END), (32, 64)], "non-overlapping"),  # an open end is SizeType32 max: it overlaps what follows
    ],
)
def test_retention_ranges_are_validated_as_std_invalid_argument(ranges, message):
    # kvCacheRetentionConfig.cpp throws std::invalid_argument; nanobind turns it into ValueError.
    module = fake_trtllm.make_module()
    token_range = module.KvCacheRetentionConfig.TokenRangeRetentionConfig
    configs = [token_range(token_start=s, token_end=e, priority=50) for s, e in ranges]
    with pytest.raises(ValueError, match=message):
        module.KvCacheRetentionConfig(token_range_retention_configs=configs, directory="")
    adjacent = [token_range(0, 32, 50), token_range(32, OPEN_END, 20)]
    module.KvCacheRetentionConfig(token_range_retention_configs=adjacent, directory="")  # touching ranges are fine
    with pytest.raises(RuntimeError, match="priority"):
        token_range(0, 32, 101)  # TLLM_CHECK_WITH_INFO in the TokenRangeRetentionConfig ctor


def test_the_double_refuses_what_the_1_2_retention_binding_refuses():
    # NVIDIA/TensorRT-LLM ac456dca cpp/tensorrt_llm/nanobind/executor/request.cpp: nb::arg("token_end") has
    # no .none(), and `directory` is a plain std::string whose nb::arg default is nb::none().
    module = fake_trtllm.make_module()
    token_range = module.KvCacheRetentionConfig.TokenRangeRetentionConfig
    with pytest.raises(TypeError, match="token_end"):
        token_range(token_start=0, token_end=None, priority=50)
    ranges = [token_range(token_start=0, token_end=32, priority=50)]
    with pytest.raises(TypeError, match="directory"):
        module.KvCacheRetentionConfig(token_range_retention_configs=ranges)
    with pytest.raises(TypeError, match="directory"):
        module.KvCacheRetentionConfig(token_range_retention_configs=ranges, directory=None)
    assert module.KvCacheRetentionConfig(token_range_retention_configs=ranges, directory="").directory == ""


def test_event_manager_exists_even_with_a_zero_event_buffer(tmp_path):
    # executorImpl.cpp getKVCacheEventManager: a manager whenever the model has a KV cache manager;
    # with event_buffer_max_size 0 the block manager has no event manager, so nothing ever arrives.
    module, executor = _executor(tmp_path, event_buffer_max_size=0)
    manager = executor.get_kv_cache_event_manager()
    assert manager is not None
    executor.enqueue_request(module.Request(input_token_ids=list(range(64)), max_tokens=1))
    assert manager.get_latest_events(timeout_ms=0.0) == []


def test_stored_blocks_of_one_store_call_arrive_in_one_event(tmp_path):
    module, executor = _executor(tmp_path)
    manager = executor.get_kv_cache_event_manager()
    manager.get_latest_events(timeout_ms=0.0)
    executor.enqueue_request(module.Request(input_token_ids=list(range(100)), max_tokens=1))
    executor.await_responses()
    # kvCacheEventManager.cpp enqueueStoredEvent: one event per storeBlocks call. storeContextBlocks
    # stores the full blocks of the first 99 tokens; releaseBlocks (max_tokens reached in the same
    # iteration) the partial block holding tokens 96..99 under the third.
    context, release = manager.get_latest_events(timeout_ms=0.0)
    assert context.data.parent_hash is None and [len(b.tokens) for b in context.data.blocks] == [32, 32, 32]
    assert release.data.parent_hash == context.data.blocks[-1].block_hash
    assert [[t.token_id for t in b.tokens] for b in release.data.blocks] == [[96, 97, 98, 99]]
    assert release.event_id == context.event_id + 1


def test_the_double_stores_blocks_when_tensorrt_llm_does(tmp_path):
    # Before: the double stored every full prompt block at enqueue. TensorRT-LLM stores nothing at
    # enqueue; at the end of the context phase the full blocks of promptLen - 1 tokens (storeContextBlocks);
    # the block holding the last prompt token once generation fills it (storeNewBlock) or at release
    # (releaseBlocks, partial too). Events of one iteration leave at its end (flushIterationEvents).
    module, executor = _executor(tmp_path)
    manager = executor.get_kv_cache_event_manager()
    manager.get_latest_events(timeout_ms=0.0)
    executor.auto_run = False
    prompt = list(range(64))  # exactly two blocks of 32
    executor.enqueue_request(module.Request(input_token_ids=prompt, max_tokens=3))
    assert manager.get_latest_events(timeout_ms=0.0) == []  # enqueue stores nothing

    def stored_tokens():
        events = manager.get_latest_events(timeout_ms=0.0)
        return [[[t.token_id for t in b.tokens] for b in e.data.blocks] for e in events]

    executor.step()  # context: tokens 0..62 hold one full block; first token generated (65 tokens)
    assert stored_tokens() == [[prompt[:32]]]
    executor.step()  # before its token: 65 tokens, 64 usable: the second prompt block is now full
    assert stored_tokens() == [[prompt[32:]]]
    executor.step()  # third token, the request ends: 67 tokens, 66 usable -> a partial block of 2
    [[partial]] = stored_tokens()
    generated = executor.await_responses()[0].result.output_token_ids[0]
    assert partial == generated[:2]
    assert executor.active == {} and all(b.refs == 0 for b in executor.tree.values())


@pytest.mark.parametrize(("max_tokens", "generation_blocks"), [(25, 0), (26, 1)])
def test_kv_slots_are_added_before_each_generation_step_and_never_for_the_last_token(tmp_path, max_tokens,
                                                                                      generation_blocks):
    # allocateKvCache.cpp (NVIDIA/TensorRT-LLM d2b9c97c) AllocateKvCache::operator(): addSequence(promptLen) for a
    # context request, addToken only for a generation request, once per step (no draft tokens), in forwardAsync
    # before the engine runs (trtGptModelInflightBatching.cpp b35ac1b6). kvCacheManager.cpp (b35ac1b6)
    # KVCacheManager::addToken: sequence.addNewTokens(1), then adjustBlocksIfNeeded takes a block (allocateBlock
    # -> getFreeBlock, ++mAllocTotalBlocks) when (getNumTokens() - 1) % tokensPerBlock == 0. A step feeds the
    # token the previous one generated, so a request of max_tokens M runs M - 1 generation steps and holds
    # promptLen + M - 1 slots; the token that ends it (updateRequests -> terminateRequest in forwardSync) never
    # gets one. 40 + 25 - 1 = 64 = 2 blocks: no generation block; M = 26 takes one, at the 25th generation step.
    # Before: the double took a block for every generated token as forwardSync appended it, the last one
    # included: one block too many when (promptLen + M - 1) % B == 0, and each new block one iteration early.
    module, executor = _executor(tmp_path)
    manager = executor.get_kv_cache_event_manager()
    manager.get_latest_events(timeout_ms=0.0)
    executor.auto_run = False
    prompt = list(range(40))
    executor.enqueue_request(module.Request(input_token_ids=prompt, max_tokens=max_tokens))
    used, stored = [], []
    while executor.active:
        executor.step()
        used.append(executor._kv_stats().used_num_blocks)
        stored.append([len(e.data.blocks) for e in manager.get_latest_events(timeout_ms=0.0)
                       if type(e.data).__name__ == "KVCacheStoredData"])
    steps = max_tokens - 1  # iteration 0 is the context; iterations 1..M-1 are the generation steps
    assert len(used) == max_tokens
    # iteration i (a running request): promptLen + i slots in ceil(.../B) blocks; the last iteration released it
    assert used[:-1] == [-(-(len(prompt) + i) // TPB) for i in range(steps)] and used[-1] == 0
    stats = executor._kv_stats()
    assert stats.alloc_total_blocks == stats.missed_blocks + generation_blocks == 2 + generation_blocks
    assert executor.kv_counters.generation_total == generation_blocks
    # Stores follow the request's tokens, not its slots (storeNewBlock / releaseBlocks chop uniqueTokens.size() - 1):
    # storeContextBlocks the full blocks of 39 tokens (block 0); with M = 25 releaseBlocks the 64 tokens of 65
    # (block 1, full); with M = 26 storeNewBlock at step 25 (65 tokens, 64 usable: block 1), the
    # step whose addToken took block 2, then releaseBlocks the 65 of 66 (block 2, partial: 1 token)
    last = [1] if max_tokens == 25 else [1, 1]
    assert stored == [[1]] + [[]] * (steps - 1) + [last]


TPB = 32  # the bundled spec's tokens_per_block


def _final_reused(responses):
    return {r.request_id: r.result.request_perf_metrics.kv_cache_metrics.num_reused_blocks
            for r in responses if r.result.is_final}


def test_the_scheduler_delays_a_request_whose_first_new_block_another_starting_request_computes(tmp_path):
    # capacityScheduler.cpp (NVIDIA/TensorRT-LLM cf6abc45) GuaranteedNoEvictScheduler::impl (the default
    # policy, executor.h SchedulerConfig) calls beneficialToSkip for each pending request; with block reuse
    # enabled, a context request on its first chunk whose findNewContextBlock key (kvCacheManager.cpp
    # b35ac1b6: the prompt's first full block not in the tree) a request scheduled before it in the same
    # pass contributes is skipped (oneManagerBeneficialToSkip). Next iteration the first request's context
    # blocks are stored (storeContextBlocks) and the second reuses them.
    module, executor = _executor(tmp_path)
    executor.auto_run = False
    prompt = list(range(3 * TPB + 1))  # 3 full blocks + the last token
    a = executor.enqueue_request(module.Request(input_token_ids=prompt, max_tokens=4))
    b = executor.enqueue_request(module.Request(input_token_ids=prompt, max_tokens=4))
    executor.step()
    assert executor.active[a].scheduled and not executor.active[b].scheduled
    assert executor.active[b].sampled == 0
    executor.auto_run = True
    assert _final_reused(executor.await_responses()) == {a: 0, b: 3}

    # The key carries no cacheSaltID (findNewContextBlock builds `ret` with tokens and LoRA id only): another
    # salt is delayed one iteration as well, then starts with nothing to reuse (its walk uses its own salt).
    module, executor = _executor(tmp_path / "salted")
    executor.auto_run = False
    other = list(range(5000, 5000 + 3 * TPB + 1))
    a = executor.enqueue_request(module.Request(input_token_ids=other, max_tokens=4, cache_salt_id=1))
    b = executor.enqueue_request(module.Request(input_token_ids=other, max_tokens=4, cache_salt_id=2))
    executor.step()
    assert not executor.active[b].scheduled
    executor.step()
    assert executor.active[b].scheduled
    executor.auto_run = True
    assert _final_reused(executor.await_responses()) == {a: 0, b: 0}

    # Without block reuse beneficialToSkip is never consulted (isEnableBlockReuse() is false); a prompt with
    # no full block has no new context block (findNewContextBlock returns nullopt) and is never delayed.
    for name, kv, ids in (("off", {"enable_block_reuse": False}, prompt), ("short", {}, list(range(TPB - 1)))):
        module, executor = _executor(tmp_path / name, **kv)
        executor.auto_run = False
        ids_started = [executor.enqueue_request(module.Request(input_token_ids=ids, max_tokens=2)) for _ in range(2)]
        executor.step()
        assert all(executor.active[i].scheduled for i in ids_started), name


def test_a_store_that_finds_its_block_in_the_tree_takes_no_reference_on_it(tmp_path):
    # kvCacheManager.cpp (b35ac1b6) WindowBlockManager::storeBlocks: on a match it only moves on
    # (searchRoot = matchedBlock); incRefCount only with pinBlocks, which storeNewBlock, storeContextBlocks
    # and releaseBlocks never pass. The request keeps its own duplicate block (counted as used, released by
    # releaseBlocks from mAllocatedBlocksPerSeq), and the tree block stays free once its owner is released.
    # Before: the double moved the request onto the tree block (refs + 1), counting one block fewer as used
    # and refusing to evict a block TensorRT-LLM treats as free.
    module, executor = _executor(tmp_path)
    executor.auto_run = False
    a = executor.enqueue_request(module.Request(input_token_ids=list(range(40)), max_tokens=40))
    executor.step()  # A's context: its first full block is stored
    generated = executor.active[a].generated
    # B's prompt is A's prompt and output so far: block 0 is A's (reused), block 1 B computes and stores first
    b_prompt = list(range(40)) + generated[:24] + [999]
    b = executor.enqueue_request(module.Request(input_token_ids=b_prompt, max_tokens=30))
    executor.step()
    assert executor.active[b].kv.num_reused_blocks == 1
    [h1] = [h for h, blk in executor.tree.items() if blk.tokens == tuple(b_prompt[TPB:2 * TPB])]
    assert executor.tree[h1].refs == 1
    while len(executor.blocks.sequences[a].tokens) - 1 < 2 * TPB:
        executor.step()
    executor.step()  # forwardAsync: A's storeNewBlock (65 tokens, 64 usable) stores blocks 0 and 1
    assert [len(e.data.blocks) for e in executor.get_kv_cache_event_manager().get_latest_events(timeout_ms=0.0)
            if type(e.data).__name__ == "KVCacheStoredData"] == [1, 1]  # A's block 0, then B's block 1 only
    assert executor.tree[h1].refs == 1 and h1 not in executor.blocks.sequences[a].held  # matched: no reference
    # used: block 0 (shared), B's block 1, A's duplicate of it, and each request's third block (B's a context
    # block; A's taken by this step's addToken, its 65th KV slot: allocateKvCache.cpp d2b9c97c, before the stores)
    assert executor._kv_stats().used_num_blocks == 5
    while b in executor.active:
        executor.step()
    assert a in executor.active and executor.tree[h1].refs == 0  # B released; A runs on its own copy
    # A holds ceil(slots / B) blocks, its slots one fewer than its tokens: the token forwardSync last appended gets
    # its slot at the next step's addToken (allocateKvCache.cpp d2b9c97c; kvCacheManager.cpp b35ac1b6 addToken).
    # Before: the double counted ceil(tokens / B), one block early whenever (tokens - 1) % B == 0.
    slots = len(executor.blocks.sequences[a].tokens) - 1
    assert executor.blocks.sequences[a].slots == slots
    assert executor._kv_stats().used_num_blocks == -(-slots // TPB)
    executor.evict(h1)  # free for TensorRT-LLM: evictable while A runs
    assert h1 not in executor.tree
    executor.auto_run = True
    executor.await_responses()
    assert executor.active == {} and all(blk.refs == 0 for blk in executor.tree.values())


def test_get_latest_events_without_a_timeout_waits_for_an_event(tmp_path):
    # kvCacheEventManager.cpp getEvents (NVIDIA/TensorRT-LLM 8c498e94, the same in other snapshots): without a
    # timeout mEmptyCV.wait(lck, pred), pred = !mEvents.empty() || !mRun: it returns once the worker thread has
    # delivered a batch, and never while there is none (mRun turns false only in the destructor). The
    # binding's default is timeout_ms=None. Before: the double returned at once. The double raises rather
    # than hang; the model always passes timeout_ms=0.0 (engines/triton/model.py drain_events).
    module, executor = _executor(tmp_path, event_lag=2)
    manager = executor.get_kv_cache_event_manager()
    executor.enqueue_request(module.Request(input_token_ids=list(range(40)), max_tokens=2))
    executor.await_responses()
    assert manager.get_latest_events(timeout_ms=0.0) == []  # every batch is still with the worker
    [created] = manager.get_latest_events()  # waits: the worker delivers the oldest batch
    assert type(created.data).__name__ == "KVCacheCreatedData"
    # both iterations' stores (context end, release) arrive, together, at the next read
    assert [type(e.data).__name__ for e in manager.get_latest_events()] == ["KVCacheStoredData"] * 2
    with pytest.raises(RuntimeError, match="without a timeout would block forever"):
        manager.get_latest_events()
    assert manager.get_latest_events(timeout_ms=10.0) == []  # wait_for: empty when the timeout passes
    # event_buffer_max_size 0: no event manager in the block manager, BlockManager::getLatestEvents returns
    # an empty deque at once (kvCacheManager.cpp), timeout or not
    _, quiet = _executor(tmp_path / "quiet", event_buffer_max_size=0)
    assert quiet.get_kv_cache_event_manager().get_latest_events() == []


def test_without_block_reuse_every_allocated_block_is_new(tmp_path):
    # kvCacheManager.cpp (b35ac1b6) getFreeBlock: ++mAllocNewBlocks when block->getUniqueTokens().empty(). A
    # key is set only by loadOrAllocateBlocks and storeBlocks; without reuse addSequence only calls
    # allocateBlock, storeContextBlocks / storeNewBlock return, and removeSequence releases without the
    # request: no block ever gets a key, so alloc_new == alloc_total for ever. Before: the double counted a
    # block new only the first time each pool slot was handed out (at most the pool's size per life).
    module, executor = _executor(tmp_path, primary_blocks=8, enable_block_reuse=False)
    metrics = []
    for i in range(4):  # 4 requests of 3 prompt blocks + 1 generation block, one at a time, in an 8-block pool
        executor.enqueue_request(module.Request(input_token_ids=[i] * (3 * TPB), max_tokens=2))
        [final] = executor.await_responses()
        metrics.append(final.result.request_perf_metrics.kv_cache_metrics)
    assert [(m.num_total_allocated_blocks, m.num_new_allocated_blocks) for m in metrics] == [(3, 3)] * 4
    stats = executor._kv_stats()
    assert stats.alloc_total_blocks == stats.alloc_new_blocks == 16 > stats.max_num_blocks


def test_ledger_attributes_a_batched_stored_event():
    ledger = TenantBlockLedger(tokens_per_block=2)
    ledger.note_request("a", [1, 2, 3, 4, 5, 6], salt="sa")
    ledger.note_request("b", [7, 8, 9, 9], salt="sb")
    batch = kv.KVCacheStoredData(None, [kv.KVCacheStoredBlockData(h, [kv.UniqueToken(t) for t in toks], 0, 35)
                                        for h, toks in ((root([1, 2], "sa"), [1, 2]), (12, [3, 4]), (13, [5, 6]))])
    ledger.apply_one(batch)
    ledger.apply_one(kv.KVCacheStoredData(12, [kv.KVCacheStoredBlockData(14, [kv.UniqueToken(0), kv.UniqueToken(0)], 0, 35)]))
    # a block under an unknown parent is never matched as a root, even when it is one's hash and tokens
    ledger.apply_one(stored(999, root([7, 8], "sb"), [7, 8]))
    ledger.apply_one(kv.KVCacheStoredData(None, [kv.KVCacheStoredBlockData(root([7, 8], "sb"), [kv.UniqueToken(7), kv.UniqueToken(8)], 0, 35),
                                                 kv.KVCacheStoredBlockData(22, [kv.UniqueToken(9), kv.UniqueToken(9)], 0, 35)]))
    assert ledger.tenants() == {"a": [4, 0], "b": [2, 0]}
    assert ledger.tier_blocks() == [6, 0]
