"""The reference scheduler's capacity policies and per-request KV metrics, as TensorRT-LLM's.

``guaranteed_no_evict`` (TensorRT-LLM's default ``CapacitySchedulerPolicy``): a request starts only
when the free blocks, less every running request's blocks to completion, hold its own
(``GuaranteedNoEvictScheduler``, ``getRemainingBlocksToCompletion``); nothing is ever preempted.
``max_utilization``: admit on the prompt, preempt the newest request when one cannot grow.
Per-request metrics are counted around each admission (``KVCacheManager::addSequence``) and add up
over re-admissions (``LlmRequest::update*PerRequest``: ``+=``).
"""

from __future__ import annotations

import pytest

BPT = 4


def _request(prompt: list[int], max_new_tokens: int):
    from engines.contract import EngineRequest, SamplingParams
    from retention.types import RetentionPlan

    return EngineRequest(input_ids=tuple(prompt), max_new_tokens=max_new_tokens, end_id=None, streaming=False,
                         sampling=SamplingParams(), retention=RetentionPlan(), cache_salt=None, tenant_id=None)


def _setup(primary_blocks: int, policy: str | None = None):
    from engines.reference.scheduler import Scheduler
    from retention.pool import BlockPool, PoolConfig

    pool = BlockPool(PoolConfig(primary_blocks=primary_blocks, tokens_per_block=BPT))
    kwargs = {} if policy is None else {"policy": policy}
    return pool, Scheduler(pool, tokens_per_block=BPT, max_batch_size=4, max_num_tokens=64, **kwargs)


def _add(scheduler, name: str, prompt: list[int], max_new_tokens: int):
    from engines.reference.scheduler import Sequence

    seq = Sequence(name, _request(prompt, max_new_tokens), list(prompt), len(prompt), frozenset())
    scheduler.add(seq)
    return seq


def _step(scheduler) -> None:
    """One engine step: compute, store, accept the samples, finish the sequences at their length."""
    step = scheduler.schedule(0.0)
    for work in (*step.decodes, *step.prefills):
        work.seq.num_computed = work.start + work.length
    scheduler.store_computed(step)
    for work in (*step.decodes, *step.prefills):
        if work.sample:
            work.seq.tokens.append(7)
            work.seq.generated += 1
            if work.seq.generated >= work.seq.request.max_new_tokens:
                scheduler.finish(work.seq, 0.0)


def _run_three_requests(policy: str | None) -> tuple[int, int, object]:
    """Three 8-token prompts, 8 new tokens each (4 blocks to completion), in a 6-block pool."""
    pool, scheduler = _setup(6, policy)
    for k in range(3):
        _add(scheduler, f"s{k}", list(range(100 * (k + 1), 100 * (k + 1) + 8)), 8)
    max_running = 0
    for _ in range(80):
        _step(scheduler)
        max_running = max(max_running, len(scheduler.running))
        if not scheduler.has_work():
            break
    assert not scheduler.has_work()
    return max_running, scheduler.preemptions, pool.stats()


def test_guaranteed_no_evict_is_the_default_and_never_preempts():
    max_running, preemptions, stats = _run_three_requests(None)
    # 6 free blocks < 4 + 4: one request at a time, each prompt looked up once (3 x 2 blocks missed).
    assert (max_running, preemptions) == (1, 0)
    assert (stats.reused_blocks, stats.missed_blocks) == (0, 6)


def test_max_utilization_admits_on_the_prompt_and_preempts_on_growth():
    max_running, preemptions, stats = _run_three_requests("max_utilization")
    assert max_running >= 2 and preemptions > 0
    assert stats.reused_blocks + stats.missed_blocks > 6  # re-admissions are looked up again


def test_guaranteed_no_evict_starts_a_request_when_its_own_blocks_to_completion_fit():
    """8 free blocks: a running request needs 4 to completion, so a second one needing 4 starts with it;
    a third waits (head of line) until one finishes."""
    pool, scheduler = _setup(8)
    a = _add(scheduler, "a", list(range(10, 18)), 8)
    b = _add(scheduler, "b", list(range(20, 28)), 8)
    c = _add(scheduler, "c", list(range(30, 38)), 8)
    _step(scheduler)
    assert scheduler.running == [a, b] and list(scheduler.waiting) == [c]
    assert [scheduler.blocks_to_completion(s) for s in (a, b, c)] == [2, 2, 4]
    while c not in scheduler.running:
        _step(scheduler)
    assert scheduler.preemptions == 0 and a not in scheduler.running


def test_guaranteed_no_evict_counts_cached_blocks_as_free_but_gives_no_reuse_credit():
    """getNumFreeBlocks counts cached reusable blocks; getRemainingBlocksToCompletion counts the whole
    request, its cached prefix included: a 4-block request whose prefix is cached still needs 4."""
    pool, scheduler = _setup(4)
    prompt = list(range(50, 58))
    first = _add(scheduler, "first", prompt, 8)
    while scheduler.has_work():
        _step(scheduler)
    assert pool.lookup(prompt, salt=None)[0] == 1 and pool.num_free_blocks() == 4
    again = _add(scheduler, "again", prompt, 8)
    assert scheduler.blocks_to_completion(again) == 4
    _step(scheduler)
    assert scheduler.running == [again] and again.metrics.reused_blocks == 1
    assert first.metrics.reused_blocks == 0


def test_per_request_total_is_blocks_taken_at_admission_not_every_slot_held():
    """KVCacheManagerTest: a second identical request allocates numBlocks - numSharedBlocks; the
    total is counted around addSequence (misses + onboards), never grown by generation blocks."""
    pool, scheduler = _setup(32)
    prompt = list(range(100, 100 + 3 * BPT + 1))  # 13 tokens: 4 blocks, 3 reusable
    a = _add(scheduler, "a", prompt, 16)
    _step(scheduler)
    _step(scheduler)
    scheduler.finish(a, 0.0)
    assert (a.metrics.reused_blocks, a.metrics.new_blocks, a.metrics.total_blocks) == (0, 4, 4)
    b = _add(scheduler, "b", prompt, 16)
    _step(scheduler)
    m = b.metrics
    assert (m.reused_blocks, m.new_blocks, m.total_blocks, m.onboarded_blocks) == (3, 1, 1, 0)
    for _ in range(8):  # decoding grows the sequence past its prompt blocks
        _step(scheduler)
    assert len(b.block_slots) > 4
    assert b.metrics.total_blocks == 1


def test_onboarded_prompt_blocks_count_in_the_total():
    from retention.pool import BlockPool, PoolConfig
    from engines.reference.scheduler import Scheduler

    pool = BlockPool(PoolConfig(primary_blocks=8, secondary_blocks=8, tokens_per_block=BPT))
    scheduler = Scheduler(pool, tokens_per_block=BPT, max_batch_size=4, max_num_tokens=64)
    prompt = list(range(10, 19))  # 9 tokens: 2 reusable blocks
    pool.allocate("warm", prompt, salt=None, tenant=None, now=0.0)
    pool.release("warm", prompt, now=0.0)
    for k in range(2):  # push them to the host tier
        other = [100 * (k + 1) + j for j in range(4 * BPT + 1)]
        pool.allocate(f"o{k}", other, salt=None, tenant=None, now=1.0)
        pool.release(f"o{k}", other, now=1.0)
    assert pool.lookup(prompt, salt=None) == (2, 0, 2)
    seq = _add(scheduler, "r", prompt, 4)
    _step(scheduler)
    m = seq.metrics
    assert (m.reused_blocks, m.new_blocks, m.onboarded_blocks, m.total_blocks) == (2, 1, 2, 3)


def test_per_request_metrics_add_up_over_re_admissions_after_preemption():
    """max_utilization re-admits a preempted request; each admission's lookup is added (``+=``), so the
    requests' metrics sum to the pool's reused / missed counters."""
    pool, scheduler = _setup(6, "max_utilization")
    s1 = _add(scheduler, "s1", list(range(200, 208)), 16)
    s2 = _add(scheduler, "s2", list(range(300, 308)), 16)
    for _ in range(200):
        _step(scheduler)
        if not scheduler.has_work():
            break
    assert not scheduler.has_work() and scheduler.preemptions > 0
    stats = pool.stats()
    assert s1.metrics.reused_blocks + s2.metrics.reused_blocks == stats.reused_blocks
    assert s1.metrics.new_blocks + s2.metrics.new_blocks == stats.missed_blocks
    assert s2.metrics.new_blocks > 2  # more than the first admission's 2 prompt blocks


def test_an_unknown_policy_is_refused_by_the_scheduler_the_config_and_the_cli():
    from typer.testing import CliRunner

    from engines.reference.config import EngineConfigError, ReferenceEngineConfig
    from server.cli import create_cli

    with pytest.raises(ValueError, match="guaranteed_no_evict, max_utilization"):
        _setup(8, "guaranteed_completion")
    with pytest.raises(EngineConfigError, match="scheduler_policy must be one of guaranteed_no_evict, max_utilization"):
        ReferenceEngineConfig(scheduler_policy="static_batch")
    assert ReferenceEngineConfig().scheduler_policy == "guaranteed_no_evict"
    assert ReferenceEngineConfig(scheduler_policy="max_utilization").scheduler_policy == "max_utilization"
    result = CliRunner().invoke(create_cli(), ["engine", "serve", "--port", "0", "--scheduler-policy", "bogus"])
    assert result.exit_code == 2
    text = "".join(ch for ch in result.output if ch.isalnum() or ch in "_,'")  # the error box wraps lines
    assert "scheduler_policymustbeoneofguaranteed_no_evict,max_utilization,got'bogus'" in text
