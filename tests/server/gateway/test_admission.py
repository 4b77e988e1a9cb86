"""Admission limits, in-process and on a real Redis (skipped only when Redis is down)."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from server.gateway.admission import AdmissionError, Limits, LocalAdmission, RedisAdmission

REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_up() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping())
    except Exception:
        return False


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["local", "redis"])
async def make_admission(request):
    created = []
    namespace = f"kvgate-test-{secrets.token_hex(4)}"

    def factory():
        if request.param == "local":
            adm = LocalAdmission()
        else:
            if not _redis_up():
                pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
            adm = RedisAdmission(REDIS_URL, namespace=namespace)
        created.append(adm)
        return adm

    factory.kind = request.param
    yield factory
    if request.param == "redis" and created:
        keys = [k async for k in created[0]._redis.scan_iter(f"{namespace}:*")]
        if keys:
            await created[0]._redis.delete(*keys)
    for adm in created:
        await adm.close()


async def test_requests_per_minute_refuses_with_retry_after(make_admission) -> None:
    adm = make_admission()
    limits = Limits(requests_per_minute=3)
    for _ in range(3):
        await adm.release(await adm.acquire("t1", limits, prompt_tokens=5, max_output_tokens=5), completion_tokens=5)
    with pytest.raises(AdmissionError) as info:
        await adm.acquire("t1", limits, prompt_tokens=5, max_output_tokens=5)
    assert info.value.status == 429 and info.value.limit == "requests_per_minute"
    # One request token refills every 20 s at 3/min.
    assert 15.0 < info.value.retry_after <= 20.0
    # Another tenant is unaffected.
    await adm.acquire("t2", limits, prompt_tokens=5, max_output_tokens=5)


async def test_concurrency_is_exact_and_released(make_admission) -> None:
    adm = make_admission()
    limits = Limits(max_concurrent=2)
    a = await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    with pytest.raises(AdmissionError) as info:
        await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    assert info.value.limit == "max_concurrent"
    await adm.release(a, completion_tokens=0)
    await adm.release(a, completion_tokens=0)  # idempotent: does not free a second slot
    await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    with pytest.raises(AdmissionError):
        await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    assert await adm.in_flight("t") == 2


async def test_tokens_per_minute_reserves_prompt_and_output_then_settles_the_completion(make_admission) -> None:
    adm = make_admission()
    limits = Limits(tokens_per_minute=600)
    lease = await adm.acquire("t", limits, prompt_tokens=100, max_output_tokens=10)
    await adm.release(lease, completion_tokens=450)
    # 600 - 100 - 450 = ~50 left (plus a little refill): a 90-token prompt reserving 10 more must wait ~5 s.
    with pytest.raises(AdmissionError) as info:
        await adm.acquire("t", limits, prompt_tokens=90, max_output_tokens=10)
    assert info.value.limit == "tokens_per_minute"
    assert 3.0 < info.value.retry_after <= 5.0


async def test_refused_request_changes_nothing(make_admission) -> None:
    adm = make_admission()
    limits = Limits(requests_per_minute=1, max_concurrent=5)
    with pytest.raises(AdmissionError):
        await adm.acquire("t", Limits(max_prompt_tokens=10), prompt_tokens=11, max_output_tokens=1)
    await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    assert await adm.in_flight("t") == 1


@pytest.mark.parametrize(
    ("limits", "prompt", "output", "limit"),
    [
        (Limits(max_prompt_tokens=10), 11, 1, "max_prompt_tokens"),
        (Limits(max_output_tokens=10), 1, 11, "max_output_tokens"),
    ],
)
async def test_never_admissible_requests_are_400(make_admission, limits, prompt, output, limit) -> None:
    adm = make_admission()
    with pytest.raises(AdmissionError) as info:
        await adm.acquire("t", limits, prompt_tokens=prompt, max_output_tokens=output)
    assert info.value.status == 400 and info.value.limit == limit
    assert str(getattr(limits, limit)) in str(info.value)


async def test_local_bucket_refills_with_time() -> None:
    clock = FakeClock()
    adm = LocalAdmission(clock=clock)
    limits = Limits(requests_per_minute=60)
    for _ in range(60):
        await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    with pytest.raises(AdmissionError):
        await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    clock.now += 1.0
    await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)


async def test_redis_replicas_share_limits() -> None:
    if not _redis_up():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    namespace = f"kvgate-test-{secrets.token_hex(4)}"
    first, second = RedisAdmission(REDIS_URL, namespace=namespace), RedisAdmission(REDIS_URL, namespace=namespace)
    limits = Limits(requests_per_minute=4, max_concurrent=3)
    leases = [await first.acquire("t", limits, prompt_tokens=1, max_output_tokens=1) for _ in range(2)]
    leases.append(await second.acquire("t", limits, prompt_tokens=1, max_output_tokens=1))
    with pytest.raises(AdmissionError) as info:
        await second.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    assert info.value.limit == "max_concurrent"
    await first.release(leases[0], completion_tokens=0)
    await second.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    with pytest.raises(AdmissionError) as info:
        await first.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    assert info.value.limit in {"requests_per_minute", "max_concurrent"}
    keys = [k async for k in first._redis.scan_iter(f"{namespace}:*")]
    await first._redis.delete(*keys)
    await first.close()
    await second.close()


async def test_redis_away_fails_closed_and_owed_releases_return_the_slot() -> None:
    """Redis behind a TCP link we cut: acquire refuses with 503 (never admits uncounted), a
    release during the cut is kept and given back once Redis answers (not after the lease TTL)."""
    if not _redis_up():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    from tests.reliability.proxies import TcpCut

    link = TcpCut(6379).start()
    adm = RedisAdmission(f"redis://127.0.0.1:{link.port}/0", namespace=f"kvgate-test-{secrets.token_hex(4)}")
    direct = RedisAdmission(REDIS_URL, namespace=adm._ns)
    limits = Limits(max_concurrent=1)
    try:
        held = await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
        link.cut()
        with pytest.raises(AdmissionError) as refused:
            await adm.acquire("t", Limits(max_concurrent=5), prompt_tokens=1, max_output_tokens=1)
        assert (refused.value.status, refused.value.code, refused.value.retry_after) == (503, "admission_unavailable", 1.0)
        await adm.release(held, completion_tokens=1)  # Redis away: owed, not lost
        for _ in range(3):  # more refusals while away: each leaves an owed (idempotent) release
            with pytest.raises(AdmissionError):
                await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
        assert adm.owed_releases >= 4
        assert await direct.in_flight("t") == 1  # still held in Redis
        link.restore()
        # Several requests give owed slots back at once: each is sent once, none is dropped.
        await asyncio.gather(*(adm.retry_releases() for _ in range(4)))
        assert adm.owed_releases == 0 and await direct.in_flight("t") == 0
        again = await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)  # the slot is back
        await adm.release(again, completion_tokens=0)
    finally:
        link.close()
        await adm.close()
        await direct.close()


async def test_redis_leases_are_renewed_while_live_and_lapse_when_their_gateway_stops_beating() -> None:
    """The heartbeat moves a live lease's expiry forward (Redis' clock), never brings back a
    released one, and the lease of a gateway that stopped beating (a SIGKILL) expires one
    TTL after its last renewal: then another gateway gets the slot."""
    if not _redis_up():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    namespace = f"kvgate-test-{secrets.token_hex(4)}"
    live = RedisAdmission(REDIS_URL, namespace=namespace, lease_ttl_s=30.0)
    dead = RedisAdmission(REDIS_URL, namespace=namespace, lease_ttl_s=1.0)
    zset = live._keys("t")[2]
    one = Limits(max_concurrent=1)
    try:
        lease = await live.acquire("t", Limits(max_concurrent=2), prompt_tokens=1, max_output_tokens=1)
        granted = await live._redis.zscore(zset, lease.lease_id)
        await asyncio.sleep(0.01)
        assert await live.renew_leases() == 1 and live.live_leases == 1
        assert await live._redis.zscore(zset, lease.lease_id) > granted
        await live.release(lease, completion_tokens=0)
        assert await live.renew_leases() == 0 and await live._redis.zcard(zset) == 0  # not resurrected

        held = await dead.acquire("t", one, prompt_tokens=1, max_output_tokens=1)  # then it "dies": no beats
        expiry = await live._redis.zscore(zset, held.lease_id)
        seconds, micros = await live._redis.time()
        assert expiry <= seconds + micros / 1e6 + dead.lease_ttl_s  # within one TTL of now
        with pytest.raises(AdmissionError):
            await live.acquire("t", one, prompt_tokens=1, max_output_tokens=1)
        while True:  # wait on Redis' clock, not ours, for the lease's expiry
            seconds, micros = await live._redis.time()
            if seconds + micros / 1e6 > expiry:
                break
            await asyncio.sleep(0.05)
        taken = await live.acquire("t", one, prompt_tokens=1, max_output_tokens=1)  # the dead slot is free
        await live.release(taken, completion_tokens=0)
    finally:
        keys = [k async for k in live._redis.scan_iter(f"{namespace}:*")]
        if keys:
            await live._redis.delete(*keys)
        await live.close()
        await dead.close()


async def test_a_request_never_served_gives_back_everything_it_took_once(make_admission) -> None:
    """Refused after its decision (a re-decision, a key revoked meanwhile, a failure before the
    engine call): its request token, prompt and output reservation all go back, exactly once."""
    adm = make_admission()
    limits = Limits(requests_per_minute=1, tokens_per_minute=100)
    lease = await adm.acquire("t", limits, prompt_tokens=60, max_output_tokens=10)
    await adm.release_unserved(lease)
    await adm.release_unserved(lease)  # idempotent
    if isinstance(adm, RedisAdmission):
        adm._unreleased.append((lease, None))  # sent again (its first answer lost): Redis gives back nothing more
        assert await adm.retry_releases() == 1
    await adm.acquire("t", limits, prompt_tokens=60, max_output_tokens=40)  # the request token and all 100 back
    with pytest.raises(AdmissionError) as info:  # ... once: nothing more than the bucket held
        await adm.acquire("t", Limits(tokens_per_minute=100), prompt_tokens=1, max_output_tokens=1)
    assert info.value.limit == "tokens_per_minute"


async def test_redis_an_acquire_cancelled_after_redis_granted_it_is_given_back_whole() -> None:
    """The request went away while Redis decided (Redis stored the lease, the answer was never read):
    the owed release gives back its request token and its whole reservation, not only its output."""
    if not _redis_up():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    adm = RedisAdmission(REDIS_URL, namespace=f"kvgate-test-{secrets.token_hex(4)}")
    granted = adm._acquire

    async def granted_then_cancelled(**kwargs):
        await granted(**kwargs)
        raise asyncio.CancelledError

    limits = Limits(requests_per_minute=1, tokens_per_minute=100, max_concurrent=1)
    try:
        adm._acquire = granted_then_cancelled
        with pytest.raises(asyncio.CancelledError):
            await adm.acquire("t", limits, prompt_tokens=60, max_output_tokens=10)
        adm._acquire = granted
        lease = await adm.acquire("t", limits, prompt_tokens=60, max_output_tokens=40)  # the owed release runs first
        assert adm.owed_releases == 0 and await adm.in_flight("t") == 1
        await adm.release(lease, completion_tokens=40)
    finally:
        keys = [k async for k in adm._redis.scan_iter(f"{adm._ns}:*")]
        if keys:
            await adm._redis.delete(*keys)
        await adm.close()


async def test_local_a_limit_raised_while_a_request_runs_binds_from_the_next_decision() -> None:
    """Release adds back what the request did not use, and nothing else: it neither refills at
    the rate the lease was admitted under nor caps at that capacity, so the time the request ran
    refills at the limit in force at the next decision."""
    clock = FakeClock()
    adm = LocalAdmission(clock=clock)
    old, new = Limits(tokens_per_minute=1000), Limits(tokens_per_minute=60_000)
    lease = await adm.acquire("t", old, prompt_tokens=10, max_output_tokens=990)  # the bucket is empty
    clock.now += 60.0  # the limit was raised to 60 000/min while the request ran a minute
    await adm.release(lease, completion_tokens=10)
    await adm.acquire("t", new, prompt_tokens=10, max_output_tokens=29_990)  # 30 000 of 60 000


async def test_redis_a_limit_raised_while_a_request_runs_binds_from_the_next_decision() -> None:
    if not _redis_up():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    adm = RedisAdmission(REDIS_URL, namespace=f"kvgate-test-{secrets.token_hex(4)}")
    old, new = Limits(tokens_per_minute=1000), Limits(tokens_per_minute=60_000)
    try:
        lease = await adm.acquire("t", old, prompt_tokens=10, max_output_tokens=990)  # the bucket is empty
        tpm = adm._keys("t")[1]
        # The request ran a minute: its bucket was last decided on one minute ago.
        await adm._redis.hset(tpm, "ts", float(await adm._redis.hget(tpm, "ts")) - 60)
        await adm.release(lease, completion_tokens=10)
        await adm.acquire("t", new, prompt_tokens=10, max_output_tokens=29_990)  # 30 000 of 60 000
    finally:
        keys = [k async for k in adm._redis.scan_iter(f"{adm._ns}:*")]
        if keys:
            await adm._redis.delete(*keys)
        await adm.close()


async def test_redis_a_bucket_stamped_in_redis_future_is_not_drained() -> None:
    """Redis' clock stepped back (an NTP step, a failover to a replica behind): a bucket last
    written "later" than Redis' now refills by nothing, and drains by nothing either."""
    if not _redis_up():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    adm = RedisAdmission(REDIS_URL, namespace=f"kvgate-test-{secrets.token_hex(4)}")
    try:
        seconds, micros = await adm._redis.time()
        rpm, tpm = adm._keys("t")[:2]
        ahead = seconds + micros / 1e6 + 300
        await adm._redis.hset(rpm, mapping={"level": 60, "ts": ahead})  # full, written 300 s in Redis' future
        await adm._redis.hset(tpm, mapping={"level": 600, "ts": ahead})
        lease = await adm.acquire("t", Limits(requests_per_minute=60, tokens_per_minute=600), prompt_tokens=100,
                                  max_output_tokens=500)
        await adm.release(lease, completion_tokens=500)
    finally:
        keys = [k async for k in adm._redis.scan_iter(f"{adm._ns}:*")]
        if keys:
            await adm._redis.delete(*keys)
        await adm.close()


@pytest.mark.parametrize("field", ["requests_per_minute", "tokens_per_minute", "max_concurrent",
                                   "max_prompt_tokens", "max_output_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_a_limit_below_one_is_refused(field, value) -> None:
    """None is unlimited; 0 would mean something different on each backend (the registry refuses it too)."""
    with pytest.raises(ValueError, match=field):
        Limits(**{field: value})
    assert getattr(Limits(**{field: 1}), field) == 1
