"""End to end on a deliberately small pool: salted isolation through the host tier,
per-tenant KV quota demotion (and its end), and quota state rebuilt after a gateway restart."""

from __future__ import annotations

import asyncio
import secrets
import time

import httpx
import pytest

from server.gateway.replicas.engine_client import EngineClient
from server.gateway.services import LoopIntervals
from server.serving import build_serving_app
from server.settings import Settings
from tenants import retention_classes
from tests.server.gateway.stack import ACTOR, PEPPER, GatewayServer, Stack, build_stack, free_port
from tests.server.gateway.test_openai_e2e import client, metric, system_prompt

pytestmark = pytest.mark.slow
TPB = 16
PRIMARY, SECONDARY = 48, 192
ENGINE_ARGS = ["--tokens-per-block", str(TPB), "--primary-blocks", str(PRIMARY), "--secondary-blocks", str(SECONDARY),
               "--max-input-len", "512", "--max-output-len", "64", "--max-batch-size", "4", "--offload-min-priority", "30"]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Stack:
    built = build_stack(tmp_path_factory.mktemp("small"), engine_args=ENGINE_ARGS, tokens_per_block=TPB,
                        primary=PRIMARY, secondary=SECONDARY, offload_min_priority=30)
    yield built
    built.gateway.stop()
    built.engine.kill()


def engine_tenants(stack: Stack) -> dict[str, list[int]]:
    async def read():
        engine = EngineClient(f"127.0.0.1:{stack.engine.port}", "kvgate_llm")
        try:
            return (await engine.stats()).tenants
        finally:
            await engine.close()

    return asyncio.run(read())


def tenant_id(stack: Stack, slug: str) -> str:
    admin = httpx.Client(base_url=stack.gateway.base_url + "/admin/v1", headers={"Authorization": f"Bearer {stack.admin_token}"})
    return str(admin.get(f"/tenants/{slug}").json()["id"])


def filler(stack: Stack, slug: str, rounds: int) -> None:
    """Unique ~370-token prompts (hex digits tokenize one by one): fill the 48-block primary tier and push older blocks out."""
    api = client(stack, stack.keys[slug])
    for _ in range(rounds):
        words = " ".join(secrets.token_hex(3) for _ in range(60))
        api.completions.create(model="smollm2-135m-instruct", prompt=words, max_tokens=1, temperature=0)


def test_salted_tenants_never_share_blocks_even_through_the_host_tier(small: Stack) -> None:
    a, b, c = ("iso-a-" + secrets.token_hex(2), "iso-b-" + secrets.token_hex(2), "iso-c-" + secrets.token_hex(2))
    pinned = "pinned-" + secrets.token_hex(2)
    with small.session_factory() as session:  # c's filler outranks a's system prompt (90), so a's blocks move
        retention_classes.create_class(session, actor=ACTOR, now=small.now(), name=pinned, system_priority=100,
                                       context_priority=100, turn_priority=100, decode_priority=100)
    for slug in (a, b):
        small.add_tenant(slug, isolation="salted")
    small.add_tenant(c, isolation="salted", retention_class=pinned)
    messages = [{"role": "system", "content": system_prompt(secrets.token_hex(4))}, {"role": "user", "content": "Capital of Japan?"}]
    model = "smollm2-135m-instruct"
    first = client(small, small.keys[a]).chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    filler(small, c, 3)  # evicts a's blocks from the primary tier; priority 90 >= 30, so they go to host
    held = engine_tenants(small)[tenant_id(small, a)]
    assert held[1] > 0, f"tenant a's blocks should sit in the host tier now, engine says {held}"
    for other in (b, c):
        reply = client(small, small.keys[other]).chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
    onboarded_before = metric(small, "kvgate_kv_blocks_onboarded_total", tenant=a)
    again = client(small, small.keys[a]).chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert metric(small, "kvgate_kv_blocks_onboarded_total", tenant=a) > onboarded_before


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_over_quota_tenant_is_demoted_until_back_under_and_state_survives_restart(small: Stack) -> None:
    slug = "quota-" + secrets.token_hex(2)
    small.add_tenant(slug, kv_quota_fraction=0.1)  # 4.8 of 48 primary blocks
    api = client(small, small.keys[slug])
    api.completions.create(model="smollm2-135m-instruct", prompt=" ".join(secrets.token_hex(3) for _ in range(60)),
                           max_tokens=1, temperature=0)  # ~180 tokens = 11 cached blocks > 4.8
    wait_for(lambda: metric(small, "kvgate_tenant_kv_demoted", tenant=slug) == 1)
    demotions = metric(small, "kvgate_quota_demotions_total", tenant=slug)
    api.completions.create(model="smollm2-135m-instruct", prompt="Hello there", max_tokens=1, temperature=0)
    assert metric(small, "kvgate_quota_demotions_total", tenant=slug) == demotions + 1

    # A second gateway process on the same registry and engine, with no memory: the first
    # poll rebuilds the state from the engine's per-tenant block counts.
    settings = Settings(database_url=str(small.session_factory.kw["bind"].url), admin_tokens=[f"ci:{small.admin_token}"],
                        key_pepper=PEPPER, dev=False)
    app = build_serving_app(settings, session_factory=small.session_factory, auth_ttl=0.5,
                            intervals=LoopIntervals(usage_flush=0.5, last_used_flush=1.0, pool_poll=0.3))
    restarted = GatewayServer(app, free_port())
    restarted.start()
    try:
        view = Stack(small.engine, restarted, small.session_factory, small.admin_token, TPB)
        wait_for(lambda: metric(view, "kvgate_tenant_kv_demoted", tenant=slug) == 1)
    finally:
        restarted.stop()

    # Back under quota (here: the operator raises it): demotion stops at the next poll.
    admin = httpx.Client(base_url=small.gateway.base_url + "/admin/v1", headers={"Authorization": f"Bearer {small.admin_token}"})
    version = admin.get(f"/tenants/{slug}").json()["version"]
    assert admin.patch(f"/tenants/{slug}", json={"version": version, "kv_quota_fraction": 0.9}).status_code == 200
    wait_for(lambda: metric(small, "kvgate_tenant_kv_demoted", tenant=slug) == 0)
    before = metric(small, "kvgate_quota_demotions_total", tenant=slug)
    api.completions.create(model="smollm2-135m-instruct", prompt="Hello again", max_tokens=1, temperature=0)
    assert metric(small, "kvgate_quota_demotions_total", tenant=slug) == before


def test_dedicated_tenant_is_served_only_by_its_own_pool(small: Stack) -> None:
    admin = httpx.Client(base_url=small.gateway.base_url + "/admin/v1", headers={"Authorization": f"Bearer {small.admin_token}"})
    pool = "ded-" + secrets.token_hex(2)
    created = admin.post("/pools", json={
        "name": pool, "model_name": "dedicated-model", "triton_url": f"127.0.0.1:{small.engine.port}",
        "engine_spec": "reference-smollm2", "tokens_per_block": TPB, "primary_blocks": PRIMARY,
        "secondary_blocks": SECONDARY, "secondary_offload_min_priority": 30})
    assert created.status_code == 201, created.text
    slug = "ded-" + secrets.token_hex(2)
    small.add_tenant(slug, pool=pool, isolation="dedicated")
    api = client(small, small.keys[slug])
    assert [m.id for m in api.models.list()] == ["dedicated-model"]
    assert api.completions.create(model="dedicated-model", prompt="Hi", max_tokens=1).choices
    shared = client(small, small.add_tenant("sh-" + secrets.token_hex(2)))
    with pytest.raises(Exception) as info:
        shared.completions.create(model="dedicated-model", prompt="Hi", max_tokens=1)
    assert getattr(info.value, "status_code", None) == 404
    # A second tenant cannot be placed on a dedicated pool.
    other = admin.post("/tenants", json={"slug": "intruder-" + secrets.token_hex(2), "display_name": "X",
                                         "pool": pool, "retention_class": "standard"})
    assert other.status_code == 409, other.text
