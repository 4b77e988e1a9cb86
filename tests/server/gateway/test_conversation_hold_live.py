"""The conversation hold end to end: Responses chains with tools over HTTP, against the reference engine
through a recording proxy (what the engine receives), then a DELETE the ledger hears of."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from engines.contract import parse_retention
from engines.reference.kserve import decode_inputs
from retention.policy.hint_quota import MIN_GAP_SAMPLES
from tests.server.gateway.conftest import TOKENS_PER_BLOCK
from tests.server.gateway.hinted_tenant import add_hinted_tenant
from tests.server.gateway.recording_proxy import start_proxy
from tests.server.gateway.stack import MODEL, Stack
from tests.server.gateway.test_responses_e2e import WEATHER

pytestmark = pytest.mark.slow
HOLD_PRIORITY = 55  # the class's hint_max_priority: above its own 35 everywhere
MAX_TTL_MS = 5_000  # short: the engine is shared with the rest of the suite, and a duration cannot be revoked


async def test_a_measured_tool_loop_is_held_at_enqueue_and_a_delete_is_heard(stack: Stack) -> None:
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    holds = stack.gateway.app.state.gateway.runner.holds  # type: ignore[attr-defined]
    # The hold alone: without its duel (retention/policy/hold_duel.py, tested apart) the pool holds only once
    # the held shadow has proven it, which takes hundreds of sampled references.
    duel, holds.duel = holds.duel, None
    try:
        x, key = add_hinted_tenant(stack, "conv", port, secondary_blocks=512, max_ttl_ms=MAX_TTL_MS,
                                   max_priority=HOLD_PRIORITY)
        api = openai.AsyncOpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=120)

        async def sent_for(call):  # type: ignore[no-untyped-def]
            before = len(proxy.requests)
            reply = await call
            # A stored tool step answered with a message ends its run: the gateway then demotes it in the
            # background (conversation_demote.py), a request of its own, left out here.
            (sent,) = [r for r in proxy.requests[before:]
                       if any(i.name == "input_ids" for i in r.inputs) and not r.id.startswith("demote-")]
            return reply, sent

        # Before any gap is measured nothing is held: the class's plan goes out as is. (Not stored: a stored
        # conversation also gets the Responses dialect's own conversation hint.)
        first, sent = await sent_for(api.responses.create(model=MODEL, input=f"Weather in Oslo? {x}", tools=[WEATHER],
                                                          max_output_tokens=1, temperature=0, store=False))
        plan = parse_retention(decode_inputs(sent), first.usage.input_tokens)
        assert plan.decode_priority == 35 and all(r.priority == 35 for r in plan.ranges)
        first = await api.responses.create(model=MODEL, input=f"Weather in Oslo? {x}", tools=[WEATHER],
                                           max_output_tokens=1, temperature=0)
        previous = first.id
        for i in range(MIN_GAP_SAMPLES):  # one stored chain: each step continues the last (a measured tool gap)
            reply = await api.responses.create(model=MODEL, input=f"step {i}", tools=[WEATHER], max_output_tokens=1,
                                               temperature=0, previous_response_id=previous)
            previous = reply.id
        # Now a request offering tools (here through chat completions: any dialect) is held, prompt and decode.
        chat, sent = await sent_for(api.chat.completions.create(
            model=MODEL, max_tokens=1, temperature=0,
            # long enough for full blocks of its own past the preamble it shares with the conversation
            messages=[{"role": "user", "content": f"Rain in Bergen? {x} " + "And tomorrow, and the day after? " * 4}],
            tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]))
        total = chat.usage.prompt_tokens
        plan = parse_retention(decode_inputs(sent), total)
        priority, duration = plan.retention_at(0)
        assert priority == HOLD_PRIORITY and duration is not None and 1_000 <= duration <= MAX_TTL_MS
        assert (plan.decode_priority, plan.decode_duration_ms) == (HOLD_PRIORITY, duration)
        assert plan.retention_at((total // TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK)[0] == 35  # the partial tail: not held
        # A plain request (no tools, not stored) is not held.
        plain, sent = await sent_for(api.chat.completions.create(model=MODEL, max_tokens=1, temperature=0,
                                                                 messages=[{"role": "user", "content": f"Hi {x}"}]))
        plan = parse_retention(decode_inputs(sent), plain.usage.prompt_tokens)
        assert plan.decode_priority == 35 and all(r.priority == 35 for r in plan.ranges)
        # DELETE answers as OpenAI does and the stored response is gone; the ledger no longer measures its chain.
        deleted = httpx.delete(f"{stack.gateway.base_url}/v1/responses/{previous}",
                               headers={"Authorization": f"Bearer {key}"})
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(previous)
    finally:
        holds.duel = duel
        await server.stop(0)


async def test_a_class_with_hints_but_without_the_conversation_switch_holds_no_tool_loop(stack: Stack) -> None:
    """The same measured tool loop as above, for a class whose hints are on and whose conversation
    hold is off: the request offering tools goes out with the class's own plan."""
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    try:
        x, key = add_hinted_tenant(stack, "noconv", port, secondary_blocks=512, max_ttl_ms=MAX_TTL_MS,
                                   max_priority=HOLD_PRIORITY, conversation_hold=False)
        api = openai.AsyncOpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=120)
        previous = (await api.responses.create(model=MODEL, input=f"Weather in Oslo? {x}", tools=[WEATHER],
                                               max_output_tokens=1, temperature=0)).id
        for i in range(MIN_GAP_SAMPLES):  # gaps enough for a hold, had the class allowed one
            previous = (await api.responses.create(model=MODEL, input=f"step {i}", tools=[WEATHER],
                                                   max_output_tokens=1, temperature=0,
                                                   previous_response_id=previous)).id
        before = len(proxy.requests)
        chat = await api.chat.completions.create(
            model=MODEL, max_tokens=1, temperature=0,
            # long enough for full blocks of its own past the preamble it shares with the conversation
            messages=[{"role": "user", "content": f"Rain in Bergen? {x} " + "And tomorrow, and the day after? " * 4}],
            tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}])
        (sent,) = [r for r in proxy.requests[before:] if any(i.name == "input_ids" for i in r.inputs)]
        plan = parse_retention(decode_inputs(sent), chat.usage.prompt_tokens)
        # No tool-loop hold: neither its generated tokens nor its own prompt blocks are held. The
        # tool preamble it shares with the stored conversation (hinted at the class's caps) keeps
        # the rest of that hint's hold (keep_pins): a read must not cut another request's hint short.
        assert plan.decode_priority == 35
        full_end = chat.usage.prompt_tokens // stack.tokens_per_block * stack.tokens_per_block
        assert plan.retention_at(full_end - 1)[0] == 35, plan.ranges
        assert all(r.priority == 35 or (r.priority == HOLD_PRIORITY and 0 < (r.duration_ms or 0) <= MAX_TTL_MS)
                   for r in plan.ranges), plan.ranges
        # Nor does its DELETE send a demote (the same switch): the stored response goes, nothing else.
        deleted = httpx.delete(f"{stack.gateway.base_url}/v1/responses/{previous}",
                               headers={"Authorization": f"Bearer {key}"})
        assert deleted.status_code == 200
        await asyncio.sleep(1.0)  # a demote would be spawned by the DELETE and sent within this
        assert [r for r in proxy.requests[before:] if any(i.name == "input_ids" for i in r.inputs)] == [sent]
        registry = stack.gateway.app.state.gateway.registry
        assert all(registry.get_sample_value("kvgate_conversation_demotes_total",
                                             {"tenant": f"noconv-{x}", "pool": f"noconv-{x}", "trigger": t,
                                              "outcome": o}) is None
                   for o in ("sent", "failed", "uncached", "no_cache_view") for t in ("delete", "end"))
    finally:
        await server.stop(0)
