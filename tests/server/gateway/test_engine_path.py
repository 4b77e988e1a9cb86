"""What crosses the wire to the engine, and how the gateway lives through an engine restart."""

from __future__ import annotations

import secrets
import time

import httpx
import openai
import pytest
from sqlalchemy import select

from engines.contract import parse_retention
from engines.reference.kserve import decode_inputs
from engines.tokenizer import load_gguf_tokenizer
from retention.policy.planner import RetentionClassSpec, SegmentRetention, Segments, plan_retention
from server.gateway.api.prompting import prepare_chat
from tenants import pools
from tenants.models import Tenant
from tests.server.gateway.recording_proxy import start_proxy
from tests.server.gateway.stack import ACTOR, MODEL, Stack, free_port
from tests.server.gateway.test_openai_e2e import client, metric, system_prompt

pytestmark = pytest.mark.slow


async def test_engine_receives_exactly_the_planners_plan(stack: Stack) -> None:
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    try:
        pool_name = "proxied-" + secrets.token_hex(3)
        with stack.session_factory() as session:
            pools.create_pool(session, actor=ACTOR, now=stack.now(), name=pool_name, model_name=MODEL,
                              triton_url=f"127.0.0.1:{port}", engine_spec="reference-smollm2",
                              tokens_per_block=stack.tokens_per_block, primary_blocks=256, secondary_blocks=512,
                              secondary_offload_min_priority=50)
        slug = "plan-" + secrets.token_hex(3)
        key = stack.add_tenant(slug, pool=pool_name, isolation="salted")
        messages = [
            {"role": "system", "content": system_prompt(secrets.token_hex(4))},
            {"role": "user", "content": "Capital of Kenya?"},
            {"role": "assistant", "content": "Nairobi."},
            {"role": "user", "content": "And of Ghana?"},
        ]
        api = openai.AsyncOpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0)
        await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
        streamed = [r for r in proxy.requests if any(i.name == "input_ids" for i in r.inputs)]
        assert len(streamed) == 1
        tensors = decode_inputs(streamed[0])

        # Independently: the same template/tokenizer, the class from the stack (90/60/40, decode 20),
        # and this pool's threshold.
        prompt = prepare_chat(load_gguf_tokenizer(), messages)
        assert prompt.system_end > 0 and prompt.context_end > prompt.system_end
        expected = plan_retention(
            RetentionClassSpec(SegmentRetention(90, None), SegmentRetention(60, 600_000),
                               SegmentRetention(40, 30_000), SegmentRetention(20, 30_000)),
            Segments(prompt.system_end, prompt.context_end, prompt.total), offload_min_priority=50,
        )
        assert tuple(tensors["input_ids"].tolist()) == prompt.input_ids
        assert parse_retention(tensors, prompt.total) == expected
        assert [r.priority for r in expected.ranges] == [90, 60, 40]
        assert expected.ranges[-1].end is None
        with stack.session_factory() as session:
            tenant = session.scalars(select(Tenant).where(Tenant.slug == slug)).one()
            assert tensors["cache_salt"][0].decode() == tenant.cache_salt
            assert tensors["tenant_id"][0].decode() == str(tenant.id)
    finally:
        await server.stop(0)


def test_usage_is_written_to_the_registry(stack: Stack) -> None:
    slug = "use-" + secrets.token_hex(3)
    api = client(stack, stack.add_tenant(slug))
    replies = [api.completions.create(model=MODEL, prompt="Say hi", max_tokens=3, temperature=0) for _ in range(2)]
    admin = httpx.Client(base_url=stack.gateway.base_url + "/admin/v1",
                         headers={"Authorization": f"Bearer {stack.admin_token}"})
    deadline = time.monotonic() + 10
    while True:
        body = admin.get(f"/tenants/{slug}/usage").json()
        totals = body.get("totals") or body.get("total") or {}
        if totals.get("requests") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert totals["requests"] == 2
    assert totals["prompt_tokens"] == sum(r.usage.prompt_tokens for r in replies)
    assert totals["completion_tokens"] == sum(r.usage.completion_tokens for r in replies)


def test_pool_metrics_come_from_the_engine(stack: Stack) -> None:
    slug = "pm-" + secrets.token_hex(3)
    api = client(stack, stack.add_tenant(slug))
    api.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system_prompt(slug)},
                                                       {"role": "user", "content": "Hi"}], max_tokens=2)
    deadline = time.monotonic() + 10
    while metric(stack, "kvgate_tenant_kv_blocks", tenant=slug, pool="reference", tier="primary") == 0:
        assert time.monotonic() < deadline, "per-tenant block counts never appeared in /metrics"
        time.sleep(0.2)
    assert metric(stack, "kvgate_pool_blocks", pool="reference", tier="primary", state="max") == 256
    assert metric(stack, "kvgate_tenant_kv_quota_ratio", tenant=slug, pool="reference") > 0


def test_a_pool_whose_engine_does_not_answer_is_reported_but_keeps_the_gateway_ready(stack: Stack) -> None:
    """Every gateway pod sees the same pools: a pool still loading its engine (or gone) must not take
    every pod out of its Service while another pool serves."""
    dead = f"127.0.0.1:{free_port()}"
    name = "dead-" + secrets.token_hex(3)
    with stack.session_factory() as session:
        pools.create_pool(session, actor=ACTOR, now=stack.now(), name=name, model_name=MODEL, triton_url=dead,
                          engine_spec="reference-smollm2", tokens_per_block=stack.tokens_per_block,
                          primary_blocks=256, secondary_blocks=0, secondary_offload_min_priority=50)
    try:
        ready = httpx.get(stack.gateway.base_url + "/readyz", timeout=30)
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"][f"pool:{name}"] == "unavailable"
        assert ready.json()["checks"]["pool:reference"] == "ok"
    finally:
        with stack.session_factory() as session:
            pools.delete_pool(session, actor=ACTOR, now=stack.now(), ref=name)


def test_engine_down_is_503_and_the_next_request_after_restart_succeeds(stack: Stack) -> None:
    api = client(stack, stack.add_tenant("rs-" + secrets.token_hex(3)))
    assert api.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices
    stack.engine.kill()
    try:
        with pytest.raises(openai.APIStatusError) as info:
            api.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.body["code"] == "engine_unavailable"
        ready = httpx.get(stack.gateway.base_url + "/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["pool:reference"] == "unavailable"
    finally:
        stack.engine.start()
    reply = api.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert reply.choices[0].text is not None and reply.usage.completion_tokens >= 1
