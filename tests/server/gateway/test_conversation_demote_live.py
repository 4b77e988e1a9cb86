"""Demote on delete end to end: a stored response over HTTP, then its DELETE leads to one engine request
(seen through the recording proxy) that re-claims the conversation's own cached blocks at priority 0 —
also when the DELETE reaches another gateway on the same registry, which knows the conversation only
from the response store."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from engines.contract import parse_retention
from retention.hashing import block_hashes
from retention.policy.demote import shared_blocks
from engines.reference.kserve import decode_inputs
from tenants import tenant
from tests.server.gateway.conftest import TOKENS_PER_BLOCK
from tests.server.gateway.hinted_tenant import add_hinted_tenant
from tests.server.gateway.recording_proxy import start_proxy
from server.gateway.services import LoopIntervals
from server.serving import build_serving_app
from tests.server.gateway.stack import MODEL, GatewayServer, Stack, free_port

pytestmark = pytest.mark.slow
WAIT_STEPS = 600  # × 0.1 s: bounded waits for the gateway's background work (KV-event poll, the demote task)


def _engine_requests(proxy) -> list:  # type: ignore[no-untyped-def]
    return [r for r in proxy.requests if any(i.name == "input_ids" for i in r.inputs)]


def _salted(stack: Stack, ref: str, prompt: list[int]) -> tuple[int, ...]:
    with stack.session_factory() as session:
        row = tenant.get_tenant(session, ref=ref)
        salt = None if row.isolation == "shared" else row.cache_salt
    return tuple(block_hashes(prompt, TOKENS_PER_BLOCK, salt=salt))


async def _wait_until_indexed(gateway: GatewayServer, pool: str, hashes: tuple[int, ...]) -> None:
    """Until the gateway's router index holds ``hashes`` (this prompt's own: the engine is shared with
    the suite, so the index holds others' too)."""
    full = len(hashes)
    for _ in range(WAIT_STEPS):
        route = gateway.app.state.gateway.routing.pools.get(pool)
        if route is not None and route.replicas and max(
                m.gpu_blocks + m.host_blocks
                for m in (route.router.match(r, hashes, now=time.monotonic()) for r in route.replicas)) >= full:
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"the router's KV-event index never showed the prompt's {full} blocks")


@pytest.mark.parametrize("secondary_blocks, demoted_at", [
    (0, 0),  # no host tier: priority 0, first out and dropped
    (512, 30),  # a host tier: the pool's offload threshold (30), first out of the GPU but offloaded
])
async def test_a_delete_sends_one_demote_request_at_the_pools_demote_priority_for_the_conversations_range(
        stack: Stack, secondary_blocks: int, demoted_at: int) -> None:
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    try:
        x, key = add_hinted_tenant(stack, "demote", port, secondary_blocks=secondary_blocks, max_ttl_ms=5_000,
                                   max_priority=55)
        api = openai.AsyncOpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=120)
        text = " ".join(f"fact {i} about the fjords of {x}." for i in range(12))  # several blocks of its own
        reply = await api.responses.create(model=MODEL, input=text, max_output_tokens=1, temperature=0)
        (original,) = _engine_requests(proxy)
        prompt = [int(t) for t in decode_inputs(original)["input_ids"].reshape(-1)]
        full = len(prompt) // TOKENS_PER_BLOCK
        assert full >= 4
        # The gateway cuts a demote to what its router's KV-event index says is cached: wait until the index
        # holds this prompt's own blocks (the engine is shared with the suite, so the index holds others' too).
        route = stack.gateway.app.state.gateway.routing.pools[f"demote-{x}"]
        with stack.session_factory() as session:
            row = tenant.get_tenant(session, ref=f"demote-{x}")
            salt = None if row.isolation == "shared" else row.cache_salt
        hashes = tuple(block_hashes(prompt, TOKENS_PER_BLOCK, salt=salt))

        def depth() -> int:
            return max(m.gpu_blocks + m.host_blocks
                       for m in (route.router.match(r, hashes, now=time.monotonic()) for r in route.replicas))
        for _ in range(WAIT_STEPS):
            if depth() >= full:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"the router's KV-event index never showed the prompt's {full} blocks")
        deleted = httpx.delete(f"{stack.gateway.base_url}/v1/responses/{reply.id}",
                               headers={"Authorization": f"Bearer {key}"})
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        for _ in range(WAIT_STEPS):
            if len(_engine_requests(proxy)) > 1:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("no demote request reached the engine")
        demotes = _engine_requests(proxy)[1:]
        assert len(demotes) == 1
        tensors = decode_inputs(demotes[0])
        sent = [int(t) for t in tensors["input_ids"].reshape(-1)]
        # cached blocks + 1 token; the prompt's own last token at most (x's tokens vary its length, and a prompt
        # that ends on a block boundary can be reused up to its length − 1 only, as TensorRT-LLM does)
        assert sent == prompt[:len(sent)] and len(sent) == min(full * TOKENS_PER_BLOCK, len(prompt) - 1) + 1
        assert int(tensors["request_output_len"].reshape(-1)[0]) == 1
        plan = parse_retention(tensors, len(sent))
        last = plan.ranges[-1]
        assert (last.priority, last.end, last.duration_ms) == (demoted_at, None, None)
        assert last.start < len(sent) - 1  # the conversation's own blocks are in the demoted range
        assert plan.decode_priority == demoted_at
        # Deleting it again: 404, and no second demote.
        again = httpx.delete(f"{stack.gateway.base_url}/v1/responses/{reply.id}",
                             headers={"Authorization": f"Bearer {key}"})
        assert again.status_code == 404
        assert len(_engine_requests(proxy)) == 2
    finally:
        await server.stop(0)


async def test_a_delete_on_another_gateway_demotes_what_the_store_says_no_live_response_holds(
        stack: Stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """a1 ─ a2, and a fork a1 ─ b2, stored through the suite's gateway; deleted through a second
    gateway on the same registry that never saw them: a2's demote starts past what a1 holds;
    deleting a1 orphans b2 (its chain is broken), whose prompt is demoted from the system segment on."""
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    second = None
    try:
        x, key = add_hinted_tenant(stack, "durable", port, secondary_blocks=0, max_ttl_ms=5_000, max_priority=55)
        name = f"durable-{x}"
        api = openai.AsyncOpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=120)
        text = " ".join(f"fact {i} about the glaciers of {x}." for i in range(12))
        a1 = await api.responses.create(model=MODEL, input=text, max_output_tokens=1, temperature=0)
        a2 = await api.responses.create(model=MODEL, input=f"And the fjords of {x}? " * 4, max_output_tokens=1,
                                        temperature=0, previous_response_id=a1.id)
        b2 = await api.responses.create(model=MODEL, input=f"And the lakes of {x}? " * 4, max_output_tokens=1,
                                        temperature=0, previous_response_id=a1.id)
        prompts = [[int(t) for t in decode_inputs(r)["input_ids"].reshape(-1)] for r in _engine_requests(proxy)]
        p1, p2, q2 = prompts
        h1, h2, k2 = (_salted(stack, name, p) for p in prompts)

        # Another gateway process on the same registry (as after a restart, or behind a load balancer):
        # nothing of the conversation in its memory.
        settings = stack.settings.model_copy(update={"trace_dir": tmp_path / "traces",
                                                     "usage_journal_dir": tmp_path / "usage-journal"})
        second = GatewayServer(build_serving_app(settings, session_factory=stack.session_factory, auth_ttl=0.5,
                                                 intervals=LoopIntervals(usage_flush=0.5, last_used_flush=1.0,
                                                                         pool_poll=0.3, capture_refresh=0.3)),
                               free_port())
        second.start()
        await _wait_until_indexed(second, name, h2)
        await _wait_until_indexed(second, name, k2)
        registry = second.app.state.gateway.registry

        async def demoted(count: int):  # type: ignore[no-untyped-def]
            """Wait for the count-th demote sent; its input_ids and retention."""
            for _ in range(WAIT_STEPS):
                labels = {"tenant": name, "pool": name, "trigger": "delete", "outcome": "sent"}
                if registry.get_sample_value("kvgate_conversation_demotes_total", labels) == count:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"demote {count} never sent")
            demotes = _engine_requests(proxy)[3:]
            assert len(demotes) == count
            tensors = decode_inputs(demotes[-1])
            sent = [int(t) for t in tensors["input_ids"].reshape(-1)]
            return sent, parse_retention(tensors, len(sent))

        async def delete(response_id: str) -> None:
            # Async: the recording proxy runs on this test's event loop (the second gateway polls it meanwhile).
            async with httpx.AsyncClient(timeout=60) as client:
                answer = await client.delete(f"{second.base_url}/v1/responses/{response_id}",
                                             headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200, answer.text

        # a2: its prompt past what a1 (live, continuable) shares with it.
        await delete(a2.id)
        sent, plan = await demoted(1)
        shared = max(shared_blocks(h2, h1), shared_blocks(h2, k2))  # what the live a1 and b2 hold of it
        assert shared >= 1 and sent == p2[:len(sent)] and len(sent) == min(len(h2) * TOKENS_PER_BLOCK, len(p2) - 1) + 1
        last = plan.ranges[-1]
        assert (last.start, last.end, last.priority, last.duration_ms) == (shared * TOKENS_PER_BLOCK, None, 0, None)
        assert plan.decode_priority == 0
        # a1: b2 can no longer be continued, so b2's prompt (a1's blocks included) goes, from the system segment on.
        await delete(a1.id)
        sent, plan = await demoted(2)
        assert sent == q2[:len(sent)] and len(sent) == min(len(k2) * TOKENS_PER_BLOCK, len(q2) - 1) + 1
        last = plan.ranges[-1]
        assert (last.end, last.priority) == (None, 0) and last.start % TOKENS_PER_BLOCK == 0
        assert last.start < shared_blocks(h2, h1) * TOKENS_PER_BLOCK  # a1's own blocks are in the range this time
    finally:
        if second is not None:
            second.stop()
        await server.stop(0)
