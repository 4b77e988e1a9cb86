"""Adaptive classes: the pool's selector plans from measured reuse, hashed as the engine hashes."""

from __future__ import annotations

import secrets

import pytest

from engines.contract import SamplingParams
from retention.policy.adaptive import AdaptiveConfig
from retention.policy.planner import QuotaState, RetentionClassSpec, SegmentRetention
from retention.policy.selection import AdaptiveSelector
from retention.shadow.duel import DuelConfig
from server.gateway.admission import Limits
from server.gateway.api.completions import CompletionJob, build_plan
from server.gateway.context import TenantContext
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot
from server.gateway.api.prompting import PreparedPrompt
from tenants import retention_classes
from tests.server.gateway.stack import ACTOR, MODEL, Stack
from tests.server.gateway.test_openai_e2e import client, system_prompt

TPB = 16
POOL = PoolSnapshot(1, "p", "m", "kvgate_llm", "reference-smollm2", TPB, 256, 512, 30, (ReplicaSnapshot(1, "r0", "127.0.0.1:1", "active", 1),))
CLASS = RetentionClassSpec(SegmentRetention(90), SegmentRetention(60), SegmentRetention(40), SegmentRetention(20))


def job(ids: tuple[int, ...], *, mode: str = "adaptive", over_quota: bool = False) -> CompletionJob:
    tenant = TenantContext(1, "t", "active", "salted", "salt", Limits(), 0.5, POOL, CLASS, 1, retention_mode=mode)
    return CompletionJob(tenant=tenant, kind="text", model="m", prompt=PreparedPrompt(ids, 0, len(ids)),
                         max_new_tokens=4, sampling=SamplingParams(), stop=(), stream=False, include_usage=False,
                         tokenizer=None, engine=None, quota=QuotaState(over_quota))  # type: ignore[arg-type]


def unique_prompt(blocks: int) -> tuple[int, ...]:
    return tuple(int.from_bytes(secrets.token_bytes(2), "little") for _ in range(blocks * TPB))


def bands_only() -> AdaptiveSelector:
    """A selector with adaptive's bands as its only candidate (GPU-only bands: no host tier)."""
    return AdaptiveSelector(POOL.primary_blocks, 0, POOL.secondary_offload_min_priority, names=("bands",))


def test_repeated_prefix_is_kept_above_the_threshold_and_one_shot_traffic_falls_below() -> None:
    reuse = bands_only()
    shared = unique_prompt(4)
    for step in range(60):  # enough one-shot prompts for their revisit probability to fall under 5 %
        build_plan(job(shared + unique_prompt(1)), reuse, now=float(step))  # a recurring 4-block prefix
        build_plan(job(unique_prompt(5)), reuse, now=float(step) + 0.5)  # one-shot prompts of the same shape
    kept = build_plan(job(shared + unique_prompt(1)), reuse, now=61.0)
    first_block_priority = kept.ranges[0].priority
    assert first_block_priority > POOL.secondary_offload_min_priority  # evicted to host, not dropped
    fresh = build_plan(job(unique_prompt(5)), reuse, now=61.5)
    assert max(r.priority for r in fresh.ranges) <= POOL.secondary_offload_min_priority  # first out
    assert kept.decode_priority == 20  # decode still from the class


def test_static_class_and_over_quota_ignore_the_statistics() -> None:
    reuse = AdaptiveSelector(POOL.primary_blocks, POOL.secondary_blocks, POOL.secondary_offload_min_priority)
    ids = unique_prompt(3)
    static = build_plan(job(ids, mode="static"), reuse, now=0.0)
    assert [r.priority for r in static.ranges] == [60]  # completions: the whole prompt is context
    demoted = build_plan(job(ids, over_quota=True), reuse, now=0.0)
    assert demoted.demoted and {r.priority for r in demoted.ranges} == {0}
    assert reuse.stats.num_entries() == 0 and reuse.duel.pool_scope.refs == 0  # neither path touched the selector


def test_the_class_plan_until_the_bands_win_on_the_shadows() -> None:
    """Selection in the gateway: the class's plan (the incumbent) until adaptive's bands win.

    A 4-block prefix shared by every request next to one-shot prompts that flood a pool of
    24 GPU blocks: the class keeps everything at 60, so the flood evicts the shared prefix;
    the bands sink the one-shot blocks, and the selector switches.
    """
    selector = AdaptiveSelector(24, 0, POOL.secondary_offload_min_priority, adaptive=AdaptiveConfig(),
                                duel_config=DuelConfig(rate=1.0, min_refs=50, patience=10, half_life_refs=500))
    shared = unique_prompt(4)
    plans = []
    for step in range(120):
        plans.append(build_plan(job(shared + unique_prompt(1)), selector, now=float(step)))
        for k in range(4):  # 24 one-shot blocks between two uses of the prefix: LRU loses it
            build_plan(job(unique_prompt(6)), selector, now=float(step) + 0.1 * (k + 1))
    assert [r.priority for r in plans[0].ranges] == [60]  # the class's plan first
    assert selector.duel.chosen() == "bands" and selector.duel.switches() == 1
    assert plans[-1].ranges[0].priority == 46 and plans[-1].ranges[0].duration_ms  # the prefix in the top kept band
    standings = selector.duel.standings()
    assert standings["bands"] > standings["static"]


@pytest.mark.slow
def test_adaptive_tenant_is_served_end_to_end(stack: Stack) -> None:
    name = "adaptive-" + secrets.token_hex(2)
    with stack.session_factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=stack.now(), name=name, mode="adaptive")
    api = client(stack, stack.add_tenant("ad-" + secrets.token_hex(3), retention_class=name))
    messages = [{"role": "system", "content": system_prompt(secrets.token_hex(4))}, {"role": "user", "content": "Capital of Egypt?"}]
    first = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
