"""Registry vs engine, end to end: a pool registered with 2,048 primary blocks in front of a
real reference engine that allocated 64. The admin API, /metrics and the log say so, and the
KV quota is computed on the engine's 64 blocks."""

from __future__ import annotations

import logging
import secrets

import httpx
import pytest

from tests.server.gateway.stack import Stack, build_stack
from tests.server.gateway.test_openai_e2e import client, metric
from tests.server.gateway.test_quota_isolation import wait_for

pytestmark = pytest.mark.slow
TPB, ENGINE_PRIMARY, ENGINE_SECONDARY = 16, 64, 128
REGISTERED_PRIMARY, REGISTERED_SECONDARY = 2048, 4096
ENGINE_ARGS = ["--tokens-per-block", str(TPB), "--primary-blocks", str(ENGINE_PRIMARY), "--secondary-blocks",
               str(ENGINE_SECONDARY), "--max-input-len", "768", "--max-output-len", "16", "--max-batch-size", "2"]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def oversized(tmp_path_factory):
    records = Records()
    logger = logging.getLogger("kvgate.gateway")
    logger.addHandler(records)
    built = build_stack(tmp_path_factory.mktemp("oversized"), engine_args=ENGINE_ARGS, tokens_per_block=TPB,
                        primary=REGISTERED_PRIMARY, secondary=REGISTERED_SECONDARY)
    try:
        yield built, records
    finally:
        built.gateway.stop()
        built.engine.kill()
        logger.removeHandler(records)


def admin(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway.base_url + "/admin/v1", headers={"Authorization": f"Bearer {stack.admin_token}"})


def test_mismatch_is_visible_and_quota_uses_the_engines_blocks(oversized) -> None:
    stack, records = oversized
    api = admin(stack)
    wait_for(lambda: api.get("/pools/reference").json()["engine_reported"] is not None)
    pool = api.get("/pools/reference").json()
    assert pool["primary_blocks"] == REGISTERED_PRIMARY
    assert pool["engine_reported"] == {"primary_blocks": ENGINE_PRIMARY, "secondary_blocks": ENGINE_SECONDARY,
                                       "tokens_per_block": TPB, "mismatch": True}
    assert api.get("/pools").json()["items"][0]["engine_reported"]["mismatch"] is True

    assert metric(stack, "kvgate_pool_capacity_mismatch", pool="reference") == 1
    assert metric(stack, "kvgate_pool_registered_blocks", pool="reference", tier="primary") == REGISTERED_PRIMARY
    assert metric(stack, "kvgate_pool_blocks", pool="reference", tier="primary", state="max") == ENGINE_PRIMARY
    warnings = [m for m in records.messages if "registry and engine disagree" in m]
    assert len(warnings) == 1, records.messages  # once, not once per poll
    assert "primary_blocks registered 2048, engine reports 64" in warnings[0]

    # Quota 0.25: 16 of the engine's 64 blocks (the registry's figure would allow 512).
    slug = "cap-" + secrets.token_hex(2)
    key = stack.add_tenant(slug, kv_quota_fraction=0.25)
    prompt = " ".join(secrets.token_hex(3) for _ in range(110))  # ~330 tokens ≈ 20 blocks of 16
    client(stack, key).completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=1, temperature=0)
    wait_for(lambda: metric(stack, "kvgate_tenant_kv_demoted", tenant=slug) == 1)
    # One scrape for both figures: the engine's stats move between two scrapes.
    scrape = httpx.get(stack.gateway.base_url + "/metrics").text
    held = metric(stack, "kvgate_tenant_kv_blocks", scrape=scrape, tenant=slug, tier="primary")
    assert 16 < held < 512
    assert metric(stack, "kvgate_tenant_kv_quota_ratio", scrape=scrape, tenant=slug) == pytest.approx(held / 16)

    # The operator registers what the engine has: the mismatch clears at the next poll.
    version = pool["version"]
    fixed = api.patch("/pools/reference", json={"version": version, "primary_blocks": ENGINE_PRIMARY,
                                                "secondary_blocks": ENGINE_SECONDARY})
    assert fixed.status_code == 200, fixed.text
    wait_for(lambda: api.get("/pools/reference").json()["engine_reported"]["mismatch"] is False)
    wait_for(lambda: metric(stack, "kvgate_pool_capacity_mismatch", pool="reference") == 0)


def test_a_replica_reporting_no_blocks_yet_is_not_a_mismatch() -> None:
    """0 primary blocks means the engine has not sized its pool yet: it counts as registered for
    the quota and is no disagreement either; a started replica's real difference still is."""
    from server.gateway.observe.capacity_check import CapacityCheck, ReplicaCapacity

    started = ReplicaCapacity("a", 1000, 0, 16)
    check = CapacityCheck("p", 1000, 0, 16, (started, ReplicaCapacity("b", 0, 0, 16)))
    assert check.effective_primary == 2000 and not check.mismatch
    assert CapacityCheck("p", 1000, 0, 16, (ReplicaCapacity("b", 0, 0, 0),)).mismatch is False
    real = CapacityCheck("p", 1000, 0, 16, (ReplicaCapacity("b", 0, 0, 16), ReplicaCapacity("c", 900, 0, 16)))
    assert real.mismatch and real.reported_primary == 900
    assert "'c' primary_blocks registered 1000, engine reports 900" in real.message()
    assert "'b'" not in real.message()
