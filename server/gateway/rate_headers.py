"""Rate-limit response headers: a tenant's buckets as its admission decision left them.

What is reported comes from :class:`~server.gateway.admission.RateLevels`, read by the decision
itself (under the lock, or returned by the Redis script), so no header costs a round trip.
Two dialects name the same figures:

* OpenAI (chat, completions, responses): ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``,
  reset as a Go-style duration ("20ms", "8.64s", "6m0s");
* Anthropic (messages): ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}``, reset
  as an RFC 3339 UTC time.

Invariants: only the limits the tenant has are reported; remaining is the level rounded down,
0 for a debt; reset is when the bucket would be full again with no further take, counted from
when the header is built (a non-streamed answer sent after its generation does not send a stale
reset).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from server.gateway.admission import AdmissionError, RateLevels, retry_after_header

RateHeaders = Callable[[RateLevels], dict[str, str]]


def _to_full(limit: int, level: float, elapsed: float) -> float:
    """Seconds until the bucket is full again (no further take), counted from now."""
    return max(0.0, (limit - level) * 60.0 / limit - elapsed)


def reset_duration(seconds: float) -> str:
    """OpenAI's ``x-ratelimit-reset-*`` format (Go's duration, to the millisecond): "20ms", "1s",
    "8.64s", "6m0s", "1h0m0s"; "0s" for a full bucket."""
    ms = math.ceil(seconds * 1000.0 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms // 1000}.{ms % 1000:03d}".rstrip("0") + "s"
    if not minutes:
        return secs
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}" if hours else f"{minutes}m{secs}"


def rfc3339_after(seconds_from_now: float) -> str:
    """Anthropic's reset: the UTC time, rounded up to the second (the bucket is full at that
    instant, not a moment after it)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(time.time() + seconds_from_now)))


Names = tuple[tuple[str, str, str], tuple[str, str, str]]  # (limit, remaining, reset) for requests, then tokens


def _headers(rate: RateLevels, names: Names, reset: Callable[[float], str]) -> dict[str, str]:
    elapsed = time.monotonic() - rate.decided_at
    headers: dict[str, str] = {}
    for (limit_name, remaining_name, reset_name), limit, level in (
            (names[0], rate.requests_limit, rate.requests_level), (names[1], rate.tokens_limit, rate.tokens_level)):
        if limit is None:
            continue
        headers[limit_name] = str(limit)
        headers[remaining_name] = str(max(0, math.floor(level)))
        headers[reset_name] = reset(_to_full(limit, level, elapsed))
    return headers


_OPENAI: Names = tuple((f"x-ratelimit-limit-{b}", f"x-ratelimit-remaining-{b}", f"x-ratelimit-reset-{b}")
                       for b in ("requests", "tokens"))  # type: ignore[assignment]
_ANTHROPIC: Names = tuple((f"anthropic-ratelimit-{b}-limit", f"anthropic-ratelimit-{b}-remaining",
                           f"anthropic-ratelimit-{b}-reset") for b in ("requests", "tokens"))  # type: ignore[assignment]


def openai_rate_headers(rate: RateLevels) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, for the limits the tenant has."""
    return _headers(rate, _OPENAI, reset_duration)


def anthropic_rate_headers(rate: RateLevels) -> dict[str, str]:
    """Anthropic's ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` (reset: when
    the bucket is full again, RFC 3339 UTC), for the limits the tenant has."""
    return _headers(rate, _ANTHROPIC, rfc3339_after)


def retry_after_ms_header(error: AdmissionError) -> str:
    """``retry-after-ms``: the wait to the millisecond (the OpenAI and Anthropic SDKs read it first)."""
    return str(max(1, math.ceil((error.retry_after or 1.0) * 1000)))


def refusal_headers(error: AdmissionError, rate_headers: RateHeaders) -> dict[str, str]:
    """The headers of a refusal worth retrying (``retry_after`` set): ``Retry-After``; on a 429 also
    ``retry-after-ms`` and the buckets as the refusing decision saw them, in the dialect's names
    (``rate_headers``: :func:`openai_rate_headers` or :func:`anthropic_rate_headers`)."""
    headers = {"Retry-After": retry_after_header(error)}
    if error.status == 429:
        headers["retry-after-ms"] = retry_after_ms_header(error)
        if error.rate is not None:
            headers.update(rate_headers(error.rate))
    return headers
