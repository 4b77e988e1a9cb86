"""Rate-limit response headers: OpenAI's ``x-ratelimit-*`` and Anthropic's ``anthropic-ratelimit-*``.

The figures are the tenant's buckets as the request's own admission decision left them (remaining
after its reservation), read by that decision (under the lock in process; returned by the same
Lua script on Redis). First admission alone, in process and on a real Redis (``make_admission``),
then end to end: the real gateway over HTTP in front of the fixed engine
(``test_admission_reservation``'s harness), with in-process and with Redis admission.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from datetime import UTC, datetime

import httpx
import openai
import pytest

from server.gateway.admission import AdmissionError, Limits, LocalAdmission
from server.gateway.rate_headers import anthropic_rate_headers, openai_rate_headers, reset_duration
from tests.server.gateway.test_admission import FakeClock, _redis_up, make_admission  # noqa: F401
from tests.server.gateway.test_admission_reservation import MODEL, FixedEngine, chat, start_gateway

OPENAI_NAMES = [f"x-ratelimit-{part}-{kind}" for kind in ("requests", "tokens")
                for part in ("limit", "remaining", "reset")]
ANTHROPIC_NAMES = [f"anthropic-ratelimit-{kind}-{part}" for kind in ("requests", "tokens")
                   for part in ("limit", "remaining", "reset")]


def seconds(duration: str) -> float:
    """An OpenAI reset duration ("20ms", "8.64s", "6m0s", "1h0m0s") in seconds."""
    if duration.endswith("ms"):
        return int(duration[:-2]) / 1000.0
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(\d+(?:\.\d+)?)s", duration)
    assert match, duration
    hours, minutes, secs = match.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs)


def rfc3339_in(value: str) -> float:
    """Seconds from now to an RFC 3339 UTC time (``...Z``)."""
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", value), value
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() - time.time()


# Admission alone --------------------------------------------------------------------------------
def test_reset_durations_read_as_openai_writes_them() -> None:
    assert [reset_duration(s) for s in (0, 0.0004, 0.02, 1, 8.64, 60, 90.5, 360, 3600)] == [
        "0s", "1ms", "20ms", "1s", "8.64s", "1m0s", "1m30.5s", "6m0s", "1h0m0s"]


async def test_each_decision_reports_the_buckets_it_leaves(make_admission) -> None:
    adm = make_admission()
    limits = Limits(requests_per_minute=3, tokens_per_minute=1000)
    leases = [await adm.acquire("t", limits, prompt_tokens=30, max_output_tokens=70) for _ in range(3)]
    # After its own take: 2, 1, 0 requests left; 900, 800, 700 tokens (plus the little refill since).
    assert [math.floor(lease.rate.requests_level) for lease in leases] == [2, 1, 0]
    assert [math.floor(lease.rate.tokens_level) for lease in leases][0] == 900
    assert all(0 <= lease.rate.tokens_level - want < 5 for lease, want in zip(leases, (900, 800, 700)))
    headers = openai_rate_headers(leases[0].rate)
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("3", "2")
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == ("1000", "900")
    assert 19.0 < seconds(headers["x-ratelimit-reset-requests"]) <= 20.0  # one request back at 3/min
    assert 5.0 < seconds(headers["x-ratelimit-reset-tokens"]) <= 6.0  # 100 tokens at 1000/min
    with pytest.raises(AdmissionError) as info:
        await adm.acquire("t", limits, prompt_tokens=30, max_output_tokens=70)
    # Refused: the buckets as they stood (nothing taken), 0 requests left.
    assert info.value.rate is not None and info.value.rate.requests_level < 1.0
    assert 700 <= info.value.rate.tokens_level < 705
    assert openai_rate_headers(info.value.rate)["x-ratelimit-remaining-requests"] == "0"
    for lease in leases:
        await adm.release(lease, completion_tokens=10)
    # The refunds (60 each) are in the next decision's figures: ~700 + 180 - 100.
    again = await adm.acquire("t", Limits(tokens_per_minute=1000), prompt_tokens=30, max_output_tokens=70)
    assert again.rate.requests_limit is None and 780 <= again.rate.tokens_level < 790
    assert set(openai_rate_headers(again.rate)) == {"x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                                                    "x-ratelimit-reset-tokens"}


async def test_a_debt_reports_nothing_remaining_and_a_reset_past_the_minute(make_admission) -> None:
    adm = make_admission()
    limits = Limits(tokens_per_minute=100)
    lease = await adm.acquire("t", limits, prompt_tokens=10, max_output_tokens=10)
    await adm.release(lease, completion_tokens=200)  # an engine that overran max_tokens: 190 charged, level -110
    with pytest.raises(AdmissionError) as info:
        await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    rate = info.value.rate
    assert rate is not None and -111 < rate.tokens_level < -105
    headers = openai_rate_headers(rate)
    assert headers["x-ratelimit-remaining-tokens"] == "0" and "x-ratelimit-limit-requests" not in headers
    assert 120.0 < seconds(headers["x-ratelimit-reset-tokens"]) <= 126.0  # 210 tokens at 100/min
    anthropic = anthropic_rate_headers(rate)
    assert anthropic["anthropic-ratelimit-tokens-remaining"] == "0"
    assert 119.0 < rfc3339_in(anthropic["anthropic-ratelimit-tokens-reset"]) <= 127.0


async def test_a_tenant_without_rate_limits_gets_no_figures(make_admission) -> None:
    adm = make_admission()
    lease = await adm.acquire("t", Limits(max_concurrent=1), prompt_tokens=1, max_output_tokens=1)
    assert lease.rate is None
    with pytest.raises(AdmissionError) as info:
        await adm.acquire("t", Limits(max_concurrent=1), prompt_tokens=1, max_output_tokens=1)
    assert info.value.rate is None


async def test_local_levels_follow_its_clock() -> None:
    clock = FakeClock()
    adm = LocalAdmission(clock=clock)
    limits = Limits(requests_per_minute=60)
    first = await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    clock.now += 0.5  # half a request refilled
    second = await adm.acquire("t", limits, prompt_tokens=1, max_output_tokens=1)
    assert (first.rate.requests_level, second.rate.requests_level) == (59.0, 58.5)
    assert openai_rate_headers(second.rate)["x-ratelimit-reset-requests"] in ("1.5s", "1.499s")


# End to end ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixed_engine():
    built = FixedEngine()
    yield built
    built.close()


@pytest.fixture(scope="module", params=["local", "redis"])
def gw(request, fixed_engine, tmp_path_factory):
    if request.param == "redis" and not _redis_up():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    built = start_gateway(tmp_path_factory.mktemp(f"ratelimit-{request.param}"), fixed_engine,
                          redis=request.param == "redis")
    yield built
    built.close()


def post(gw, slug: str, path: str = "/v1/chat/completions", body: dict | None = None) -> httpx.Response:
    return httpx.post(gw.url + path, json=body or chat(4), headers=gw.headers(slug), timeout=60)


def test_requests_remaining_count_down_then_the_429_says_none_left(gw, fixed_engine) -> None:
    slug = "rpm-" + secrets.token_hex(3)
    gw.add_tenant(slug, rpm_limit=3, tpm_limit=100_000)
    fixed_engine.answer(4)
    remaining = []
    for _ in range(3):
        answer = post(gw, slug)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-ratelimit-limit-requests"] == "3"
        assert answer.headers["x-ratelimit-limit-tokens"] == "100000"
        remaining.append(answer.headers["x-ratelimit-remaining-requests"])
        assert 0.0 < seconds(answer.headers["x-ratelimit-reset-requests"]) <= 60.0
    assert remaining == ["2", "1", "0"]
    refused = post(gw, slug)
    assert refused.status_code == 429, refused.text
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-limit-requests"] == "3"
    # Refused: its tokens not taken, the real level (what three short answers used, refilled at ~1 667/s).
    assert 99_000 < int(refused.headers["x-ratelimit-remaining-tokens"]) <= 100_000
    # Retry-After as before, beside it the precise wait; the bucket is full again a minute after the first.
    wait_ms = int(refused.headers["retry-after-ms"])
    assert 15_000 < wait_ms <= 20_000 and refused.headers["retry-after"] == str(math.ceil(wait_ms / 1000))
    assert 50.0 < seconds(refused.headers["x-ratelimit-reset-requests"]) <= 60.0


def test_tokens_remaining_after_the_reservation_and_after_the_refund(gw, fixed_engine) -> None:
    slug = "tpm-" + secrets.token_hex(3)
    gw.add_tenant(slug, rpm_limit=10, tpm_limit=1000, max_output_tokens=2000)
    fixed_engine.answer(5)  # 5 of the 100 reserved output tokens generated: 95 go back at release
    started = time.monotonic()
    first = post(gw, slug, body=chat(100))
    assert first.status_code == 200, first.text
    taken = first.json()["usage"]["prompt_tokens"] + 100
    assert first.json()["usage"]["completion_tokens"] == 5
    assert first.headers["x-ratelimit-remaining-tokens"] == str(1000 - taken)  # a full bucket, less its take
    second = post(gw, slug, body=chat(100))
    refill = (time.monotonic() - started) * 1000 / 60
    left = int(second.headers["x-ratelimit-remaining-tokens"])
    assert 1000 - 2 * taken + 95 <= left <= 1000 - 2 * taken + 95 + refill + 1, (left, taken, refill)
    assert second.headers["x-ratelimit-remaining-requests"] == "8"
    assert 0.0 < seconds(second.headers["x-ratelimit-reset-tokens"]) <= 60.0


def test_a_stream_carries_them_on_its_first_response(gw, fixed_engine) -> None:
    slug = "stream-" + secrets.token_hex(3)
    gw.add_tenant(slug, rpm_limit=10, tpm_limit=5000)
    fixed_engine.answer(4)
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=chat(4, stream=True), headers=gw.headers(slug),
                      timeout=60) as answer:
        assert answer.status_code == 200
        assert answer.headers["x-ratelimit-remaining-requests"] == "9"  # before any of the body is read
        assert all(name in answer.headers for name in OPENAI_NAMES)
        assert "".join(answer.iter_text()).rstrip().endswith("[DONE]")
    # The Responses API, streamed and not, and the legacy completions: the same names.
    for path, body in (("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 16, "store": False}),
                       ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 16, "store": False,
                                          "stream": True}),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi there", "max_tokens": 4})):
        answer = post(gw, slug, path, body)
        assert answer.status_code == 200, (path, answer.text)
        assert all(name in answer.headers for name in OPENAI_NAMES), (path, answer.headers)


def test_messages_reports_anthropics_headers_with_rfc3339_resets(gw, fixed_engine) -> None:
    slug = "msg-" + secrets.token_hex(3)
    gw.add_tenant(slug, rpm_limit=2, tpm_limit=6000)
    fixed_engine.answer(4)
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": gw.keys[slug]}
    answer = httpx.post(gw.url + "/v1/messages", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    assert not any(name.startswith("x-ratelimit-") for name in answer.headers)
    assert [answer.headers[n] for n in ANTHROPIC_NAMES[:2]] == ["2", "1"]
    assert answer.headers["anthropic-ratelimit-tokens-limit"] == "6000"
    assert int(answer.headers["anthropic-ratelimit-tokens-remaining"]) < 6000
    assert 28.0 < rfc3339_in(answer.headers["anthropic-ratelimit-requests-reset"]) <= 31.0  # 1 request at 2/min
    assert 0.0 < rfc3339_in(answer.headers["anthropic-ratelimit-tokens-reset"]) <= 61.0
    streamed = httpx.post(gw.url + "/v1/messages", json={**body, "stream": True}, headers=headers, timeout=60)
    assert streamed.status_code == 200 and streamed.headers["anthropic-ratelimit-requests-remaining"] == "0"
    refused = httpx.post(gw.url + "/v1/messages", json=body, headers=headers, timeout=60)
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert refused.headers["retry-after"] and int(refused.headers["retry-after-ms"]) > 0
    assert 50.0 < rfc3339_in(refused.headers["anthropic-ratelimit-requests-reset"]) <= 61.0


def test_the_openai_sdk_reads_them(gw, fixed_engine) -> None:
    slug = "sdk-" + secrets.token_hex(3)
    gw.add_tenant(slug, rpm_limit=2, tpm_limit=7000)
    fixed_engine.answer(4)
    api = openai.OpenAI(api_key=gw.keys[slug], base_url=gw.url + "/v1", max_retries=0, timeout=60)
    raw = api.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=4)
    assert raw.parse().usage.completion_tokens == 4
    assert raw.headers.get("x-ratelimit-limit-requests") == "2"
    assert raw.headers.get("x-ratelimit-remaining-requests") == "1"
    reserved = raw.parse().usage.prompt_tokens + 4
    assert raw.headers.get("x-ratelimit-remaining-tokens") == str(7000 - reserved)
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.RateLimitError) as info:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert info.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(info.value.response.headers["retry-after-ms"]) > 0


def test_a_tenant_without_rate_limits_gets_no_header(gw, fixed_engine, monkeypatch) -> None:
    """The registry always sets rpm and tpm; a context built without them (as in-process runs and
    benches build) answers without any rate-limit header."""
    import server.gateway.auth as auth

    real = auth.Limits
    monkeypatch.setattr(auth, "Limits", lambda rpm, tpm, *rest: real(None, None, *rest))
    slug = "unlimited-" + secrets.token_hex(3)
    gw.add_tenant(slug)
    fixed_engine.answer(4)
    for path, body in (("/v1/chat/completions", chat(4)), ("/v1/chat/completions", chat(4, stream=True)),
                       ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 16, "store": False})):
        answer = post(gw, slug, path, body)
        assert answer.status_code == 200, answer.text
        assert not any(name.startswith("x-ratelimit-") for name in answer.headers), (path, answer.headers)
    answer = httpx.post(gw.url + "/v1/messages", headers={"x-api-key": gw.keys[slug]}, timeout=60,
                        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200 and not any(n.startswith("anthropic-ratelimit-") for n in answer.headers)
