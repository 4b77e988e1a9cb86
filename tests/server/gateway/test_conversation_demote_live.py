"""Demote on delete end to end: a stored response over HTTP, then its DELETE leads to one engine request
(seen through the recording proxy) that re-claims the conversation's own cached blocks at priority 0."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from engines.contract import parse_retention
from retention.hashing import block_hashes
from engines.reference.kserve import decode_inputs
from tenants import tenant
from tests.server.gateway.conftest import TOKENS_PER_BLOCK
from tests.server.gateway.hinted_tenant import add_hinted_tenant
from tests.server.gateway.recording_proxy import start_proxy
from tests.server.gateway.stack import MODEL, Stack

pytestmark = pytest.mark.slow
WAIT_STEPS = 600  # × 0.1 s: bounded waits for the gateway's background work (KV-event poll, the demote task)


def _engine_requests(proxy) -> list:  # type: ignore[no-untyped-def]
    return [r for r in proxy.requests if any(i.name == "input_ids" for i in r.inputs)]


async def test_a_delete_sends_one_demote_request_at_priority_zero_for_the_conversations_range(stack: Stack) -> None:
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    try:
        x, key = add_hinted_tenant(stack, "demote", port, secondary_blocks=0, max_ttl_ms=5_000, max_priority=55)
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
        assert (last.priority, last.end, last.duration_ms) == (0, None, None)
        assert last.start < len(sent) - 1  # the conversation's own blocks are in the demoted range
        assert plan.decode_priority == 0
        # Deleting it again: 404, and no second demote.
        again = httpx.delete(f"{stack.gateway.base_url}/v1/responses/{reply.id}",
                             headers={"Authorization": f"Bearer {key}"})
        assert again.status_code == 404
        assert len(_engine_requests(proxy)) == 2
    finally:
        await server.stop(0)
