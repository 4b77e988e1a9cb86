"""The admin API's live KV reads (``GET /admin/v1/tenants/{ref}/kv``, ``/pools/{ref}/kv``) on a live stack.

The figures are the engine's: a fresh salted tenant sends one prompt twice; the second
request reuses every full block of the first (the engine's per-request KV metrics), the
engine's stats report the tenant's blocks, and the curves (rate 1.0) estimate exactly
what ``test_miss_ratio.py`` checks on /metrics.
"""

from __future__ import annotations

import secrets
import time

import httpx

from tests.server.gateway.stack import Stack
from tests.server.gateway.test_openai_e2e import client, system_prompt


def admin(stack: Stack, path: str) -> httpx.Response:
    return httpx.get(stack.gateway.base_url + "/admin/v1" + path, timeout=30,
                     headers={"Authorization": f"Bearer {stack.admin_token}"})


def test_tenant_and_pool_kv_come_from_the_engine(stack: Stack) -> None:
    slug = "kvv-" + secrets.token_hex(3)
    key = stack.add_tenant(slug, kv_quota_fraction=0.5)
    before = admin(stack, f"/tenants/{slug}/kv")
    assert before.status_code == 200, before.text
    assert before.json()["requests"] == 0 and before.json()["primary_blocks"] == 0 and before.json()["hit_rate"] is None
    messages = [{"role": "system", "content": system_prompt(slug)}, {"role": "user", "content": "Capital of Chile?"}]
    for _ in range(2):
        done = client(stack, key).chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                                          max_tokens=2, temperature=0)
    prompt = done.usage.prompt_tokens
    full = prompt // stack.tokens_per_block

    deadline = time.monotonic() + 15  # the engine's per-tenant counts arrive with the next stats poll
    while (kv := admin(stack, f"/tenants/{slug}/kv").json())["primary_blocks"] == 0:
        assert time.monotonic() < deadline, kv
        time.sleep(0.3)
    assert kv["tenant"] == slug and kv["pool"] == "reference" and kv["polled"] and kv["engine_up"]
    assert kv["requests"] == 2 and kv["reused_blocks"] == full  # the second request reused every full block
    assert kv["hit_rate"] == full / (full + kv["new_blocks"])
    assert kv["primary_blocks"] >= full
    assert kv["quota_blocks"] == 0.5 * kv["pool_primary_blocks"]
    assert kv["quota_share"] == kv["primary_blocks"] / kv["quota_blocks"] and not kv["demoted"]
    expected = full * stack.tokens_per_block / (2 * prompt)
    points = {(p["gpu"], p["host"]): p for p in kv["mrc"]}
    assert set(points) == {("0.5x", "1x"), ("1x", "1x"), ("2x", "1x"), ("4x", "1x"), ("1x", "0x"), ("1x", "2x")}
    assert abs(points[("1x", "1x")]["hit_rate"] - expected) < 1e-9

    pool = admin(stack, "/pools/reference/kv").json()
    assert pool["polled"] and pool["tiers"]["primary"]["max_blocks"] == kv["pool_primary_blocks"]
    assert any(t["tenant"] == slug and t["primary_blocks"] >= full for t in pool["tenants"])
    assert [(r["name"], r["breaker"], r["healthy"]) for r in pool["replicas"]] == [("r0", "closed", True)]
    assert len(pool["mrc"]) == 6 and all(p["hit_rate"] is not None for p in pool["mrc"])


def test_kv_reads_need_an_admin_and_a_known_ref(stack: Stack) -> None:
    assert httpx.get(stack.gateway.base_url + "/admin/v1/pools/reference/kv").status_code == 401
    missing = admin(stack, "/tenants/no-such-tenant/kv")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "tenant_not_found"
    assert admin(stack, "/pools/no-such-pool/kv").status_code == 404
