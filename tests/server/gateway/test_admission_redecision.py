"""What :func:`fresh_admission.admit` settles when its first decision does not stand, and the
limits it decides under, in-process and on a real Redis (``make_admission``, from test_admission.py).

The tenant's context is a stub whose ``renew`` answers as authentication would: ``None`` while
fresh, the context under the registry's new limits, or a ``ServingError`` for a revoked key.
"""

from __future__ import annotations

import asyncio

import pytest

from engines.contract import SamplingParams
from server.gateway.admission import AdmissionError, Limits, LocalAdmission
from server.gateway.context import TenantContext
from server.gateway.errors import ServingError
from server.gateway.fresh_admission import admit
from tests.server.gateway.scripted import TextTokenizer
from tests.server.gateway.test_admission import make_admission  # noqa: F401


def context(limits: Limits, renew=None) -> TenantContext:
    return TenantContext(tenant_id=1, slug="acme", status="active", isolation="shared", cache_salt="s",
                         limits=limits, kv_quota_fraction=1.0, pool=None, retention=None, key_id=1, renew=renew)


def changed_after_the_decision(before: Limits, after: Limits | BaseException) -> TenantContext:
    """Fresh when admission starts; the check after the decision finds ``after`` (new limits, or
    the key's authentication failing)."""
    calls = {"n": 0}

    async def renew():
        calls["n"] += 1
        if calls["n"] == 1:
            return None
        if isinstance(after, BaseException):
            raise after
        return context(after)

    return context(before, renew)


async def test_a_redecision_charges_the_request_once(make_admission) -> None:
    """max_concurrent lowered while the first decision ran: decided again, and the first decision's
    request token, prompt and output reservation all go back (else a request that fits is refused,
    and a served one is counted twice)."""
    adm = make_admission()
    old = Limits(requests_per_minute=2, tokens_per_minute=100, max_concurrent=16)
    new = Limits(requests_per_minute=2, tokens_per_minute=100, max_concurrent=8)  # nothing in flight: fits
    lease = await admit(adm, changed_after_the_decision(old, new), prompt_tokens=60, max_output_tokens=10)  # 70 of 100
    await adm.release(lease, completion_tokens=10)
    second = await adm.acquire("acme", new, prompt_tokens=1, max_output_tokens=1)  # rpm 2: one request served so far
    await adm.release(second, completion_tokens=1)


async def test_a_key_revoked_during_the_decision_gives_back_what_it_took(make_admission) -> None:
    adm = make_admission()
    limits = Limits(requests_per_minute=1, tokens_per_minute=100, max_concurrent=1)
    revoked = ServingError(401, "invalid_api_key", "revoked")
    with pytest.raises(ServingError) as info:
        await admit(adm, changed_after_the_decision(limits, revoked), prompt_tokens=60, max_output_tokens=10)
    assert info.value.status == 401
    assert await adm.in_flight("acme") == 0
    # The same tenant under another key: its request token and its whole bucket are there.
    await adm.acquire("acme", limits, prompt_tokens=60, max_output_tokens=40)


@pytest.mark.parametrize(("after", "limit"), [(Limits(max_prompt_tokens=5), "max_prompt_tokens"),
                                              (Limits(tokens_per_minute=15), "tokens_per_minute")])
async def test_a_size_or_token_limit_lowered_during_the_decision_is_decided_again(make_admission, after,
                                                                                  limit) -> None:
    adm = make_admission()
    before = Limits(max_prompt_tokens=100, tokens_per_minute=1000)
    with pytest.raises(AdmissionError) as info:  # 10 prompt + 10 output can never pass the new limit
        await admit(adm, changed_after_the_decision(before, after), prompt_tokens=10, max_output_tokens=10)
    assert info.value.limit == limit
    assert await adm.in_flight("acme") == 0


async def test_a_rate_lowered_during_the_decision_binds_the_request(make_admission) -> None:
    adm = make_admission()
    before, after = Limits(requests_per_minute=100), Limits(requests_per_minute=1)
    await admit(adm, changed_after_the_decision(before, after), prompt_tokens=1, max_output_tokens=1)
    with pytest.raises(AdmissionError) as info:  # decided under rpm 1, it took this minute's one request
        await adm.acquire("acme", after, prompt_tokens=1, max_output_tokens=1)
    assert info.value.limit == "requests_per_minute"


class Counting:
    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.decisions = inner, 0

    async def acquire(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.decisions += 1
        return await self.inner.acquire(*args, **kwargs)

    async def release_unserved(self, lease) -> None:  # type: ignore[no-untyped-def]
        await self.inner.release_unserved(lease)


async def test_raised_limits_are_not_decided_again(make_admission) -> None:
    adm = Counting(make_admission())
    old = Limits(requests_per_minute=1, tokens_per_minute=100, max_concurrent=1, max_prompt_tokens=10)
    raised = Limits(requests_per_minute=5, tokens_per_minute=None, max_concurrent=2, max_prompt_tokens=20)
    await admit(adm, changed_after_the_decision(old, raised), prompt_tokens=1, max_output_tokens=1)
    assert adm.decisions == 1


async def test_the_default_output_limit_is_the_renewed_tenants() -> None:
    """A request naming no output limit runs with the tenant's max_output_tokens as admission
    reads it (renewed), not as the auth-time snapshot had it: an admin lowering it does not turn
    such requests into 400s."""
    async def renew():
        return context(Limits(max_output_tokens=1000))

    lease = await admit(LocalAdmission(), context(Limits(max_output_tokens=2000), renew), prompt_tokens=10,
                        max_output_tokens=None)
    assert lease.max_output_tokens == 1000
    lease = await admit(LocalAdmission(), context(Limits()), prompt_tokens=10, max_output_tokens=None)
    assert lease.max_output_tokens == Limits().default_output_tokens == 256  # a tenant without a cap
    lease = await admit(LocalAdmission(), context(Limits(max_output_tokens=2000)), prompt_tokens=10,
                        max_output_tokens=7)
    assert lease.max_output_tokens == 7


def test_the_engine_runs_a_request_without_max_tokens_with_the_default_admission_used() -> None:
    """The hot path: the job's output limit is what admission reserved."""
    from server.gateway.api.completions import CompletionJob, CompletionRunner
    from server.gateway.api.prompting import PreparedPrompt
    from server.gateway.observe.metrics import GatewayMetrics
    from server.gateway.replicas.engine_client import EngineUnavailable
    from prometheus_client import CollectorRegistry
    from retention.policy.planner import RetentionClassSpec, SegmentRetention
    from tenants.snapshots import PoolSnapshot

    pool = PoolSnapshot(id=1, name="p", model_name="m", triton_model="kvgate_llm", engine_spec="", tokens_per_block=16,
                        primary_blocks=64, secondary_blocks=0, secondary_offload_min_priority=35, replicas=())
    spec = RetentionClassSpec(SegmentRetention(90), SegmentRetention(60), SegmentRetention(40), SegmentRetention(20))
    asked: list[int] = []

    class Engine:
        async def generate(self, request, *, request_id):  # type: ignore[no-untyped-def]
            asked.append(request.max_new_tokens)
            raise EngineUnavailable("down")
            yield

    async def renew():
        return TenantContext(1, "acme", "active", "salted", "s", Limits(max_output_tokens=1000), 1.0, pool, spec, 1)

    stale = TenantContext(1, "acme", "active", "salted", "s", Limits(max_output_tokens=2000), 1.0, pool, spec, 1,
                          renew=renew)
    runner = CompletionRunner(admission=LocalAdmission(), metrics=GatewayMetrics(CollectorRegistry()),
                              usage=lambda *args: None)

    job = CompletionJob(tenant=stale, kind="chat", model="m", prompt=PreparedPrompt(tuple(range(3, 40)), 10, 20),
                        max_new_tokens=None, sampling=SamplingParams(), stop=(), stream=False, include_usage=False,
                        tokenizer=TextTokenizer(), engine=Engine())  # type: ignore[arg-type]

    async def run() -> None:
        with pytest.raises(ServingError) as info:
            await runner.run(job, None)  # type: ignore[arg-type]
        assert info.value.status == 503  # the engine double's answer, not a 400 on max_output_tokens

    asyncio.run(run())
    assert asked == [1000] and job.max_new_tokens == 1000
