"""The end-of-run demote end to end: stored Responses tool runs over HTTP against the reference engine
(through the recording proxy). For a class with ``conversation_end_demote_enabled`` alone (the hold off,
the pool's duel as shipped): a step answered with a function call sends nothing more; the step answered
with a message sends one demote (trigger ``end``) of the run's own blocks at priority 0, its earlier
step's blocks included. The hold's switch alone sends none, even where its duel holds the conversation;
with both switches on the end demote fires even where the duel holds nothing."""

from __future__ import annotations

import asyncio

import openai
import pytest

from engines.contract import parse_retention
from engines.reference.kserve import decode_inputs
from retention.hashing import block_hashes
from retention.policy.demote import shared_blocks
from retention.policy.hint_quota import HintLedger
from tenants import tenant
from tests.server.gateway.conftest import TOKENS_PER_BLOCK
from tests.server.gateway.hinted_tenant import add_hinted_tenant
from tests.server.gateway.recording_proxy import start_proxy
from tests.server.gateway.stack import MODEL, Stack
from tests.server.gateway.test_responses_e2e import WEATHER

pytestmark = pytest.mark.slow
WAIT_STEPS = 600  # × 0.1 s: bounded waits for the gateway's background work (KV-event poll, the demote task)
OUTCOMES = ("sent", "failed", "uncached", "no_cache_view")
NONE = dict.fromkeys(OUTCOMES, 0.0)


def _prompts(proxy, before: int = 0) -> list:  # type: ignore[no-untyped-def]
    return [r for r in proxy.requests[before:] if any(i.name == "input_ids" for i in r.inputs)]


def _ids(request) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(t) for t in decode_inputs(request)["input_ids"].reshape(-1)]


def _tenant_row(stack: Stack, ref: str):  # type: ignore[no-untyped-def]
    with stack.session_factory() as session:
        row = tenant.get_tenant(session, ref=ref)
        return row.id, None if row.isolation == "shared" else row.cache_salt


def _salted(stack: Stack, ref: str, prompt: list[int]) -> tuple[int, ...]:
    return tuple(block_hashes(prompt, TOKENS_PER_BLOCK, salt=_tenant_row(stack, ref)[1]))


def _counter(stack: Stack):  # type: ignore[no-untyped-def]
    registry = stack.gateway.app.state.gateway.registry

    def counted(name: str, trigger: str = "end") -> dict[str, float]:
        return {o: registry.get_sample_value("kvgate_conversation_demotes_total",
                                             {"tenant": name, "pool": name, "trigger": trigger, "outcome": o}) or 0.0
                for o in OUTCOMES}
    return counted


async def _until_sent(counted, name: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(WAIT_STEPS):
        if counted(name)["sent"] == 1:
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"no end-of-run demote sent: {counted(name)}")


def _client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=120)


def _text(x: str) -> str:
    return " ".join(f"fact {i} about the weather of {x}." for i in range(12))  # several blocks of its own


async def test_the_end_switch_alone_sends_one_end_demote_at_a_runs_end_and_none_after_a_tool_call(
        stack: Stack) -> None:
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    counted = _counter(stack)
    try:
        # The hold is off: no duel decides anything here (the pool's duel is the shipped one, untouched).
        x, key = add_hinted_tenant(stack, "end", port, secondary_blocks=0, max_ttl_ms=5_000, max_priority=55,
                                   conversation_hold=False, end_demote=True)
        name = f"end-{x}"
        api = _client(stack, key)
        call = await api.responses.create(model=MODEL, input=_text(x), tools=[WEATHER], tool_choice="required",
                                          max_output_tokens=64, temperature=0)
        (fc,) = [item for item in call.output if item.type == "function_call"]
        await asyncio.sleep(1.0)  # a demote would be spawned when the row is stored and sent within this
        assert len(_prompts(proxy)) == 1 and counted(name) == NONE
        end = await api.responses.create(model=MODEL, previous_response_id=call.id, tools=[WEATHER],
                                         tool_choice="none", max_output_tokens=4, temperature=0,
                                         input=[{"type": "function_call_output", "call_id": fc.call_id,
                                                 "output": "Light rain, 6 C"}])
        assert end.output and all(item.type == "message" for item in end.output)
        await _until_sent(counted, name)
        first, last, *demotes = _prompts(proxy)
        assert len(demotes) == 1
        p1, p2 = _ids(first), _ids(last)
        h1, h2 = _salted(stack, name, p1), _salted(stack, name, p2)
        tensors = decode_inputs(demotes[0])
        sent = [int(t) for t in tensors["input_ids"].reshape(-1)]
        assert sent == p2[:len(sent)] and len(sent) <= len(p2)
        assert int(tensors["request_output_len"].reshape(-1)[0]) == 1
        plan = parse_retention(tensors, len(sent))
        tail = plan.ranges[-1]
        assert (tail.end, tail.priority, tail.duration_ms) == (None, 0, None) and plan.decode_priority == 0
        assert tail.start % TOKENS_PER_BLOCK == 0 and tail.start < len(sent) - 1
        # The run's own earlier step (still stored) protects nothing: its blocks are in the range.
        assert tail.start < shared_blocks(h2, h1) * TOKENS_PER_BLOCK
        assert counted(name) == {**NONE, "sent": 1.0} and counted(name, "delete") == NONE
        # The response stays stored: the run can still be continued (or deleted).
        assert (await api.responses.retrieve(end.id)).id == end.id
    finally:
        await server.stop(0)


async def test_the_hold_switch_alone_sends_no_end_demote_and_both_switches_send_one_whatever_the_duel(
        stack: Stack) -> None:
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    holds = stack.gateway.app.state.gateway.runner.holds  # type: ignore[attr-defined]
    counted = _counter(stack)
    shipped = holds.duel
    try:
        # The hold alone, with no duel (every conversation held, where the end demote used to fire): nothing.
        holds.duel = None
        y, hold_key = add_hinted_tenant(stack, "endhold", port, secondary_blocks=0, max_ttl_ms=5_000,
                                        max_priority=55)
        before = len(proxy.requests)
        reply = await _client(stack, hold_key).responses.create(model=MODEL, input=_text(y), tools=[WEATHER],
                                                                tool_choice="none", max_output_tokens=4,
                                                                temperature=0)
        assert all(item.type == "message" for item in reply.output)
        await asyncio.sleep(1.5)
        assert len(_prompts(proxy, before)) == 1 and counted(f"endhold-{y}") == NONE

        # Both switches, under the shipped duel on a new pool (no evidence yet: on "never", nothing
        # held): the end demote still fires, once.
        holds.duel = shipped
        z, both_key = add_hinted_tenant(stack, "endboth", port, secondary_blocks=0, max_ttl_ms=5_000,
                                        max_priority=55, end_demote=True)
        name = f"endboth-{z}"
        before = len(proxy.requests)
        reply = await _client(stack, both_key).responses.create(model=MODEL, input=_text(z), tools=[WEATHER],
                                                                tool_choice="none", max_output_tokens=4,
                                                                temperature=0)
        assert all(item.type == "message" for item in reply.output)
        duel = holds.ledger(name, HintLedger()).duel  # the pool's ledger, made when the request was planned
        assert duel is not None and not duel.holds()
        await _until_sent(counted, name)
        await asyncio.sleep(0.5)  # a second demote would be sent within this
        assert len(_prompts(proxy, before)) == 2 and counted(name) == {**NONE, "sent": 1.0}
    finally:
        holds.duel = shipped
        await server.stop(0)
