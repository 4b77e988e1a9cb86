"""The reference engine's scheduler: when a running request's blocks are stored for reuse (TensorRT-LLM's rules)."""

from __future__ import annotations


def _request(prompt: list[int], max_new_tokens: int = 16):
    from engines.contract import EngineRequest, SamplingParams
    from retention.types import RetentionPlan

    return EngineRequest(input_ids=tuple(prompt), max_new_tokens=max_new_tokens, end_id=None, streaming=False,
                         sampling=SamplingParams(), retention=RetentionPlan(), cache_salt=None, tenant_id=None)


def test_blocks_are_stored_when_tensorrt_llm_stores_them():
    """At the end of the prefill, the full blocks of all prompt tokens but the last (storeContextBlocks);
    then at the decode step where the tokens before its sample fill whole blocks, one or more
    (storeNewBlock): a prompt of exactly two blocks has its second one stored at the first decode step."""
    from engines.contract import EngineRequest, SamplingParams
    from engines.reference.scheduler import Scheduler, Sequence
    from retention.pool import BlockPool, PoolConfig
    from retention.pool.events import StoredEvent
    from retention.types import RetentionPlan

    bpt = 4
    pool = BlockPool(PoolConfig(primary_blocks=16, tokens_per_block=bpt))
    scheduler = Scheduler(pool, tokens_per_block=bpt, max_batch_size=4, max_num_tokens=64)
    prompt = list(range(10, 10 + 2 * bpt))
    request = EngineRequest(input_ids=tuple(prompt), max_new_tokens=16, end_id=None, streaming=False,
                            sampling=SamplingParams(), retention=RetentionPlan(), cache_salt=None, tenant_id=None)
    seq = Sequence("r", request, list(prompt), len(prompt), frozenset())
    scheduler.add(seq)
    stored = []
    for _ in range(7):
        step = scheduler.schedule(0.0)
        for work in (*step.decodes, *step.prefills):  # what the step runner does
            work.seq.num_computed = work.start + work.length
        scheduler.store_computed(step)
        stored.append(sum(len(e.blocks) for e in pool.take_events() if isinstance(e, StoredEvent)))
        seq.tokens.append(99)  # the engine accepts the step's sample
    assert stored == [1, 1, 0, 0, 0, 1, 0]  # prefill: block 0; decode 1: block 1; decode 5 (12 tokens): block 2


def test_a_prompt_shorter_than_one_block_has_its_first_block_stored_when_decoding_fills_it():
    """storeNewBlock (kvCacheManager.cpp) stores all blocks when ``blockKeys.size() < 2``: with 3 prompt
    tokens and 4 per block, the decode step fed token 5 (4 tokens before it) stores block 0, and a
    request arriving then reuses it."""
    from engines.reference.scheduler import Scheduler, Sequence
    from retention.pool import BlockPool, PoolConfig
    from retention.pool.events import StoredEvent

    bpt = 4
    pool = BlockPool(PoolConfig(primary_blocks=16, tokens_per_block=bpt))
    scheduler = Scheduler(pool, tokens_per_block=bpt, max_batch_size=4, max_num_tokens=64)
    prompt = [10, 11, 12]
    seq = Sequence("r", _request(prompt), list(prompt), len(prompt), frozenset())
    scheduler.add(seq)
    stored = []
    for _ in range(7):
        step = scheduler.schedule(0.0)
        for work in (*step.decodes, *step.prefills):
            work.seq.num_computed = work.start + work.length
        scheduler.store_computed(step)
        stored.append(sum(len(e.blocks) for e in pool.take_events() if isinstance(e, StoredEvent)))
        seq.tokens.append(99)
        if stored[-1]:
            assert pool.lookup([10, 11, 12, 99, 7], salt=None) == (1, 1, 0)
    assert stored == [0, 0, 1, 0, 0, 0, 1]  # tokens before the sample: 2, 3, 4 (block 0), ..., 8 (block 1)
