"""The engine in-process: preemption under KV pressure (max_utilization), sampling, config validation."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from engines.contract import SamplingParams
from engines.reference.config import EngineConfigError, ReferenceEngineConfig
from engines.reference.engine import DuplicateRequestError, EngineStoppedError, ReferenceEngine
from engines.reference.scheduler import FinishReason
from tests.engines.reference.helpers import make_request

pytestmark = pytest.mark.slow


async def _collect(engine, request_id, request):
    tokens, last = [], None
    async for output in engine.generate(request_id, request):
        tokens.extend(output.new_tokens)
        last = output
    return tokens, last


@pytest.fixture
def small_engine(bundle):
    engine = ReferenceEngine(bundle, ReferenceEngineConfig(
        kv_dtype="fp32", primary_blocks=4, secondary_blocks=0, tokens_per_block=16,
        max_input_len=24, max_output_len=40, max_num_tokens=64, scheduler_policy="max_utilization",
    ))
    engine.start()
    yield engine
    engine.stop()


# Two prompts of two 16-token blocks each: both fit at first, not when they grow to 40 more tokens.
PAIR = ("Once upon a time in a quiet little village by the sea, there lived an old fisherman who",
        "The three most important rules of cooking pasta at home, according to every Italian grandmother, are")


async def test_guaranteed_no_evict_runs_the_pair_one_after_the_other_without_preemption(bundle, tokenizer):
    """The default policy: two requests needing 4 blocks each to completion in a 4-block pool never run
    together, so nothing is preempted, and the answers are the same."""
    engine = ReferenceEngine(bundle, ReferenceEngineConfig(
        kv_dtype="fp32", primary_blocks=4, secondary_blocks=0, tokens_per_block=16,
        max_input_len=24, max_output_len=40, max_num_tokens=64,
    ))
    engine.start()
    try:
        requests = [make_request(tokenizer.encode(text), 40, end_id=-1) for text in PAIR]
        solo = [await _collect(engine, f"solo{i}", r) for i, r in enumerate(requests)]
        together = await asyncio.gather(*[_collect(engine, f"pair{i}", r) for i, r in enumerate(requests)])
        assert engine.scheduler.preemptions == 0
        assert [t for t, _ in together] == [t for t, _ in solo]
    finally:
        engine.stop()


async def test_decode_growth_preempts_and_recomputes_without_changing_output(small_engine, tokenizer):
    prompts = [tokenizer.encode("Once upon a time in a quiet little village by the sea, there lived an old fisherman who"),
               tokenizer.encode("The three most important rules of cooking pasta at home, according to every Italian grandmother, are")]
    assert all(16 < len(p) <= 24 for p in prompts)  # two blocks each: both fit at first, not when they grow
    requests = [make_request(p, 40, end_id=-1) for p in prompts]
    solo = [await _collect(small_engine, f"solo{i}", r) for i, r in enumerate(requests)]
    assert small_engine.scheduler.preemptions == 0
    together = await asyncio.gather(*[_collect(small_engine, f"pair{i}", r) for i, r in enumerate(requests)])
    assert small_engine.scheduler.preemptions > 0
    assert [t for t, _ in together] == [t for t, _ in solo]
    assert all(last.finish_reason is FinishReason.LENGTH and len(t) == 40 for t, last in together)
    assert small_engine.stats().primary.used_blocks == 0


async def test_seeded_sampling_is_reproducible(small_engine, tokenizer):
    prompt = tokenizer.encode("Write a word:")
    sampled = dataclasses.replace(
        make_request(prompt, 10, end_id=-1), sampling=SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    )
    first, _ = await _collect(small_engine, "s1", sampled)
    second, _ = await _collect(small_engine, "s2", sampled)
    other, _ = await _collect(small_engine, "s3", dataclasses.replace(sampled, sampling=SamplingParams(1.0, 0.9, 50, 8)))
    assert first == second and len(first) == 10
    assert other != first


async def test_duplicate_ids_and_stopped_engine_are_refused(bundle, tokenizer):
    engine = ReferenceEngine(bundle, ReferenceEngineConfig(kv_dtype="fp32", primary_blocks=8, max_input_len=64, max_output_len=64))
    request = make_request(tokenizer.encode("Hi"), 4)
    with pytest.raises(EngineStoppedError):
        engine.submit("a", request, lambda _: None)
    engine.start()
    try:
        engine.submit("a", dataclasses.replace(request, max_new_tokens=64, end_id=None), lambda _: None)
        with pytest.raises(DuplicateRequestError):
            engine.submit("a", request, lambda _: None)
    finally:
        engine.stop()
    assert engine.stats().primary.used_blocks == 0


def test_in_process_requests_over_the_limits_are_refused_not_left_waiting(bundle, tokenizer):
    """In-process callers get the contract's input and output limits too: under guaranteed_no_evict a
    request that can never fit would otherwise wait at the head of the queue for good, and every
    request behind it with it."""
    from engines.contract import ContractError

    engine = ReferenceEngine(bundle, ReferenceEngineConfig(kv_dtype="fp32", primary_blocks=6, tokens_per_block=16,
                                                           max_input_len=32, max_output_len=48))
    engine.start()
    try:
        with pytest.raises(ContractError, match="request_output_len|max"):
            engine.submit("big", make_request(tokenizer.encode("Hi"), 200), lambda _: None)
        with pytest.raises(ContractError):
            engine.submit("long", make_request(tuple(range(10, 50)), 4), lambda _: None)
        engine.submit("small", make_request(tokenizer.encode("Hi"), 4), lambda _: None)  # still served
    finally:
        engine.stop()


@pytest.mark.parametrize("change,named", [
    ({"primary_blocks": 0}, "primary_blocks"),
    ({"kv_dtype": "int4"}, "kv_dtype"),
    ({"secondary_offload_min_priority": 200}, "secondary_offload_min_priority"),
    ({"max_input_len": 100_000}, "primary pool"),
    ({"weight_format": "fp64"}, "weight_format"),
    ({"max_num_tokens": 4, "max_batch_size": 8}, "max_num_tokens"),
    ({"fault_onboard_delay_ms": -1}, "fault_onboard_delay_ms"),
    ({"fault_first_token_hold_ms": -2}, "fault_first_token_hold_ms"),
])
def test_config_validation_names_the_setting(change, named):
    with pytest.raises(EngineConfigError, match=named):
        ReferenceEngineConfig(**change)


async def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(small_engine, tokenizer):
    real = small_engine.runner.model

    class FailOnce:
        def __init__(self) -> None:
            self.failed = False

        def forward(self, batch, cache):
            if not self.failed:
                self.failed = True
                raise RuntimeError("injected fault")
            return real.forward(batch, cache)

    small_engine.runner.model = FailOnce()
    try:
        request = make_request(tokenizer.encode("Hello there, how are you today?"), 4, end_id=-1)
        tokens, last = await _collect(small_engine, "boom", request)
        assert last.finished and last.error is not None and "injected fault" in last.error
        tokens, last = await _collect(small_engine, "after", request)
        assert last.error is None and len(tokens) == 4
    finally:
        small_engine.runner.model = real
    assert small_engine.stats().primary.used_blocks == 0


async def test_the_first_token_hold_knob_holds_until_due_or_cancelled(small_engine, tokenizer):
    request = make_request(tokenizer.encode("Hello there, how are you today?"), 3, end_id=-1)
    small_engine.config.fault_first_token_hold_ms = -1  # hung: accepted, never scheduled
    try:
        hung = small_engine.generate("hung", request)
        waiting = asyncio.ensure_future(anext(hung))
        await asyncio.sleep(0.5)
        assert not waiting.done() and small_engine.in_flight() == 1
        assert small_engine.stats().primary.used_blocks == 0  # held, not scheduled
        assert small_engine.cancel("hung")
        output = await asyncio.wait_for(waiting, 10)
        assert output.finished and output.finish_reason is FinishReason.CANCELLED and output.new_tokens == ()
        await hung.aclose()
        assert small_engine.in_flight() == 0
        # a timed hold: the request runs once it is due, with the same tokens as without a hold
        small_engine.config.fault_first_token_hold_ms = 300
        began = time.monotonic()
        held, _ = await _collect(small_engine, "held", request)
        assert time.monotonic() - began >= 0.3  # a lower bound only: the hold happened
    finally:
        small_engine.config.fault_first_token_hold_ms = 0
    plain, _ = await _collect(small_engine, "plain", request)
    assert held == plain and len(plain) == 3
    assert small_engine.in_flight() == 0 and small_engine.stats().primary.used_blocks == 0
