"""tokens_per_minute holds under concurrency: admission reserves prompt + output limit, release refunds.

A request takes its prompt tokens *and* the output limit it runs with (its ``max_tokens``, or
the tenant's output limit when it names none) from the tenant's token bucket when it is
admitted; when it ends, the part of that reservation it did not generate goes back (once,
whatever ended it). So a burst of concurrent requests can never be served more than the
bucket held plus what it refilled meanwhile, and a request whose reservation exceeds the
bucket's capacity is refused at once (429 ``rate_limit_exceeded`` naming ``max_tokens``, as
OpenAI's "Request too large"), never admitted.

In-process and on a real Redis (``make_admission``, from test_admission.py), then end to end:
a real gateway over HTTP (``build_serving_app``, uvicorn, a migrated SQLite registry) in front
of ``bench/server/fixed_engine.py``'s model (the real KServe contract, a fixed answer, paced),
with in-process and with Redis admission.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2_grpc

from bench.server.fixed_engine import FixedModel
from server.gateway.admission import AdmissionError, Limits, RedisAdmission
from server.gateway.services import LoopIntervals
from server.serving import build_serving_app
from server.settings import Settings
from tenants import keys, migrate, pools, retention_classes, tenant
from tenants.db import make_engine, make_session_factory
from tests.server.gateway.stack import GatewayServer, free_port
from tests.server.gateway.test_admission import REDIS_URL, _redis_up, make_admission  # noqa: F401

ACTOR = "test:reservation"
MODEL = "smollm2-135m-instruct"
POOL = "fixed"
PEPPER = "reservation-pepper-" + secrets.token_hex(16)


# Admission alone (in-process and Redis) ----------------------------------------------------------
async def test_a_reservation_that_can_never_fit_is_refused_as_request_too_large(make_admission) -> None:
    adm = make_admission()
    limits = Limits(tokens_per_minute=300)
    with pytest.raises(AdmissionError) as info:
        await adm.acquire("t", limits, prompt_tokens=12, max_output_tokens=1000)
    error = info.value
    assert (error.status, error.code, error.limit) == (429, "rate_limit_exceeded", "tokens_per_minute")
    assert "Request too large" in str(error) and "Limit 300, Requested 1012" in str(error)
    assert "max_tokens" in str(error)  # what the client can lower
    with pytest.raises(AdmissionError) as info:  # a prompt alone over the limit: the same refusal
        await adm.acquire("t", limits, prompt_tokens=301, max_output_tokens=1)
    assert (info.value.status, info.value.code) == (429, "rate_limit_exceeded") and "prompt" in str(info.value)
    # Refused before any bucket was touched: the whole capacity is still there.
    await adm.acquire("t", limits, prompt_tokens=12, max_output_tokens=288)


async def test_a_concurrent_burst_is_never_served_more_than_the_limit(make_admission) -> None:
    adm = make_admission()
    limits = Limits(tokens_per_minute=600)
    served: list[int] = []

    async def one() -> None:
        try:
            lease = await adm.acquire("t", limits, prompt_tokens=20, max_output_tokens=100)
        except AdmissionError as exc:
            assert exc.limit == "tokens_per_minute" and exc.status == 429
            return
        await asyncio.sleep(0.05)  # generating: every request of the burst is decided meanwhile
        served.append(20 + 100)
        await adm.release(lease, completion_tokens=100)

    started = time.monotonic()
    await asyncio.gather(*(one() for _ in range(12)))
    refill = (time.monotonic() - started) * 600 / 60
    assert served, "nothing admitted"
    assert sum(served) <= 600 + refill, (len(served), sum(served))


async def test_the_unused_part_of_a_reservation_is_refunded_at_release(make_admission) -> None:
    adm = make_admission()
    limits = Limits(tokens_per_minute=1000)
    first = await adm.acquire("t", limits, prompt_tokens=30, max_output_tokens=600)
    with pytest.raises(AdmissionError) as info:  # 630 reserved: 370 left, not enough for another 630
        await adm.acquire("t", limits, prompt_tokens=30, max_output_tokens=600)
    assert info.value.limit == "tokens_per_minute" and info.value.status == 429
    assert "630" in str(info.value)  # the refusal says what the request reserves
    await adm.release(first, completion_tokens=5)  # a short answer: 595 of the reservation come back
    await adm.acquire("t", limits, prompt_tokens=30, max_output_tokens=600)


async def test_a_refund_is_given_once(make_admission) -> None:
    adm = make_admission()
    limits = Limits(tokens_per_minute=600)
    a = await adm.acquire("t", limits, prompt_tokens=20, max_output_tokens=280)
    await adm.acquire("t", limits, prompt_tokens=20, max_output_tokens=280)  # the bucket is empty now
    await adm.release(a, completion_tokens=0)  # 280 back
    await adm.release(a, completion_tokens=0)  # idempotent
    if isinstance(adm, RedisAdmission):
        # A release whose answer was lost is sent again (retry_releases): Redis refunds it once.
        adm._unreleased.append((a, 0))
        assert await adm.retry_releases() == 1
    with pytest.raises(AdmissionError):  # 280 (+ a little refill) < 320
        await adm.acquire("t", limits, prompt_tokens=20, max_output_tokens=300)
    await adm.acquire("t", limits, prompt_tokens=20, max_output_tokens=250)


async def test_tokens_past_the_reservation_are_charged_in_full(make_admission) -> None:
    """Debt is not forgiven: an answer longer than its reservation delays the next admissions
    by every token it went over (no floor at minus the capacity)."""
    adm = make_admission()
    limits = Limits(tokens_per_minute=600)
    lease = await adm.acquire("t", limits, prompt_tokens=20, max_output_tokens=10)
    await adm.release(lease, completion_tokens=1500)  # 600 - 20 - 1500 = -920
    with pytest.raises(AdmissionError) as info:
        await adm.acquire("t", limits, prompt_tokens=20, max_output_tokens=10)
    # (30 + 920) tokens at 10 per second: ~95 s (a floor at -600 would say ~63 s).
    assert 90.0 < info.value.retry_after <= 95.5


async def test_a_lost_acquire_released_later_refunds_nothing() -> None:
    """Redis away during an acquire (the lease may or may not be stored): its owed release,
    sent once Redis is back, gives back no tokens the acquire never took."""
    if not _redis_up():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    from tests.reliability.proxies import TcpCut

    link = TcpCut(6379).start()
    namespace = f"kvgate-test-{secrets.token_hex(4)}"
    adm = RedisAdmission(f"redis://127.0.0.1:{link.port}/0", namespace=namespace)
    direct = RedisAdmission(REDIS_URL, namespace=namespace)
    limits = Limits(tokens_per_minute=600)
    try:
        await direct.acquire("t", limits, prompt_tokens=20, max_output_tokens=580)  # the bucket is empty
        link.cut()
        with pytest.raises(AdmissionError) as refused:
            await adm.acquire("t", limits, prompt_tokens=20, max_output_tokens=580)
        assert refused.value.code == "admission_unavailable" and adm.owed_releases == 1
        link.restore()
        assert await adm.retry_releases() == 1
        with pytest.raises(AdmissionError) as info:
            await direct.acquire("t", limits, prompt_tokens=20, max_output_tokens=100)
        assert info.value.limit == "tokens_per_minute"
    finally:
        link.close()
        found = [k async for k in direct._redis.scan_iter(f"{namespace}:*")]
        if found:
            await direct._redis.delete(*found)
        await adm.close()
        await direct.close()


async def test_the_default_limits_admit_the_largest_request_they_allow(make_admission) -> None:
    """A tenant created with the defaults (the demo tenant of ``kvgate serve --dev`` is one):
    its longest prompt with its full output limit fits tokens_per_minute many times over."""
    adm = make_admission()
    defaults = tenant.DEFAULT_LIMITS
    limits = Limits(defaults["rpm_limit"], defaults["tpm_limit"], defaults["max_concurrent_requests"],
                    defaults["max_prompt_tokens"], defaults["max_output_tokens"])
    leases = [await adm.acquire("t", limits, prompt_tokens=defaults["max_prompt_tokens"],
                                max_output_tokens=defaults["max_output_tokens"]) for _ in range(16)]
    for lease in leases:
        await adm.release(lease, completion_tokens=10)


# End to end: a real gateway over HTTP ------------------------------------------------------------
@functools.cache
def tokenizer():
    from engines.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer()


def answer_tokens() -> list[int]:
    """What the fixed engine answers (its first ``n`` tokens): plain text, no end token."""
    return tokenizer().encode(" The quick brown fox jumps over the lazy dog and keeps running far away" * 10)


class FixedEngine:
    """``bench/server/fixed_engine.py``'s model on a loopback port, served from a loop thread of
    its own. ``answer(n, delay)``: the next requests get the first ``n`` tokens of ``answer_tokens()``
    (fewer when their ``max_tokens`` is lower), ``delay`` seconds before each streamed token."""

    def __init__(self) -> None:
        self.model = FixedModel(answer_tokens()[:16])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fixed-engine", daemon=True)
        self.thread.start()

        async def serve():
            server = grpc.aio.server()
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self.model, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        self.server, self.port = asyncio.run_coroutine_threadsafe(serve(), self.loop).result(30)

    def answer(self, tokens: int, delay: float = 0.0) -> None:
        self.model.tokens = answer_tokens()[:tokens]
        self.model.token_delay_s = delay

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Gateway:
    """A real gateway (``kvgate serve``'s app over uvicorn) on a migrated SQLite registry."""

    server: GatewayServer
    factory: object
    db_engine: object
    namespace: str | None = None
    keys: dict[str, str] = field(default_factory=dict)
    unreachable: bool = False  # a test's switch: the registry refuses new connections (test_response_store_outage)

    @property
    def url(self) -> str:
        return self.server.base_url

    def add_tenant(self, slug: str, *, retention_class: str = "chat", **limits) -> str:
        now = datetime.now(UTC)
        with self.factory() as session:
            tenant.create_tenant(session, actor=ACTOR, now=now, slug=slug, display_name=slug, pool=POOL,
                                 retention_class=retention_class, **limits)
        with self.factory() as session:
            created = keys.create_key(session, actor=ACTOR, now=now, tenant=slug, pepper=PEPPER, name="t")
        self.keys[slug] = created[1] if isinstance(created, tuple) else created.plaintext
        return self.keys[slug]

    def headers(self, slug: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[slug]}"}

    def close(self) -> None:
        self.server.stop()
        if self.namespace is not None:
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            found = list(client.scan_iter(f"{self.namespace}:*"))
            if found:
                client.delete(*found)
            client.close()
        self.db_engine.dispose()


def start_gateway(tmp: Path, engine: FixedEngine, *, redis: bool = False, **engine_kwargs) -> Gateway:
    """``engine_kwargs``: for the registry's SQLAlchemy engine (e.g. ``poolclass``)."""
    url = f"sqlite:///{tmp / 'registry.db'}"
    migrate.upgrade(url=url)
    db_engine = make_engine(url, **engine_kwargs)
    factory = make_session_factory(db_engine)
    now = datetime.now(UTC)
    with factory() as session:
        pools.create_pool(session, actor=ACTOR, now=now, name=POOL, model_name=MODEL, engine_spec="reference-smollm2",
                          tokens_per_block=16, primary_blocks=1024, secondary_blocks=0,
                          replicas=[{"name": "r0", "endpoint": f"127.0.0.1:{engine.port}"}])
    with factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=now, name="chat", system_priority=90,
                                       context_priority=60, turn_priority=40, decode_priority=20)
    with factory() as session:  # the conversation hold on: a delete reads the store first (conversation_demote.py)
        retention_classes.create_class(session, actor=ACTOR, now=now, name="held", system_priority=90,
                                       context_priority=60, turn_priority=40, decode_priority=20,
                                       conversation_hold_enabled=True)
    namespace = f"kvgate-test-{secrets.token_hex(4)}" if redis else None
    settings = Settings(database_url=url, admin_tokens=[f"ci:admin-{secrets.token_hex(8)}"], key_pepper=PEPPER,
                        trace_dir=tmp / "traces", usage_journal_dir=tmp / "journal",
                        **({"redis_url": REDIS_URL, "redis_namespace": namespace} if redis else {}))
    app = build_serving_app(settings, session_factory=factory, tokenizer_for=lambda pool: tokenizer(), auth_ttl=0.2,
                            intervals=LoopIntervals(usage_flush=0.5, last_used_flush=1.0, pool_poll=0.2))
    server = GatewayServer(app, free_port())
    server.start()
    return Gateway(server, factory, db_engine, namespace)


@pytest.fixture(scope="module")
def engine():
    built = FixedEngine()
    yield built
    built.close()


@pytest.fixture(scope="module", params=["local", "redis"])
def gateway(request, engine, tmp_path_factory):
    if request.param == "redis" and not _redis_up():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    built = start_gateway(tmp_path_factory.mktemp(f"reservation-{request.param}"), engine,
                          redis=request.param == "redis")
    yield built
    built.close()


def chat(max_tokens: int | None = None, *, stream: bool = False) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def streamed_usage(text: str) -> dict | None:
    for line in text.splitlines():
        if line.startswith("data: {") and '"usage":{' in line:
            return json.loads(line[6:])["usage"]
    return None


def test_a_concurrent_burst_over_http_is_never_served_more_than_the_limit(gateway, engine) -> None:
    slug = "burst-" + secrets.token_hex(3)
    gateway.add_tenant(slug, tpm_limit=600, max_output_tokens=2000)
    engine.answer(100, delay=0.01)  # every admitted request generates its whole max_tokens, over ~1 s

    async def one(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(gateway.url + "/v1/chat/completions", json=chat(100, stream=True),
                                 headers=gateway.headers(slug))

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(12)))

    started = time.monotonic()
    answers = asyncio.run(burst())
    refill = (time.monotonic() - started) * 600 / 60
    served = [streamed_usage(a.text) for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    assert served and all(u is not None and u["completion_tokens"] == 100 for u in served), served
    total = sum(u["prompt_tokens"] + u["completion_tokens"] for u in served)
    assert total <= 600 + refill, (len(served), total)
    for answer in refused:
        error = answer.json()["error"]
        assert answer.status_code == 429 and answer.headers.get("retry-after")
        assert (error["code"], error["param"], error["type"]) == ("rate_limit_exceeded", "tokens_per_minute",
                                                                  "tokens")


def test_an_unused_reservation_is_refunded_after_a_short_answer(gateway, engine) -> None:
    slug = "refund-" + secrets.token_hex(3)
    gateway.add_tenant(slug, tpm_limit=1000, max_output_tokens=2000)
    engine.answer(5, delay=0.3)  # a short answer (5 of 600 tokens), slowly
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=chat(600, stream=True),
                      headers=gateway.headers(slug), timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # admitted and generating
        # Its reservation (32 prompt + 600) is held: another one does not fit in what is left.
        second = httpx.post(gateway.url + "/v1/chat/completions", json=chat(600), headers=gateway.headers(slug),
                            timeout=60)
        assert second.status_code == 429 and second.json()["error"]["param"] == "tokens_per_minute"
        for _ in lines:
            pass
    # The first answer took 5 tokens: the rest of its reservation is back, the next one fits.
    third = httpx.post(gateway.url + "/v1/chat/completions", json=chat(600), headers=gateway.headers(slug), timeout=60)
    assert third.status_code == 200, third.text
    assert third.json()["usage"]["completion_tokens"] == 5


def test_a_client_that_leaves_mid_answer_gets_its_unused_reservation_refunded(gateway, engine) -> None:
    slug = "gone-" + secrets.token_hex(3)
    gateway.add_tenant(slug, tpm_limit=1000, max_output_tokens=2000)
    engine.answer(50, delay=0.2)  # ~10 s if read to the end
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=chat(600, stream=True),
                      headers=gateway.headers(slug), timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a dropped iterator closes the response (the client would leave now)
        next(line for line in lines if line.startswith("data: {"))
        refused = httpx.post(gateway.url + "/v1/chat/completions", json=chat(600), headers=gateway.headers(slug),
                             timeout=60)
        assert refused.status_code == 429  # its 632 are held while it runs
    # Closed unread, after a few tokens: the gateway notices at its next write and releases the request;
    # all but those few tokens of its reservation come back.
    deadline = time.monotonic() + 10
    while True:
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=chat(600), headers=gateway.headers(slug),
                            timeout=60)
        if answer.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert answer.status_code == 200, answer.text


def test_a_request_too_large_for_tokens_per_minute_is_refused_in_each_dialects_shape(gateway, engine) -> None:
    slug = "large-" + secrets.token_hex(3)
    gateway.add_tenant(slug, tpm_limit=600, max_output_tokens=2000)
    engine.answer(16)
    headers = gateway.headers(slug)
    # OpenAI chat: 32 prompt tokens + max_tokens 1000 can never fit 600.
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=chat(1000), headers=headers, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == 429, answer.text
    assert (error["code"], error["type"], error["param"]) == ("rate_limit_exceeded", "tokens", "tokens_per_minute")
    assert "Request too large" in error["message"] and "Limit 600, Requested 1032" in error["message"]
    assert "max_tokens" in error["message"]
    assert "retry-after" not in answer.headers  # never admissible as sent: retrying it unchanged cannot help
    series = [line for line in httpx.get(gateway.url + "/metrics", timeout=60).text.splitlines()
              if line.startswith("kvgate_rate_limited_total{") and f'tenant="{slug}"' in line]
    # a size refusal, not rate limiting: kept out of the tenant's rate-limited alert
    assert series and all('limit="request_too_large"' in line for line in series), series
    # No max_tokens: the tenant's output limit (2000) is what the request would run with.
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=chat(), headers=headers, timeout=60)
    assert answer.status_code == 429 and "Requested 2032" in answer.json()["error"]["message"]
    assert "max_output_tokens" in answer.json()["error"]["message"]
    # Anthropic Messages: its own shape, 429 rate_limit_error.
    messages = {"model": MODEL, "max_tokens": 1000, "messages": [{"role": "user", "content": "hi there"}]}
    answer = httpx.post(gateway.url + "/v1/messages", headers={"x-api-key": gateway.keys[slug]}, json=messages,
                        timeout=60)
    body = answer.json()
    assert answer.status_code == 429, answer.text
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "Request too large" in body["error"]["message"] and "max_tokens" in body["error"]["message"]
    # Responses API: OpenAI's shape, the same code.
    answer = httpx.post(gateway.url + "/v1/responses", headers=headers, timeout=60,
                        json={"model": MODEL, "input": "hi there", "max_output_tokens": 1000, "store": False})
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["code"] == "rate_limit_exceeded"
    # None of these took anything: a request that fits is served at once.
    answer = httpx.post(gateway.url + "/v1/chat/completions", json=chat(500), headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text


def test_a_tenant_with_the_default_limits_is_served_without_max_tokens(gateway, engine) -> None:
    """The defaults (the demo tenant's): the tenant's output limit (1024) is reserved and fits."""
    slug = "defaults-" + secrets.token_hex(3)
    gateway.add_tenant(slug)
    engine.answer(16)
    for _ in range(3):
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=chat(), headers=gateway.headers(slug),
                            timeout=60)
        assert answer.status_code == 200, answer.text


def test_a_rate_limited_request_is_typed_by_its_limit_as_openai_does(gateway, engine) -> None:
    """OpenAI's 429 body: ``type`` "requests" or "tokens" (which limit), code ``rate_limit_exceeded``;
    Anthropic's /v1/messages keeps its own ``rate_limit_error``."""
    slug = "typed-" + secrets.token_hex(3)
    gateway.add_tenant(slug, rpm_limit=1)
    engine.answer(4)
    headers = gateway.headers(slug)
    served = httpx.post(gateway.url + "/v1/chat/completions", json=chat(4), headers=headers, timeout=60)
    assert served.status_code == 200, served.text
    for path, body in (("/v1/chat/completions", chat(4)),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi there", "max_tokens": 4}),
                       ("/v1/responses", {"model": MODEL, "input": "hi there", "max_output_tokens": 16,
                                          "store": False})):
        answer = httpx.post(gateway.url + path, json=body, headers=headers, timeout=60)
        assert answer.status_code == 429 and answer.headers.get("retry-after"), (path, answer.text)
        assert answer.headers["x-ratelimit-remaining-requests"] == "0", (path, answer.headers)  # OpenAI's names
        error = answer.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded",
                                                                  "requests_per_minute"), (path, error)
    answer = httpx.post(gateway.url + "/v1/messages", headers={"x-api-key": gateway.keys[slug]}, timeout=60,
                        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 429 and answer.json()["error"]["type"] == "rate_limit_error"
    assert answer.headers["anthropic-ratelimit-requests-remaining"] == "0"  # Anthropic's names


def test_openai_429_types_name_the_limit() -> None:
    from server.gateway.errors import error_body

    def kind(param: str | None) -> str:
        return error_body(429, "rate_limit_exceeded", "why", param)["error"]["type"]

    assert [kind(p) for p in ("requests_per_minute", "max_concurrent", "tokens_per_minute")] == [
        "requests", "requests", "tokens"]
    assert error_body(400, "limit_exceeded", "why", "max_output_tokens")["error"]["type"] == "invalid_request_error"


def test_a_failure_before_the_engine_call_gives_the_slot_back(gateway, engine, monkeypatch) -> None:
    """Anything failing between admission and the engine call (planning here) answers 500 and
    releases the lease, never served: the tenant's one concurrent slot is free for the next request."""
    import server.gateway.api.completions as completions

    slug = "planfault-" + secrets.token_hex(3)
    gateway.add_tenant(slug, max_concurrent_requests=1, rpm_limit=2)
    engine.answer(4)
    real, calls = completions.build_plan, []

    def failing_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected planning fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(completions, "build_plan", failing_once)
    failed = httpx.post(gateway.url + "/v1/chat/completions", json=chat(4), headers=gateway.headers(slug), timeout=60)
    assert failed.status_code == 500, failed.text
    # The next one is admitted at once: the slot and the first request's token (rpm 2) came back.
    for _ in range(2):
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=chat(4), headers=gateway.headers(slug),
                            timeout=60)
        assert answer.status_code == 200, answer.text
