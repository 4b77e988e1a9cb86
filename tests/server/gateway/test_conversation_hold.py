"""The request core's conversation hold: tools offered in any dialect, stored Responses chains,
one budget with the client's hints, a DELETE stops measuring and renewing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from engines.contract import KvMetrics, SamplingParams
from retention.policy.conversation import ConversationRequest
from retention.policy.hint_plan import HintPolicy
from retention.policy.hint_quota import MIN_GAP_SAMPLES, HintLedger
from retention.policy.planner import RetentionClassSpec, SegmentRetention
from retention.types import DEFAULT_PLAN
from server.gateway.admission import Limits, LocalAdmission
from server.gateway.api.completions import CompletionJob, CompletionRunner
from server.gateway.api.conversation_hold import ConversationHolds, conversation_of
from server.gateway.api.prompting import PreparedPrompt
from server.gateway.api.tools import ToolPlan
from server.gateway.context import TenantContext
from server.gateway.observe.metrics import GatewayMetrics
from server.gateway.replicas.engine_client import EngineChunk
from tenants.snapshots import PoolSnapshot
from tests.server.gateway.scripted import TextTokenizer

TPB = 16
CAPS = HintPolicy(enabled=True, max_ttl_ms=600_000, max_priority=60, quota_fraction=0.5)


def job(*, tools: bool = False, conversation: ConversationRequest | None = None, hints: HintPolicy = CAPS,  # noqa: ANN201
        hold: bool = True):
    pool = SimpleNamespace(name="p", primary_blocks=400, secondary_blocks=0, secondary_offload_min_priority=35,
                           tokens_per_block=TPB)
    tenant = SimpleNamespace(hints=hints, conversation_hold=hold, kv_quota_fraction=1.0, pool=pool,
                             engine_tenant_id="7")
    return SimpleNamespace(tenant=tenant, tools=object() if tools else None, conversation=conversation,
                           prompt=SimpleNamespace(total=5 * TPB + 2), max_new_tokens=32)


def test_tools_in_any_dialect_and_stored_responses_are_conversations() -> None:
    assert conversation_of(job(tools=True)) == ConversationRequest(offers_tools=True)
    assert conversation_of(job()).kind is None
    stored = ConversationRequest("resp_1", None, True, False)
    assert conversation_of(job(conversation=stored, tools=True)).offers_tools
    holds = ConversationHolds()
    assert holds.applies(job(tools=True)) and holds.applies(job(conversation=stored))
    assert not holds.applies(job()) and not holds.applies(job(tools=True, hold=False))


def test_a_measured_tool_loop_is_held_in_the_shared_budget_and_a_delete_stops_measuring() -> None:
    holds, hints = ConversationHolds(duel=None), HintLedger()
    now = 0.0
    for i in range(MIN_GAP_SAMPLES + 1):  # Responses runs: a tool step and its continuation 2 s later
        first = ConversationRequest(f"resp_{i}a", None, True, True)
        holds.plan(job(conversation=first), DEFAULT_PLAN, [100 * i + b for b in range(5)], hints, now)
        then = ConversationRequest(f"resp_{i}b", f"resp_{i}a", True, True)
        holds.plan(job(conversation=then), DEFAULT_PLAN, [100 * i + b for b in range(5)], hints, now + 2.0)
        now += 100.0
    out = holds.plan(job(tools=True), DEFAULT_PLAN, [9000 + b for b in range(5)], hints, now)  # chat completions + tools
    assert out.hold_ms == 2_000 and out.plan.retention_at(0) == (60, 2_000)
    assert (out.plan.decode_priority, out.plan.decode_duration_ms) == (60, 2_000)
    assert hints.live_blocks("7", now) == 5 + 2  # the hint ledger counts the held prompt and generated blocks
    holds.released(job(tools=True), out, now + 10.0)  # the engine starts the duration at release
    assert hints.live_blocks("7", now + 11.0) == 7 and hints.live_blocks("7", now + 12.001) == 0
    ledger = holds.ledger("p", hints)
    gaps = ledger.gap_count("7", "tool")
    assert holds.deleted("p", "7", f"resp_{MIN_GAP_SAMPLES}b") and not holds.deleted("q", "7", "resp_0b")
    assert ledger.continued("7", f"resp_{MIN_GAP_SAMPLES}b", now + 1.0) is None and ledger.gap_count("7", "tool") == gaps


def test_the_class_switch_decides_not_the_hint_switch_and_the_hint_caps_still_bound_the_hold() -> None:
    """Hints on without the switch: never held; the switch on with hints off: held within the hint caps."""
    caps_off = HintPolicy(enabled=False, max_ttl_ms=1_500, max_priority=45, quota_fraction=0.5)
    for hints, hold, held in ((CAPS, False, False), (caps_off, True, True)):
        holds, ledger = ConversationHolds(duel=None), HintLedger()  # the switch alone (the duel: below)
        assert holds.applies(job(tools=True, hints=hints, hold=hold)) is held
        now = 0.0
        for i in range(MIN_GAP_SAMPLES + 1):
            first = ConversationRequest(f"r{i}a", None, True, True)
            holds.plan(job(conversation=first, hints=hints, hold=hold), DEFAULT_PLAN, [100 * i], ledger, now)
            then = ConversationRequest(f"r{i}b", f"r{i}a", True, True)
            holds.plan(job(conversation=then, hints=hints, hold=hold), DEFAULT_PLAN, [100 * i], ledger, now + 2.0)
            now += 100.0
        if held:
            out = holds.plan(job(tools=True, hints=hints, hold=hold), DEFAULT_PLAN, list(range(5)), ledger, now)
            assert out.hold_ms == 1_500 and out.plan.retention_at(0) == (45, 1_500)  # the class's hint caps


def test_once_a_pool_holds_its_duel_sees_every_request_of_it_held_or_not() -> None:
    holds, hints = ConversationHolds(), HintLedger()
    assert not holds.watches("p")  # no conversation yet: plain requests cost nothing
    first = job(conversation=ConversationRequest("resp_1", None, True, True))
    assert holds.plan(first, DEFAULT_PLAN, list(range(5)), hints, 0.0).hold_ms == 0  # no evidence: not held
    assert holds.watches("p")
    holds.shadow(job(), DEFAULT_PLAN, list(range(100, 105)), hints, 1.0)
    duel = holds.ledger("p", hints).duel
    assert duel.arm == "never"
    for shadow in duel.duel.shadows:
        assert shadow.counts.requests == 2 and shadow.counts.kept_blocks == 10  # small hashes: all in the slice


async def test_a_failure_after_the_hold_is_planned_releases_it_as_an_answered_request_does() -> None:
    """A request offering tools, held, that fails between the hold's plan and the engine call (the SLO
    guard's plan step here): its hold is counted in the pool's budget from the failure on, as the same
    request answered by the engine has its hold counted from its end."""
    pool = PoolSnapshot(id=1, name="p", model_name="m", triton_model="kvgate_llm", engine_spec="", tokens_per_block=TPB,
                        primary_blocks=400, secondary_blocks=0, secondary_offload_min_priority=35, replicas=())
    spec = RetentionClassSpec(SegmentRetention(90), SegmentRetention(60, 600_000), SegmentRetention(40, 30_000),
                              SegmentRetention(20, 30_000))
    tenant = TenantContext(7, "t7", "active", "salted", "salt", Limits(), 1.0, pool, spec, 1, hints=CAPS,
                           conversation_hold=True)
    clock = SimpleNamespace(t=0.0)

    class Guard:  # the SLO guard's plan step: fails (after some time) when told to
        fails = False

        def apply(self, tenant, plan):  # type: ignore[no-untyped-def]
            if self.fails:
                clock.t += 10.0
                raise RuntimeError("injected fault after the hold was planned")
            return plan, "host"

        def observe(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            pass

    class Engine:  # answers after 10 s
        async def generate(self, request, *, request_id):  # type: ignore[no-untyped-def]
            clock.t += 10.0
            yield EngineChunk((1,), 1, KvMetrics(), True)

    weather = {"name": "get_weather", "description": "w", "parameters": {"type": "object", "properties": {}}}
    live = {}
    for fails in (False, True):
        guard = Guard()
        runner = CompletionRunner(admission=LocalAdmission(), metrics=GatewayMetrics(CollectorRegistry()),
                                  usage=lambda *args: None, clock=lambda: clock.t, guard=guard,
                                  holds=ConversationHolds(duel=None))
        hints = runner._ledger("p")  # the pool's one budget: hints and holds
        now = 0.0
        for i in range(MIN_GAP_SAMPLES + 1):  # measured tool gaps of 2 s (Responses runs), as above
            first = ConversationRequest(f"resp_{i}a", None, True, True)
            runner.holds.plan(job(conversation=first), DEFAULT_PLAN, [100 * i + b for b in range(5)], hints, now)
            then = ConversationRequest(f"resp_{i}b", f"resp_{i}a", True, True)
            runner.holds.plan(job(conversation=then), DEFAULT_PLAN, [100 * i + b for b in range(5)], hints, now + 2.0)
            now += 100.0
        clock.t = now
        held = CompletionJob(tenant=tenant, kind="chat", model="m", prompt=PreparedPrompt(tuple(range(3, 5 * TPB + 5)),
                             TPB, 2 * TPB), max_new_tokens=32, sampling=SamplingParams(), stop=(), stream=False,
                             include_usage=False, tokenizer=TextTokenizer(), engine=Engine(),  # type: ignore[arg-type]
                             tools=ToolPlan({"get_weather": weather}, "auto"))
        assert runner.holds.applies(held)
        guard.fails = fails
        if fails:
            with pytest.raises(RuntimeError, match="injected fault"):
                await runner.run(held, None)  # type: ignore[arg-type]
        else:
            await runner.run(held, SimpleNamespace(body=lambda job, outcome: {}))  # type: ignore[arg-type]
        ended = now + 10.0
        assert clock.t == ended
        budget = runner.holds.ledger("p", hints).holds
        # 5 prompt blocks and 2 generated: held 2 s from the request's end (planned 10 s before it)
        live[fails] = (budget.live_blocks("7", ended + 1.0), budget.live_blocks("7", ended + 2.001))
    assert live[True] == live[False] == (7, 0), live
