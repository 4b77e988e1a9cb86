"""The end-of-run demote end to end: a stored Responses tool run over HTTP against the reference engine
(through the recording proxy): a step answered with a function call sends nothing more; the step answered
with a message sends one demote (trigger ``end``) of the run's own blocks at priority 0, its earlier step's
blocks included; a class without the conversation-hold switch sends none."""

from __future__ import annotations

import asyncio

import openai
import pytest

from engines.contract import parse_retention
from engines.reference.kserve import decode_inputs
from retention.hashing import block_hashes
from retention.policy.demote import shared_blocks
from tenants import tenant
from tests.server.gateway.conftest import TOKENS_PER_BLOCK
from tests.server.gateway.hinted_tenant import add_hinted_tenant
from tests.server.gateway.recording_proxy import start_proxy
from tests.server.gateway.stack import MODEL, Stack
from tests.server.gateway.test_responses_e2e import WEATHER

pytestmark = pytest.mark.slow
WAIT_STEPS = 600  # × 0.1 s: bounded waits for the gateway's background work (KV-event poll, the demote task)
OUTCOMES = ("sent", "failed", "uncached", "no_cache_view")


def _prompts(proxy, before: int = 0) -> list:  # type: ignore[no-untyped-def]
    return [r for r in proxy.requests[before:] if any(i.name == "input_ids" for i in r.inputs)]


def _ids(request) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(t) for t in decode_inputs(request)["input_ids"].reshape(-1)]


def _salted(stack: Stack, ref: str, prompt: list[int]) -> tuple[int, ...]:
    with stack.session_factory() as session:
        row = tenant.get_tenant(session, ref=ref)
        salt = None if row.isolation == "shared" else row.cache_salt
    return tuple(block_hashes(prompt, TOKENS_PER_BLOCK, salt=salt))


async def test_a_tool_run_ended_in_a_message_sends_one_end_demote_and_a_tool_call_or_the_switch_off_none(
        stack: Stack) -> None:
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    holds = stack.gateway.app.state.gateway.runner.holds  # type: ignore[attr-defined]
    # The demote fires where the hold duel holds the conversation; without the duel (tested apart in
    # test_conversation_hold.py) every conversation is held, so the outcome does not hang on a hash draw.
    duel, holds.duel = holds.duel, None
    registry = stack.gateway.app.state.gateway.registry

    def counted(name: str, trigger: str = "end") -> dict[str, float]:
        return {o: registry.get_sample_value("kvgate_conversation_demotes_total",
                                             {"tenant": name, "pool": name, "trigger": trigger, "outcome": o}) or 0.0
                for o in OUTCOMES}

    try:
        x, key = add_hinted_tenant(stack, "end", port, secondary_blocks=0, max_ttl_ms=5_000, max_priority=55)
        name = f"end-{x}"
        api = openai.AsyncOpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=120)
        text = " ".join(f"fact {i} about the weather of {x}." for i in range(12))  # several blocks of its own
        call = await api.responses.create(model=MODEL, input=text, tools=[WEATHER], tool_choice="required",
                                          max_output_tokens=64, temperature=0)
        (fc,) = [item for item in call.output if item.type == "function_call"]
        await asyncio.sleep(1.0)  # a demote would be spawned when the row is stored and sent within this
        assert len(_prompts(proxy)) == 1 and counted(name) == dict.fromkeys(OUTCOMES, 0.0)
        end = await api.responses.create(model=MODEL, previous_response_id=call.id, tools=[WEATHER],
                                         tool_choice="none", max_output_tokens=4, temperature=0,
                                         input=[{"type": "function_call_output", "call_id": fc.call_id,
                                                 "output": "Light rain, 6 C"}])
        assert end.output and all(item.type == "message" for item in end.output)
        for _ in range(WAIT_STEPS):
            if counted(name)["sent"] == 1:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"no end-of-run demote sent: {counted(name)}")
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
        assert counted(name) == {**dict.fromkeys(OUTCOMES, 0.0), "sent": 1.0}
        assert counted(name, "delete") == dict.fromkeys(OUTCOMES, 0.0)
        # The response stays stored: the run can still be continued (or deleted).
        assert (await api.responses.retrieve(end.id)).id == end.id

        # A class without the conversation-hold switch: the same run ends in a message, and nothing is sent.
        y, off_key = add_hinted_tenant(stack, "endoff", port, secondary_blocks=0, max_ttl_ms=5_000, max_priority=55,
                                       conversation_hold=False)
        off = openai.AsyncOpenAI(api_key=off_key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=120)
        before = len(proxy.requests)
        reply = await off.responses.create(model=MODEL, input=text + f" {y}", tools=[WEATHER], tool_choice="none",
                                           max_output_tokens=4, temperature=0)
        assert all(item.type == "message" for item in reply.output)
        await asyncio.sleep(1.5)
        assert len(_prompts(proxy, before)) == 1 and counted(f"endoff-{y}") == dict.fromkeys(OUTCOMES, 0.0)
    finally:
        holds.duel = duel
        await server.stop(0)
