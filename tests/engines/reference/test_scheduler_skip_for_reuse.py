"""The capacity scheduler delays a new request whose first new context block another request computes.

TensorRT-LLM (``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`` at cf6abc45): with block reuse,
``GuaranteedNoEvictScheduler::impl`` and ``MaxUtilizationScheduler::operator()`` pass each pending request
to ``beneficialToSkip`` before the capacity checks. For a request on its first context chunk,
``oneManagerBeneficialToSkip`` takes its ``findNewContextBlock`` key (``kvCacheManager.cpp`` at b35ac1b6:
the prompt's full blocks walked down the reuse tree with exact, salted keys; the key holds every token up
to the end of the first full block not in the tree, and the LoRA task, but no cache salt): if an earlier
request of the pass registered the same key (``newlyContributedContextBlocks``; requests still mid-prefill
register theirs first, ``prefillWithChunkedContextsAlreadyExecuting``), the request is skipped (``continue``)
and starts at a later iteration, reusing the blocks the first one stored at the end of its prefill
(``storeContextBlocks``, on its last context chunk).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from tests.engines.reference.test_scheduler_policy import _step  # one engine step, as the policy tests take it

BPT = 4


def _request(prompt: list[int], max_new_tokens: int = 4, salt: str | None = None):
    from engines.contract import EngineRequest, SamplingParams
    from retention.types import RetentionPlan

    return EngineRequest(input_ids=tuple(prompt), max_new_tokens=max_new_tokens, end_id=None, streaming=False,
                         sampling=SamplingParams(), retention=RetentionPlan(), cache_salt=salt, tenant_id=None)


def _setup(policy: str = "guaranteed_no_evict", *, reuse: bool = True, max_num_tokens: int = 64):
    from engines.reference.scheduler import Scheduler
    from retention.pool import BlockPool, PoolConfig

    pool = BlockPool(PoolConfig(primary_blocks=64, tokens_per_block=BPT, enable_block_reuse=reuse))
    return pool, Scheduler(pool, tokens_per_block=BPT, max_batch_size=4, max_num_tokens=max_num_tokens, policy=policy)


def _add(scheduler, name: str, prompt: list[int], max_new_tokens: int = 4, salt: str | None = None):
    from engines.reference.scheduler import Sequence

    seq = Sequence(name, _request(prompt, max_new_tokens, salt), list(prompt), len(prompt), frozenset())
    scheduler.add(seq)
    return seq


PROMPT = list(range(10, 20))  # 10 tokens: 2 full blocks, both reusable (the last token is never matched)


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_the_twin_of_a_starting_prompt_waits_one_step_and_reuses_its_blocks(policy):
    _, scheduler = _setup(policy)
    first = _add(scheduler, "first", PROMPT)
    twin = _add(scheduler, "twin", PROMPT)
    _step(scheduler)
    assert scheduler.running == [first] and list(scheduler.waiting) == [twin]
    _step(scheduler)
    assert twin in scheduler.running
    assert (first.metrics.reused_blocks, twin.metrics.reused_blocks) == (0, (len(PROMPT) - 1) // BPT)


def test_a_request_behind_a_skipped_one_still_starts():
    """``beneficialToSkip`` is a ``continue``, not the ``break`` of a request that does not fit; the skipped
    request keeps its place in the queue."""
    _, scheduler = _setup()
    first = _add(scheduler, "first", PROMPT)
    twin = _add(scheduler, "twin", PROMPT)
    other = _add(scheduler, "other", list(range(50, 60)))
    late = _add(scheduler, "late", PROMPT)
    _step(scheduler)
    assert scheduler.running == [first, other] and list(scheduler.waiting) == [twin, late]
    _step(scheduler)
    # Both twins now walk past the two cached blocks: no new context block, nothing to skip on.
    assert scheduler.running == [first, other, twin, late]
    assert twin.metrics.reused_blocks == late.metrics.reused_blocks == 2


def test_a_prompt_whose_full_blocks_are_all_cached_has_nothing_to_skip_on():
    """``findNewContextBlock`` returns nullopt when every full block (the last token's included) is in the tree,
    and for a prompt shorter than one block: such requests start together."""
    pool, scheduler = _setup()
    warm = _add(scheduler, "warm", PROMPT)
    while scheduler.has_work():
        _step(scheduler)
    assert warm.metrics.reused_blocks == 0 and pool.lookup(PROMPT, salt=None)[0] == 2
    a, b = _add(scheduler, "a", PROMPT), _add(scheduler, "b", PROMPT)
    short_a, short_b = _add(scheduler, "sa", [1, 2, 3]), _add(scheduler, "sb", [1, 2, 3])
    _step(scheduler)
    assert scheduler.running == [a, b, short_a, short_b]
    assert a.metrics.reused_blocks == b.metrics.reused_blocks == 2


def test_a_prompt_of_whole_blocks_is_keyed_on_its_last_block_too():
    """8 tokens: the first request stores block 0 only (``storeContextBlocks``: tokens but the last); the twin's
    key is then the whole prompt (block 1 is not in the tree), which nobody else registers: it starts, reusing 1."""
    _, scheduler = _setup()
    prompt = list(range(30, 38))
    first, twin = _add(scheduler, "first", prompt), _add(scheduler, "twin", prompt)
    _step(scheduler)
    assert scheduler.running == [first]
    _step(scheduler)
    assert twin in scheduler.running and twin.metrics.reused_blocks == 1


def test_the_twin_waits_while_the_first_prompt_is_prefilled_in_chunks():
    """A request mid-prefill registers its key first (``prefillWithChunkedContextsAlreadyExecuting``) and stores
    its blocks only with its last chunk: its twin is skipped at every step until then, even one with token
    budget left (the last chunk's), and then reuses every full block."""
    _, scheduler = _setup(max_num_tokens=8)
    prompt = list(range(100, 122))  # 22 tokens: chunks of 8, 8, 6; 5 reusable blocks
    first, twin = _add(scheduler, "first", prompt), _add(scheduler, "twin", prompt)
    for _ in range(3):
        _step(scheduler)
        assert scheduler.running == [first] and list(scheduler.waiting) == [twin]
    assert not first.in_prefill
    _step(scheduler)
    assert twin in scheduler.running and twin.metrics.reused_blocks == (len(prompt) - 1) // BPT


def test_a_twin_arriving_mid_prefill_is_skipped_too():
    _, scheduler = _setup(max_num_tokens=8)
    prompt = list(range(100, 122))
    first = _add(scheduler, "first", prompt)
    _step(scheduler)
    assert first.in_prefill
    twin = _add(scheduler, "twin", prompt)
    _step(scheduler)
    _step(scheduler)  # the first's last chunk leaves budget: the twin is still skipped
    assert scheduler.running == [first] and list(scheduler.waiting) == [twin]
    _step(scheduler)
    assert twin.metrics.reused_blocks == 5


def test_differently_salted_twins_delay_each_other_and_share_nothing():
    """The key carries no cache salt, while the tree walk uses it: the second waits a step, then, walking its
    own salted chain, finds nothing cached and computes everything."""
    _, scheduler = _setup()
    first = _add(scheduler, "first", PROMPT, salt="tenant-1")
    other = _add(scheduler, "other", PROMPT, salt="tenant-2")
    _step(scheduler)
    assert scheduler.running == [first] and list(scheduler.waiting) == [other]
    _step(scheduler)
    assert other in scheduler.running
    assert (other.metrics.reused_blocks, other.metrics.new_blocks) == (0, 3)


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_without_block_reuse_nothing_is_skipped(policy):
    """``beneficialToSkip`` asks ``kvCacheManager.isEnableBlockReuse()`` first."""
    _, scheduler = _setup(policy, reuse=False)
    first, twin = _add(scheduler, "first", PROMPT), _add(scheduler, "twin", PROMPT)
    _step(scheduler)
    assert scheduler.running == [first, twin]


# The real engine ------------------------------------------------------------------------------------------


class _FrozenClock:
    """The engine's clock, advanced by the test only: requests held by ``fault_first_token_hold_ms`` are all
    released by one ``_release_held`` call, so they reach the scheduler in the same pass."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _together(bundle, requests, **config) -> list[tuple[int, object]]:
    """Run ``requests`` on a fresh engine, queued at once; per request, (the engine step that produced its
    first token, its final output)."""
    from engines.reference.config import ReferenceEngineConfig
    from engines.reference.engine import ReferenceEngine

    settings = dict(kv_dtype="fp32", primary_blocks=32, secondary_blocks=0, tokens_per_block=16,
                    max_input_len=256, max_output_len=8, max_num_tokens=256, fault_first_token_hold_ms=50)
    clock = _FrozenClock()
    engine = ReferenceEngine(bundle, ReferenceEngineConfig(**{**settings, **config}), clock=clock)
    first_step: dict[str, int] = {}
    final: dict[str, object] = {}
    done = threading.Event()

    def sink_for(request_id: str):
        def sink(output) -> None:  # called on the engine thread, under its lock
            if output.new_tokens and request_id not in first_step:
                first_step[request_id] = engine.steps
            if output.finished:
                final[request_id] = output
                if len(final) == len(requests):
                    done.set()
        return sink

    engine.start()
    try:
        for i, request in enumerate(requests):
            engine.submit(f"r{i}", dataclasses.replace(request, streaming=True), sink_for(f"r{i}"))
        clock.now += 1.0  # every hold ends at once
        assert done.wait(300), "the requests did not finish"
    finally:
        engine.stop()
    assert all(final[f"r{i}"].error is None for i in range(len(requests)))
    return [(first_step[f"r{i}"], final[f"r{i}"]) for i in range(len(requests))]


def _prompt(tokenizer, tag: str, sentences: int) -> list[int]:
    from tests.engines.reference.helpers import document

    return list(tokenizer.encode(document(tag, sentences)))


@pytest.mark.slow
def test_engine_twin_prompts_the_second_starts_a_step_later_and_reuses_the_first_ones_blocks(bundle, tokenizer):
    from tests.engines.reference.helpers import make_request

    prompt = _prompt(tokenizer, "skip-twins", 5)
    assert len(prompt) > 48
    (first_at, first), (twin_at, twin) = _together(bundle, [make_request(prompt, 3, end_id=-1)] * 2)
    assert first.kv.reused_blocks == 0
    assert twin.kv.reused_blocks == (len(prompt) - 1) // 16 >= 3  # every full block but the last token's
    assert twin.kv.new_blocks == -(-len(prompt) // 16) - twin.kv.reused_blocks
    assert twin_at == first_at + 1  # skipped at the first's prefill step, started at its first decode step


@pytest.mark.slow
def test_engine_twin_of_a_chunked_prefill_waits_for_its_last_chunk(bundle, tokenizer):
    """``max_num_tokens`` 32: the first prompt is prefilled over several steps; the twin is skipped at each of
    them (the last chunk leaves budget it would otherwise take) and then reuses every full block."""
    from tests.engines.reference.helpers import make_request

    prompt = _prompt(tokenizer, "skip-chunked", 7)
    assert len(prompt) > 96 and len(prompt) % 32  # several chunks; the last one leaves token budget
    (first_at, first), (twin_at, twin) = _together(
        bundle, [make_request(prompt, 3, end_id=-1)] * 2, max_num_tokens=32, max_batch_size=4)
    assert first.kv.reused_blocks == 0
    assert twin.kv.reused_blocks == (len(prompt) - 1) // 16
    assert twin_at >= first_at + 1


@pytest.mark.slow
def test_engine_differently_salted_twins_delay_each_other_and_reuse_nothing(bundle, tokenizer):
    from tests.engines.reference.helpers import make_request

    prompt = _prompt(tokenizer, "skip-salted", 5)
    requests = [make_request(prompt, 3, end_id=-1, salt=salt) for salt in ("tenant-one", "tenant-two")]
    (first_at, first), (second_at, second) = _together(bundle, requests)
    assert first.kv.reused_blocks == second.kv.reused_blocks == 0
    assert second.kv.new_blocks == -(-len(prompt) // 16)
    assert second_at == first_at + 1


@pytest.mark.slow
def test_engine_without_block_reuse_twins_start_together(bundle, tokenizer):
    """The same pair, reuse on and off: only with reuse is the second delayed."""
    from tests.engines.reference.helpers import make_request

    prompt = _prompt(tokenizer, "skip-off", 5)
    pair = [make_request(prompt, 3, end_id=-1)] * 2
    (on_first, _), (on_twin, _) = _together(bundle, pair)
    (off_first, a), (off_twin, b) = _together(bundle, pair, enable_block_reuse=False)
    assert on_twin == on_first + 1
    assert off_twin == off_first
    assert a.kv.reused_blocks == b.kv.reused_blocks == 0
