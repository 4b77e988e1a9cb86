"""Per-tenant admission: requests/min, tokens/min, concurrency, prompt and output caps.

Two interchangeable backends behind one :class:`Admission` interface:

* :class:`LocalAdmission` keeps token buckets in process (one gateway replica);
* :class:`RedisAdmission` keeps them in Redis with one Lua script per decision, so
  several replicas share exact limits. The script reads Redis' own clock (``TIME``)
  so replica clocks never disagree about refills.

Model: requests/min and tokens/min are token buckets of capacity ``limit`` refilled
at ``limit / 60`` per second. A request takes 1 request token at admission and
*reserves* its prompt tokens plus the output limit it runs with (``max_output_tokens``:
its ``max_tokens``, or the tenant's output limit when it names none, from the limits it is
decided under: ``fresh_admission.admit``); it is admitted only if the bucket holds that whole
reservation. When it ends (answered, failed, or its client gone) the part of the output it
did not generate goes back to the bucket, exactly once; tokens generated past the
reservation (an engine that overran ``max_tokens``) are charged in full, so the bucket may
go negative, without a floor: a debt is paid back by refill alone. A request admitted but
never served (:meth:`Admission.release_unserved`: decided again under limits lowered
meanwhile, its key found revoked, a failure before its engine call) gives back all it took,
exactly once: its request token, its prompt and its output reservation. A release only adds
that amount to the bucket's level as it stood at the bucket's last decision: it never
refills, caps or re-stamps the bucket, so refill and cap are left to the next decision,
under the limits in force then (a limit raised while a request ran binds from that decision
on, not a minute later). A give-back credited as of that last decision (made at or after
the lease's own) is the same as one made then, capped at the capacity: it never adds tokens
the bucket could not have held. So whatever the concurrency, the prompt and completion
tokens served within any window never exceed the capacity plus that window's refill. A
reservation larger than the capacity can never be admitted: refused at once with 429
``rate_limit_exceeded`` ("Request too large", as OpenAI answers), naming ``max_tokens`` so
the client knows what to lower. Concurrency is a set of leases (Redis: a sorted set
scored by expiry, so a crashed replica's leases lapse). Limits are positive or ``None``
(unlimited): a :class:`Limits` with one below 1 is refused when built.

Refund exactly once (Redis): the acquire that takes from a bucket also stores what it took
(the prompt and output reservation, and whether it took a request token) under a key of its
own (``...:res:<lease id>``, lapsing with the lease and renewed by the same heartbeat); a
release gives back only by deleting that key. So a release sent twice (its first answer lost,
then retried) gives back once, and the owed release of an acquire Redis never stored (its
answer lost while Redis went away) gives back nothing; that of an acquire Redis stored but
whose answer never arrived (the request cancelled meanwhile) gives back all it took. Each
script reads Redis' clock and never refills by a negative time: a clock stepped back (an NTP
step, a failover to a replica behind) refills nothing until it catches up, and drains nothing.

Lease renewal (Redis): a lease is granted for ``lease_ttl_s`` (default
``LEASE_TTL_SECONDS``, 30 s) and renewed every ``lease_ttl_s / 3`` while its request is
live (one heartbeat per gateway moves every live lease's expiry to Redis' now +
``lease_ttl_s``). So a request may run for any length of time, and a SIGKILLed gateway's
slots return at most ``lease_ttl_s`` after its last heartbeat (the next decision on that
tenant drops expired leases). Renewal only moves leases that exist (``ZADD XX``): a lease
released meanwhile is never brought back. A Redis outage longer than ``lease_ttl_s``
minus one renewal interval can let live leases lapse (they are not re-added; until the
requests end the tenant may be admitted above its limit once Redis is back); that is the
trade-off for a short bound on a dead gateway's slots.

Rate-limit figures: each decision also reports the request and token buckets as it leaves them
(:class:`RateLevels` on the :class:`Lease`, or on the 429's :class:`AdmissionError`): after this
request's own take when granted, untouched when refused; read under the lock (local) or returned
by the same script call (Redis: no second round trip). The gateway sends them as OpenAI's
``x-ratelimit-*`` or Anthropic's ``anthropic-ratelimit-*`` headers (``server.gateway.rate_headers``:
one builder per dialect): remaining is the level rounded down, 0 for a debt; reset is when
the bucket would be full again with no further take. A tenant with neither rpm nor tpm gets no
figures (``rate`` None) and its answers no such header; a refusal decided before any bucket is
read (over a size cap, request too large, Redis away) has none either.

Invariants: a refused request changes no bucket; every granted :class:`Lease` is
released exactly once (``release`` and ``release_unserved`` are idempotent, and the first of
them settles it).

Redis away (connection refused or reset, or no answer within ``REDIS_TIMEOUT_S``): admission
*fails closed*. ``acquire`` refuses with 503 ``admission_unavailable`` (``Retry-After: 1``),
so no gateway admits anything it cannot count across the fleet and per-tenant concurrency
at the engines never exceeds the limit in force; requests already admitted run to their
end. A ``release`` that cannot reach Redis is kept and retried before the next decision
(and by :meth:`RedisAdmission.retry_releases`), so the slot is given back once Redis
returns instead of lapsing only after ``LEASE_TTL_SECONDS``. Why not degrade to per-gateway
shares: a gateway does not know how many peers are alive or what they hold, so any local
share is either unsafe (peers double-admit) or a guess; 5xx for seconds is the honest answer,
and the clients' retry handles it.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_MAX_OUTPUT_TOKENS = 256  # a request naming no output limit, of a tenant without max_output_tokens
LEASE_TTL_SECONDS = 30.0  # a lease not renewed for this long lapses (its gateway died)
REDIS_TIMEOUT_S = 2.0  # connect and per-command: a Redis that does not answer counts as away


@dataclass(frozen=True, slots=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        # None is unlimited; 0 would mean something else on each backend (the registry refuses it too).
        for name, value in (("requests_per_minute", self.requests_per_minute),
                            ("tokens_per_minute", self.tokens_per_minute), ("max_concurrent", self.max_concurrent),
                            ("max_prompt_tokens", self.max_prompt_tokens),
                            ("max_output_tokens", self.max_output_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or None: unlimited), got {value}")

    @property
    def default_output_tokens(self) -> int:
        """The output limit of a request that names none: the tenant's ``max_output_tokens``."""
        return self.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS

    def lowers(self, before: Limits) -> bool:
        """Whether any of these limits is lower than in ``before`` (None: unlimited)."""
        return any(new is not None and (old is None or new < old) for new, old in (
            (self.requests_per_minute, before.requests_per_minute), (self.tokens_per_minute, before.tokens_per_minute),
            (self.max_concurrent, before.max_concurrent), (self.max_prompt_tokens, before.max_prompt_tokens),
            (self.max_output_tokens, before.max_output_tokens)))


class AdmissionError(Exception):
    """Refused admission. ``status`` 429 (retry later, after ``retry_after``; or, not
    ``admissible``, a request too large for tokens_per_minute, never admitted as sent), 400 (over
    a size cap, never admissible) or 503 (admission's store away)."""

    def __init__(self, message: str, *, limit: str, status: int, retry_after: float | None = None,
                 code: str | None = None, admissible: bool = True, rate: RateLevels | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.status = status
        self.retry_after = retry_after
        self.code = code  # the OpenAI error code, when not the status' default
        self.admissible = admissible  # False: no wait makes it pass (no Retry-After, not rate limiting)
        self.rate = rate  # the buckets as the refusing decision saw them (a 429 of a tenant with rpm or tpm)


@dataclass(slots=True)  # not frozen: built on every limited request, and a frozen init costs ~3x
class RateLevels:
    """A tenant's request and token buckets right after one admission decision, read by that
    decision itself (under the lock; returned by the Redis script): after this request's own
    take when granted, untouched when refused. What the rate-limit response headers report
    (``server.gateway.rate_headers``). A limit None (unlimited) has
    no level. A level may be negative (a debt): reported as 0 remaining, and its reset is later
    than a minute. ``decided_at``: this process' ``time.monotonic()`` when the decision was in
    hand, so a reset sent later (a non-streamed answer, after its generation) counts from it."""

    requests_limit: int | None
    requests_level: float
    tokens_limit: int | None
    tokens_level: float
    decided_at: float


def _levels(rpm: int | None, requests: float, tpm: int | None, tokens: float) -> RateLevels | None:
    """None for a tenant with neither rate limit: the hot path then builds no headers."""
    if rpm is None and tpm is None:
        return None
    return RateLevels(rpm, requests, tpm, tokens, time.monotonic())


def check_sizes(limits: Limits, *, prompt_tokens: int, max_output_tokens: int) -> None:
    """Refuse requests that can never be admitted under ``limits``: over a size cap (400), or
    reserving more than the tokens per minute allow (429 ``rate_limit_exceeded`` without
    ``retry_after``, OpenAI's "Request too large"; counted as ``request_too_large``, not as
    rate limiting)."""
    if limits.max_prompt_tokens is not None and prompt_tokens > limits.max_prompt_tokens:
        raise AdmissionError(
            f"prompt has {prompt_tokens} tokens; this tenant's max_prompt_tokens is {limits.max_prompt_tokens}",
            limit="max_prompt_tokens", status=400,
        )
    if limits.max_output_tokens is not None and max_output_tokens > limits.max_output_tokens:
        raise AdmissionError(
            f"{max_output_tokens} output tokens asked for; this tenant's max_output_tokens is {limits.max_output_tokens}",
            limit="max_output_tokens", status=400,
        )
    tpm = limits.tokens_per_minute
    if tpm is not None and prompt_tokens + max_output_tokens > tpm:
        # OpenAI's wording for a request over a per-minute token limit ("Request too large ...
        # Limit X, Requested Y"), 429 rate_limit_exceeded; but it can never pass: what to lower.
        default = (" (the tenant's max_output_tokens, reserved when a request names no max_tokens)"
                   if max_output_tokens == limits.max_output_tokens else "")
        fix = ("the prompt alone reaches the limit: shorten it" if prompt_tokens >= tpm else
               f"lower max_tokens (max_output_tokens on the Responses API) to at most {tpm - prompt_tokens}, "
               "or shorten the prompt")
        raise AdmissionError(
            f"Request too large for this tenant's tokens_per_minute: Limit {tpm}, Requested "
            f"{prompt_tokens + max_output_tokens} (prompt {prompt_tokens} + max_tokens {max_output_tokens}{default}). "
            f"A request reserves its prompt and max_tokens at admission, so this one can never be admitted; {fix}.",
            limit="tokens_per_minute", status=429, code="rate_limit_exceeded", admissible=False,
        )


def _tpm_refusal(tpm: int, reserved: int, retry_after: float, rate: RateLevels | None) -> AdmissionError:
    return AdmissionError(
        f"tokens_per_minute limit of {tpm} reached (this request reserves {reserved}: its prompt and max_tokens)",
        limit="tokens_per_minute", status=429, retry_after=retry_after, rate=rate,
    )


@dataclass(slots=True)
class Lease:
    tenant: str
    lease_id: str
    tokens_per_minute: int | None
    released: bool = False
    output_reserved: int = 0  # output tokens taken from the token bucket at admission (refunded unused)
    prompt_reserved: int = 0  # prompt tokens taken from the token bucket (given back only if never served)
    request_taken: bool = False  # a request token taken (given back only if never served)
    max_output_tokens: int = 0  # the output limit the request was admitted with
    rate: RateLevels | None = None  # the buckets right after its decision (None: no rpm nor tpm limit)


class Admission(Protocol):
    async def acquire(self, tenant: str, limits: Limits, *, prompt_tokens: int, max_output_tokens: int) -> Lease: ...

    async def release(self, lease: Lease, *, completion_tokens: int) -> None:
        """The request ended: the unused output reservation back, tokens past it charged."""
        ...

    async def release_unserved(self, lease: Lease) -> None:
        """The request was never served: its request token, prompt and output reservation back."""
        ...

    async def close(self) -> None: ...


# In-process ----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Bucket:
    level: float
    updated: float

    def refill(self, capacity: int, now: float) -> None:
        rate = capacity / 60.0
        self.level = min(float(capacity), self.level + (now - self.updated) * rate)
        self.updated = now

    def deficit_seconds(self, capacity: int, amount: float) -> float:
        return max(0.0, (amount - self.level) / (capacity / 60.0))


@dataclass(slots=True)
class _TenantState:
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    leases: set[str] = field(default_factory=set)


class LocalAdmission:
    """Token buckets in this process. Decisions are atomic under one asyncio lock."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}
        self._lock = asyncio.Lock()

    async def acquire(self, tenant: str, limits: Limits, *, prompt_tokens: int, max_output_tokens: int) -> Lease:
        check_sizes(limits, prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens)
        async with self._lock:
            now = self._clock()
            state = self._tenants.setdefault(tenant, _TenantState())
            rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
            if rpm is not None:
                state.requests = state.requests or _Bucket(float(rpm), now)
                state.requests.refill(rpm, now)
            if tpm is not None:
                state.tokens = state.tokens or _Bucket(float(tpm), now)
                state.tokens.refill(tpm, now)
            if limits.max_concurrent is not None and len(state.leases) >= limits.max_concurrent:
                raise AdmissionError(
                    f"tenant has {len(state.leases)} requests in flight; max_concurrent is {limits.max_concurrent}",
                    limit="max_concurrent", status=429, retry_after=1.0, rate=self._levels(rpm, tpm, state),
                )
            if rpm is not None and state.requests is not None and state.requests.level < 1.0:
                raise AdmissionError(
                    f"requests_per_minute limit of {rpm} reached", limit="requests_per_minute", status=429,
                    retry_after=state.requests.deficit_seconds(rpm, 1.0), rate=self._levels(rpm, tpm, state),
                )
            reserved = prompt_tokens + max_output_tokens
            if tpm is not None and state.tokens is not None and state.tokens.level < reserved:
                raise _tpm_refusal(tpm, reserved, state.tokens.deficit_seconds(tpm, reserved),
                                   self._levels(rpm, tpm, state))
            if state.requests is not None:
                state.requests.level -= 1.0
            if tpm is not None and state.tokens is not None:
                state.tokens.level -= reserved
            lease = Lease(tenant, secrets.token_hex(8), tpm, max_output_tokens=max_output_tokens,
                          output_reserved=max_output_tokens if tpm is not None else 0,
                          prompt_reserved=prompt_tokens if tpm is not None else 0, request_taken=rpm is not None,
                          rate=self._levels(rpm, tpm, state))
            state.leases.add(lease.lease_id)
            return lease

    @staticmethod
    def _levels(rpm: int | None, tpm: int | None, state: _TenantState) -> RateLevels | None:
        """The levels as this decision leaves them (called under the lock, after its take)."""
        if rpm is None and tpm is None:
            return None
        return _levels(rpm, state.requests.level if rpm is not None and state.requests is not None else 0.0,
                       tpm, state.tokens.level if tpm is not None and state.tokens is not None else 0.0)

    async def release(self, lease: Lease, *, completion_tokens: int) -> None:
        # The unused reservation back, or the overrun charged (no floor).
        await self._settle(lease, tokens=lease.output_reserved - completion_tokens, requests=0)

    async def release_unserved(self, lease: Lease) -> None:
        await self._settle(lease, tokens=lease.prompt_reserved + lease.output_reserved,
                           requests=int(lease.request_taken))

    async def _settle(self, lease: Lease, *, tokens: int, requests: int) -> None:
        """Added to the levels as they stood at the buckets' last decision: no refill, no cap, no
        new stamp (the next decision refills and caps under the limits in force then)."""
        if lease.released:
            return
        lease.released = True
        async with self._lock:
            state = self._tenants.get(lease.tenant)
            if state is None:
                return
            state.leases.discard(lease.lease_id)
            if state.tokens is not None and lease.tokens_per_minute is not None:
                state.tokens.level += tokens
            if state.requests is not None and requests:
                state.requests.level += requests

    async def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return 0 if state is None else len(state.leases)

    async def close(self) -> None:
        return None


# Redis ---------------------------------------------------------------------------------------
# KEYS: 1 request bucket, 2 token bucket, 3 lease zset, 4 the lease's reservation record
# ARGV: 1 rpm (0 = none), 2 tpm (0 = none), 3 max_concurrent (0 = none), 4 prompt tokens, 5 lease id, 6 lease ttl,
#       7 output tokens reserved
# Returns {0, 0, r, k} granted, or {code, retry_after_ms, r, k}: 1 concurrency, 2 rpm, 3 tpm; r and k are the
# request and token buckets' levels as this decision leaves them (after its take when granted), in thousandths
# (a Lua number comes back truncated to an integer), 0 for a limit not set: the rate-limit headers, read in the
# same atomic decision. The record holds what was taken from the buckets (prompt and output tokens, 1 if a
# request token), for release to give back.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local output = tonumber(ARGV[7])
local reserve = tonumber(ARGV[4]) + output  -- prompt + output limit
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'ts')
  local lvl, ts = tonumber(v[1]), tonumber(v[2])
  if lvl == nil then return cap end
  return math.min(cap, lvl + math.max(0, now - ts) * cap / 60.0)  -- a clock stepped back refills nothing
end
local r, k = 0, 0
if rpm > 0 then r = level(KEYS[1], rpm) end
if tpm > 0 then k = level(KEYS[2], tpm) end
local function refused(code, ms) return {code, ms, math.floor(r * 1000), math.floor(k * 1000)} end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then return refused(1, 1000) end
end
if rpm > 0 and r < 1 then return refused(2, math.ceil((1 - r) / (rpm / 60.0) * 1000)) end
if tpm > 0 and k < reserve then return refused(3, math.ceil((reserve - k) / (tpm / 60.0) * 1000)) end
if rpm > 0 then
  redis.call('HSET', KEYS[1], 'level', r - 1, 'ts', now)
  redis.call('EXPIRE', KEYS[1], 120)
end
if tpm > 0 then
  redis.call('HSET', KEYS[2], 'level', k - reserve, 'ts', now)
  redis.call('EXPIRE', KEYS[2], 120)
end
if rpm > 0 or tpm > 0 then
  redis.call('HSET', KEYS[4], 'prompt', tpm > 0 and tonumber(ARGV[4]) or 0, 'output', tpm > 0 and output or 0,
             'request', rpm > 0 and 1 or 0)
  redis.call('PEXPIRE', KEYS[4], math.ceil(tonumber(ARGV[6]) * 1000))
end
if conc > 0 then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[5])
  redis.call('EXPIRE', KEYS[3], math.ceil(tonumber(ARGV[6])))
end
if rpm > 0 then r = r - 1 end
if tpm > 0 then k = k - reserve end
return {0, 0, math.floor(r * 1000), math.floor(k * 1000)}
"""

# KEYS: 1 request bucket, 2 token bucket, 3 lease zset, 4 the lease's reservation record
# ARGV: 1 tpm the lease was admitted under (0 = none), 2 completion tokens, 3 lease id, 4 served (1) or never (0)
# Settles the reservation only if its record is still there (deleted here: once). No record: a
# release sent again, an acquire Redis never stored, or a lease lapsed (its gateway silent past
# the TTL): nothing to give back. Served: the output it did not use back (or the overrun charged);
# never served: all the record holds. Added to the level as of the bucket's last decision (no
# refill, cap or new stamp: the next decision does that under the limits in force then). A bucket
# gone has refilled to full and lapsed: nothing to add; an overrun is charged from full, now.
# Returns 1 when it settled a reservation.
_RELEASE = """
redis.call('ZREM', KEYS[3], ARGV[3])
local held = redis.call('HMGET', KEYS[4], 'prompt', 'output', 'request')
if not held[2] then return 0 end
redis.call('DEL', KEYS[4])
local tpm = tonumber(ARGV[1])
local tokens, requests = tonumber(held[2]) - tonumber(ARGV[2]), 0
if ARGV[4] == '0' then tokens, requests = tonumber(held[1]) + tonumber(held[2]), tonumber(held[3]) end
if requests > 0 then
  local r = tonumber(redis.call('HGET', KEYS[1], 'level'))
  if r ~= nil then redis.call('HSET', KEYS[1], 'level', r + requests) end
end
if tpm > 0 and tokens ~= 0 then
  local lvl = tonumber(redis.call('HGET', KEYS[2], 'level'))
  if lvl ~= nil then
    lvl = lvl + tokens
    redis.call('HSET', KEYS[2], 'level', lvl)
  elseif tokens < 0 then
    local t = redis.call('TIME')
    lvl = tpm + tokens
    redis.call('HSET', KEYS[2], 'level', lvl, 'ts', tonumber(t[1]) + tonumber(t[2]) / 1e6)
  end
  -- kept until it has refilled to full (a debt outlives the usual two minutes)
  if lvl ~= nil then redis.call('EXPIRE', KEYS[2], 120 + math.ceil(math.max(0, -lvl) * 60.0 / tpm)) end
end
return 1
"""

# KEYS: 1 lease zset, 2.. the leases' reservation records (same order as the ids); ARGV: 1 lease ttl,
# 2.. lease ids. Moves the expiry of the ids still in the set to now + ttl (XX: a released lease is
# never re-added) and of the records still there (PEXPIRE never creates one); returns how many
# leases were renewed.
_RENEW = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
local renewed = 0
for i = 2, #ARGV do
  renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i])
  redis.call('PEXPIRE', KEYS[i], math.ceil(tonumber(ARGV[1]) * 1000))
end
if redis.call('ZCARD', KEYS[1]) > 0 then redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1]))) end
return renewed
"""

_CODES = {1: "max_concurrent", 2: "requests_per_minute", 3: "tokens_per_minute"}


class RedisAdmission:
    """Shared limits across gateway replicas; one round trip per decision.

    Invariant: every lease this gateway holds in Redis is in ``_live`` until its release is
    sent (or owed), and :meth:`renew_leases` (the heartbeat, every ``lease_ttl_s / 3``)
    keeps each of them at most ``lease_ttl_s`` from expiry while Redis answers."""

    def __init__(self, url: str, *, namespace: str = "kvgate", lease_ttl_s: float = LEASE_TTL_SECONDS) -> None:
        import redis.asyncio as redis_asyncio
        from redis.exceptions import RedisError

        self._redis = redis_asyncio.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S,
                                             socket_timeout=REDIS_TIMEOUT_S)
        self._ns = namespace
        self.lease_ttl_s = lease_ttl_s
        self._live: dict[str, Lease] = {}  # lease id -> granted and not yet released: renewed by the heartbeat
        # releases Redis did not take yet: (lease, completion tokens), None for a lease never served
        self._unreleased: list[tuple[Lease, int | None]] = []
        self._down = (RedisError, OSError, asyncio.TimeoutError)  # what "Redis is away" looks like
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._release = self._redis.register_script(_RELEASE)
        self._renew = self._redis.register_script(_RENEW)

    @property
    def renew_every_s(self) -> float:
        """Heartbeat period: a third of the TTL, so two missed beats still leave the lease alive."""
        return self.lease_ttl_s / 3

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self._ns}:adm:{{{tenant}}}"  # hash tag: one slot per tenant in Redis Cluster
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:leases"]

    def _reservation_key(self, tenant: str, lease_id: str) -> str:
        return f"{self._ns}:adm:{{{tenant}}}:res:{lease_id}"

    async def acquire(self, tenant: str, limits: Limits, *, prompt_tokens: int, max_output_tokens: int) -> Lease:
        check_sizes(limits, prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens)
        tpm = limits.tokens_per_minute
        lease = Lease(tenant, secrets.token_hex(8), tpm, output_reserved=max_output_tokens if tpm is not None else 0,
                      prompt_reserved=prompt_tokens if tpm is not None else 0,
                      request_taken=limits.requests_per_minute is not None, max_output_tokens=max_output_tokens)
        try:
            await self.retry_releases()  # slots owed back first: a decision must see them free
            code, retry_ms, requests_milli, tokens_milli = await self._acquire(
                keys=[*self._keys(tenant), self._reservation_key(tenant, lease.lease_id)],
                args=[limits.requests_per_minute or 0, tpm or 0, limits.max_concurrent or 0,
                      prompt_tokens, lease.lease_id, self.lease_ttl_s, lease.output_reserved],
            )
        except asyncio.CancelledError:
            # The request went away while Redis decided: what it may have granted is given back, whole
            # (the release is idempotent, and gives back only what a record Redis stored says).
            self._unreleased.append((lease, None))
            raise
        except self._down as exc:
            # Fail closed: a lease Redis may or may not have stored is released later (ZREM is idempotent).
            self._unreleased.append((lease, None))
            raise AdmissionError("admission is unavailable (its store cannot be reached); retry shortly",
                                 limit="admission", status=503, retry_after=1.0,
                                 code="admission_unavailable") from exc
        if tpm is not None or limits.requests_per_minute is not None:  # else no figures (the usual bench tenant)
            lease.rate = RateLevels(limits.requests_per_minute, int(requests_milli) / 1000.0, tpm,
                                    int(tokens_milli) / 1000.0, time.monotonic())
        if int(code) != 0:
            name = _CODES[int(code)]
            retry_after = max(0.001, int(retry_ms) / 1000.0)
            if name == "tokens_per_minute":
                raise _tpm_refusal(tpm or 0, prompt_tokens + lease.output_reserved, retry_after, lease.rate)
            raise AdmissionError(f"{name} limit of {getattr(limits, name)} reached", limit=name, status=429,
                                 retry_after=retry_after, rate=lease.rate)
        self._live[lease.lease_id] = lease
        return lease

    async def release(self, lease: Lease, *, completion_tokens: int) -> None:
        await self._settle(lease, completion_tokens)

    async def release_unserved(self, lease: Lease) -> None:
        await self._settle(lease, None)

    async def _settle(self, lease: Lease, completion_tokens: int | None) -> None:
        if lease.released:
            return
        lease.released = True
        self._live.pop(lease.lease_id, None)
        try:
            await self._send_release(lease, completion_tokens)
        except self._down:
            self._unreleased.append((lease, completion_tokens))  # given back when Redis answers again

    async def _send_release(self, lease: Lease, completion_tokens: int | None) -> None:
        """``completion_tokens`` None: the request was never served."""
        await self._release(keys=[*self._keys(lease.tenant), self._reservation_key(lease.tenant, lease.lease_id)],
                            args=[lease.tokens_per_minute or 0, completion_tokens or 0, lease.lease_id,
                                  0 if completion_tokens is None else 1])

    async def retry_releases(self) -> int:
        """Send the releases Redis missed; raises (keeping the unsent ones) if it is still away.

        Why the swap: several requests may call this at once; each owed release is taken
        by exactly one of them."""
        owed, self._unreleased = self._unreleased, []
        sent = 0
        try:
            for lease, completion_tokens in owed:
                await self._send_release(lease, completion_tokens)
                sent += 1
        except BaseException:
            self._unreleased[:0] = owed[sent:]
            raise
        return sent

    async def renew_leases(self) -> int:
        """The heartbeat: move every live lease's expiry to now + ``lease_ttl_s`` (one script
        call per tenant). Returns how many Redis renewed; raises if Redis is away."""
        by_tenant: dict[str, list[str]] = {}
        for lease in list(self._live.values()):
            by_tenant.setdefault(lease.tenant, []).append(lease.lease_id)
        renewed = 0
        for tenant, ids in by_tenant.items():
            records = [self._reservation_key(tenant, lease_id) for lease_id in ids]
            renewed += int(await self._renew(keys=[self._keys(tenant)[2], *records], args=[self.lease_ttl_s, *ids]))
        return renewed

    @property
    def live_leases(self) -> int:
        return len(self._live)

    @property
    def owed_releases(self) -> int:
        return len(self._unreleased)

    async def in_flight(self, tenant: str) -> int:
        return int(await self._redis.zcard(self._keys(tenant)[2]))

    async def close(self) -> None:
        await self._redis.aclose()


def retry_after_header(error: AdmissionError) -> str:
    return str(max(1, math.ceil(error.retry_after or 1.0)))
