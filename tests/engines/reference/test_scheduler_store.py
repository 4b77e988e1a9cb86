"""The reference engine's scheduler: when a running request's blocks are stored for reuse (TensorRT-LLM's rules)."""

from __future__ import annotations


def test_blocks_are_stored_when_tensorrt_llm_stores_them():
    """At the end of the prefill, the full blocks of all prompt tokens but the last (storeContextBlocks);
    then at the decode step where the tokens before its sample fill whole blocks, two at least
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
