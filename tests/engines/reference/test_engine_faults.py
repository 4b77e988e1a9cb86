"""The engine loop under injected faults: every request in flight still gets its final output,
and an engine that cannot go on says so (is_running False, submit refused) instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from engines.reference.config import ReferenceEngineConfig
from engines.reference.engine import EngineStoppedError, ReferenceEngine
from engines.reference.scheduler import FinishReason
from engines.reference.server import KvgateInferenceServicer
from tests.engines.reference.helpers import make_request

pytestmark = pytest.mark.slow

ANSWER_WITHIN_S = 30.0
CONFIG = dict(kv_dtype="fp32", primary_blocks=8, secondary_blocks=0, tokens_per_block=16,
              max_input_len=32, max_output_len=8, max_num_tokens=64)


@pytest.fixture
def engine(bundle):
    engine = ReferenceEngine(bundle, ReferenceEngineConfig(**CONFIG))
    engine.start()
    yield engine
    engine.stop()


async def _run(engine, request_id, request):
    async def collect():
        tokens, last = [], None
        async for output in engine.generate(request_id, request):
            tokens.extend(output.new_tokens)
            last = output
        return tokens, last

    return await asyncio.wait_for(collect(), ANSWER_WITHIN_S)


async def test_a_fault_outside_the_step_fails_the_requests_in_flight_and_the_loop_goes_on(engine, tokenizer, monkeypatch):
    """An exception in the KV-event pump (outside the forward's and the scheduler's own guards) used
    to kill the engine thread: the request never finished and every later one hung."""
    real_pump = engine._pump_events
    calls = 0

    def flaky_pump():
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected pump failure")
        real_pump()

    cursor = engine.stats(events_since=0).kv_events.next_seq  # a poller in step with the ring
    monkeypatch.setattr(engine, "_pump_events", flaky_pump)
    prompt = tokenizer.encode("Write a word:")
    _, last = await _run(engine, "first", make_request(prompt, 3, end_id=-1))
    assert last.finished and "injected pump failure" in last.error
    assert engine.is_running()
    # the failed step's events may be lost: the poller is sent a snapshot, not a stream with a hole
    assert engine.stats(events_since=cursor).kv_events.snapshot is not None
    tokens, last = await _run(engine, "second", make_request(prompt, 3, end_id=-1))
    assert last.finish_reason is FinishReason.LENGTH and last.error is None and len(tokens) == 3
    assert engine.in_flight() == 0 and engine.stats().primary.used_blocks == 0


async def test_a_fault_on_every_iteration_stops_the_engine_cleanly(engine, tokenizer, monkeypatch):
    """A fault that recurs (state taken as corrupt) stops the engine: it reports not running and
    refuses new work instead of spinning or accepting requests nothing will serve."""
    def broken(*args, **kwargs):
        raise RuntimeError("injected cancel failure")

    monkeypatch.setattr(engine, "_apply_cancels", broken)
    prompt = tokenizer.encode("Write a word:")
    errors = []
    while engine.is_running():
        try:
            _, last = await _run(engine, f"r{len(errors)}", make_request(prompt, 3, end_id=-1))
        except EngineStoppedError:
            break
        assert last.finished and last.error is not None
        errors.append(last.error)
        assert len(errors) <= 10, "the engine never gave up"
    assert errors and "injected cancel failure" in errors[0]
    await asyncio.to_thread(engine._thread.join, ANSWER_WITHIN_S)
    assert not engine.is_running()
    # not live either: only a restart brings it back, and the liveness probe asks for one
    servicer = KvgateInferenceServicer(engine)
    assert not (await servicer.ServerLive(None, None)).live and not (await servicer.ServerReady(None, None)).ready
    with pytest.raises(EngineStoppedError):
        await _run(engine, "after", make_request(prompt, 3, end_id=-1))


def test_a_dead_engine_thread_is_not_running_and_refuses_work(bundle, tokenizer, monkeypatch):
    """However the thread ended, is_running() (ServerReady/ModelReady) turns false and submit()
    refuses (UNAVAILABLE) rather than queueing work no thread will serve."""
    engine = ReferenceEngine(bundle, ReferenceEngineConfig(**CONFIG))
    monkeypatch.setattr(engine, "_loop", lambda: None)  # the thread ends at once, as a crashed one would
    engine.start()
    engine._thread.join(ANSWER_WITHIN_S)
    try:
        assert not engine.is_running()
        with pytest.raises(EngineStoppedError):
            engine.submit("late", make_request(tokenizer.encode("Hi"), 2), lambda output: None)
    finally:
        engine.stop()
