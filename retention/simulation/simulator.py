"""Trace replay through the real pool and planner: hit rates per tier and tenant, traffic, Belady.

For each (capacity, policy) the simulator builds a :class:`BlockPool` with the policy's
shape and replays the trace in timestamp order (``now`` = the request's timestamp):

``--hold none`` (default, the classic cache model)::

    allocate(prompt) ─► release(prompt)          one request at a time; hit = cached prefix

``--hold tokens`` (concurrency competes for capacity)::

    arrival ─► wait (FIFO) ─► allocate(prompt + output reserve) ─► prefill for
        (prompt − cached) / prefill_tps seconds ─► store the prompt's blocks (reusable from now,
        as TensorRT-LLM's storeContextBlocks) ─► decode for output / decode_tps ─► release

A request that cannot fit even into an idle pool is rejected (counted, all its tokens
recomputed). Only prompt tokens are cached: Mooncake hash ids describe prompts, so
generated tokens are modelled as capacity only (``reserve_tokens``), never as reusable.

Reported per policy: token hit rate split by the tier the hit came from (GPU / host,
onboarded), recomputed prefill tokens, offloaded / onboarded / evicted blocks, a
per-tenant table; plus Belady's optimum (``retention/simulation/belady.py``) at the GPU capacity
and, when a host tier exists, at GPU + host capacity, and the most an age-based policy could
reach on the GPU (``retention/simulation/hit_density.py``, capped by Belady).

Deletions (``delete_response`` events, ``retention/trace.py``) are delivered in timestamp order,
before any request at the same or a later time, to a policy that has ``on_delete`` (e.g.
``+conv``): to the policy, never straight to the pool, since TensorRT-LLM cannot revoke a
retention it was given at enqueue. A policy that answers a delete with *demote requests*
(``demote_request``, ``+conv+demote``: one per orphaned leaf, as the gateway sends them) has them
replayed through the pool at the delete's time,
as the engine would see it (allocate the prompt with the demote plan, release it): counted
apart (``demote_requests``, ``demote_computed_tokens``), never in the hit rate. A policy with
``completion_demote`` may answer a request's release the same way (``+conv+end``: a tool
loop's run that ended in a message).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from retention.hashing import block_hashes
from retention.policy.demote import demote_length, demote_priority
from retention.pool import BlockPool, PoolConfig
from retention.simulation.belady import BeladyResult, ChainRequest, belady, chain_request
from retention.simulation.hit_density import AgeHulls
from retention.simulation.sim_policies import SimPolicy
from retention.trace import ResponseDeletion, TraceRequest, request_tokens

Hold = Literal["none", "tokens"]
Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class SimConfig:
    tokens_per_block: int = 512  # pool block size
    trace_block_size: int = 512  # tokens per hash id in the trace
    hold: Hold = "none"
    prefill_tokens_per_s: float = 8_000.0
    decode_tokens_per_s: float = 40.0
    salted: bool = False  # salt every request with its tenant (isolation "salted")

    def __post_init__(self) -> None:
        if self.hold not in ("none", "tokens"):
            raise ValueError(f"hold must be 'none' or 'tokens', got {self.hold!r}")
        if self.tokens_per_block < 1 or self.trace_block_size < 1:
            raise ValueError("block sizes must be >= 1")
        # Written so NaN fails too (every comparison with NaN is False).
        for name, rate in (("prefill", self.prefill_tokens_per_s), ("decode", self.decode_tokens_per_s)):
            if not 0 < rate < float("inf"):
                raise ValueError(f"{name} token rate must be a finite number > 0, got {rate}")


@dataclass(slots=True)
class TenantResult:
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return (self.gpu_hit_tokens + self.host_hit_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class PolicyResult:
    policy: str
    primary_blocks: int
    secondary_blocks: int
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    host_hit_tokens: int = 0
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    evicted_primary_blocks: int = 0
    evicted_secondary_blocks: int = 0
    delayed_requests: int = 0
    total_wait_s: float = 0.0
    demote_requests: int = 0  # demote requests replayed (never in the hit rate)
    demote_computed_tokens: int = 0  # their prompt tokens not found cached (prefilled again)
    demote_skipped: int = 0  # demote requests that found no room
    demote_uncached: int = 0  # deletes whose own range was no longer cached (no request sent)
    tenants: dict[str, TenantResult] = field(default_factory=dict)

    @property
    def hit_tokens(self) -> int:
        return self.gpu_hit_tokens + self.host_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_hit_rate(self) -> float:
        return self.gpu_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def recomputed_prefill_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    def to_dict(self) -> dict:
        data = asdict(self)
        data["tenants"] = {
            name: {**asdict(t), "hit_rate": t.hit_rate} for name, t in sorted(self.tenants.items())
        }
        data.update(
            hit_rate=self.hit_rate, gpu_hit_rate=self.gpu_hit_rate, host_hit_rate=self.host_hit_rate,
            recomputed_prefill_tokens=self.recomputed_prefill_tokens,
        )
        return data


def _salt(request: TraceRequest, config: SimConfig) -> str | None:
    return request.tenant if config.salted else None


def request_hashes(requests: Sequence[TraceRequest], config: SimConfig) -> list[list[int]]:
    """Chained hashes of every request's full pool blocks (the pool's own hash function)."""
    return [
        block_hashes(request_tokens(r, config.trace_block_size), config.tokens_per_block, salt=_salt(r, config))
        for r in requests
    ]


# Prompts keeps a trace's synthetic tokens only up to this many (int32: 256 MB); past it they are
# made again at each admission attempt, and only the (small) hashes are kept.
KEEP_PROMPT_TOKENS = 1 << 26


class Prompts:
    """Every request's pool block hashes (and, for a trace that is not too long, its synthetic
    prompt), made once and kept for a whole replay.

    For a request ``r`` it was built with, ``get(r)`` is ``(request_tokens(r, trace_block_size),
    block_hashes(those tokens, tokens_per_block, salt=r's salt))``: exactly what the pool would
    compute itself, so a pool handed both (``admit_request``) hashes nothing. Worth it because a
    request waiting for room (``--hold tokens``) is retried after every completion on its pool,
    and every replay of one trace (``compare_routers``: the ceiling and each router) needs the
    same prompts. The tokens are kept when the trace's prompts total at most
    ``KEEP_PROMPT_TOKENS`` tokens, else made again on each ``get``. A request it was not built
    with (not the same object) is made afresh, never looked up by its index alone.
    """

    __slots__ = ("_config", "_made")

    def __init__(self, requests: Sequence[TraceRequest], config: SimConfig) -> None:
        self._config = config
        keep = sum(r.input_length for r in requests) <= KEEP_PROMPT_TOKENS
        self._made: dict[int, tuple[TraceRequest, np.ndarray | None, list[int]]] = {}
        for request in requests:
            tokens, hashes = self._make(request)
            self._made[request.index] = (request, tokens if keep else None, hashes)

    def _make(self, request: TraceRequest) -> tuple[np.ndarray, list[int]]:
        config = self._config
        tokens = request_tokens(request, config.trace_block_size)
        return tokens, block_hashes(tokens, config.tokens_per_block, salt=_salt(request, config))

    def _kept(self, request: TraceRequest) -> tuple[TraceRequest, np.ndarray | None, list[int]] | None:
        made = self._made.get(request.index)
        return made if made is not None and made[0] is request else None

    def get(self, request: TraceRequest) -> tuple[np.ndarray, list[int]]:
        """``request``'s prompt tokens (int32) and the hashes of its full pool blocks."""
        made = self._kept(request)
        if made is None:
            return self._make(request)
        tokens = made[1]
        return (request_tokens(request, self._config.trace_block_size) if tokens is None else tokens), made[2]

    def hashes(self, requests: Sequence[TraceRequest]) -> list[list[int]]:
        """The block hashes of ``requests`` in order: ``request_hashes(requests, config)``."""
        return [self._make(r)[1] if (made := self._kept(r)) is None else made[2] for r in requests]


def record_outcome(target: TenantResult | PolicyResult, prompt_tokens: int, reused: int, onboarded: int,
                   rejected: bool, tokens_per_block: int) -> None:
    """Count one request in ``target``: rejected, or its reused blocks split into GPU and host hits."""
    target.requests += 1
    target.prompt_tokens += prompt_tokens
    if rejected:
        target.rejected += 1
    else:
        target.gpu_hit_tokens += (reused - onboarded) * tokens_per_block
        target.host_hit_tokens += onboarded * tokens_per_block


def admit_request(pool: BlockPool, policy: SimPolicy, request: TraceRequest, h: Sequence[int], config: SimConfig,
                  now: float, reserve: int,
                  prompts: Prompts | None = None):  # noqa: ANN201 - (tokens, Allocation | None)
    """Plan and allocate one request in ``pool``; the policy observes it when admitted.

    ``h`` are the hashes the policy sees; the pool gets the prompt and its own hashes from
    ``prompts`` (made afresh without it).
    """
    tokens, hashes = (Prompts((), config) if prompts is None else prompts).get(request)
    plan = policy.plan(request, h, now=now, pool=pool)
    alloc = pool.allocate(
        request.index, tokens, salt=_salt(request, config), tenant=request.tenant, plan=plan, now=now,
        reserve_tokens=reserve, hashes=hashes,
    )
    if alloc is not None:
        policy.observe(request, h, alloc, now=now, pool=pool)
    return tokens, alloc


def simulate(
    requests: Sequence[TraceRequest],
    policy: SimPolicy,
    *,
    primary_blocks: int,
    secondary_blocks: int,
    config: SimConfig = SimConfig(),
    hashes: Sequence[list[int]] | None = None,
    progress: Progress | None = None,
    deletions: Sequence[ResponseDeletion] = (),
    prompts: Prompts | None = None,
) -> PolicyResult:
    """Replay ``requests`` (and ``deletions``, to the policy) through a fresh pool shaped for ``policy``.

    ``hashes``: what the policy sees (default: the requests' block hashes); ``prompts``: the
    requests' prompts, shared by replays of the same trace (default: made here).
    """
    secondary = secondary_blocks if policy.uses_host else 0
    pool = BlockPool(
        PoolConfig(
            primary_blocks=primary_blocks, secondary_blocks=secondary, tokens_per_block=config.tokens_per_block,
            secondary_offload_min_priority=policy.offload_min_priority, event_buffer_max_size=0,
        )
    )
    result = PolicyResult(policy.name, primary_blocks, secondary)
    bpt = config.tokens_per_block
    no_hashes: list[int] = []
    if prompts is None:
        prompts = Prompts(requests, config)
    if hashes is None:
        hashes = prompts.hashes(requests)

    def account(request: TraceRequest, reused: int, onboarded: int, rejected: bool) -> None:
        if rejected:  # policies learn from every request, served or not
            policy.observe(request, hashes[request.index], None, now=request.timestamp_ms / 1000.0, pool=pool)
        tenant = result.tenants.setdefault(request.tenant or "-", TenantResult())
        for target in (result, tenant):
            record_outcome(target, request.input_length, reused, onboarded, rejected, bpt)

    def try_admit(request: TraceRequest, now: float, reserve: int):
        h = hashes[request.index] if request.index < len(hashes) else no_hashes
        return admit_request(pool, policy, request, h, config, now, reserve, prompts)

    deliver = _deliverer(policy, deletions, pool, config, result)
    completion_demote = getattr(policy, "completion_demote", None)
    demote_at = demote_priority(pool.config.secondary_blocks, pool.config.secondary_offload_min_priority)

    def completed(request: TraceRequest, now: float) -> None:
        """The request is released: a policy may answer its completion with a demote request."""
        demote = None if completion_demote is None else completion_demote(
            request, now=now, tokens_per_block=config.tokens_per_block, priority=demote_at)
        if demote is not None:
            _replay_demote(pool, demote[0], demote[1], config, result, ("end", request.index), now)

    done = 0
    if config.hold == "none":
        for request in requests:
            now = request.timestamp_ms / 1000.0
            deliver(now)
            tokens, alloc = try_admit(request, now, 0)
            if alloc is None:
                account(request, 0, 0, True)
            else:
                account(request, alloc.reused_blocks, alloc.onboarded_blocks, False)
                pool.release(request.index, tokens, now=now, num_computed_tokens=len(tokens))
                completed(request, now)
            done += 1
            if progress is not None and done % 64 == 0:
                progress(64)
    else:
        _replay_holding(requests, pool, config, try_admit, account, result, progress, deliver, completed)
    if progress is not None and config.hold == "none" and done % 64:
        progress(done % 64)
    stats = pool.stats()
    result.offloaded_blocks = stats.offloaded_blocks
    result.onboarded_blocks = stats.onboarded_blocks
    result.evicted_primary_blocks = stats.evicted_primary_blocks
    result.evicted_secondary_blocks = stats.evicted_secondary_blocks
    return result


def _deliverer(policy: SimPolicy, deletions: Sequence[ResponseDeletion], pool: BlockPool, config: SimConfig,
               result: PolicyResult) -> Callable[[float], None]:
    """``deliver(now)``: hands the policy every deletion up to ``now`` not yet delivered, and replays
    the demote request it answers with (if any) through ``pool``."""
    on_delete = getattr(policy, "on_delete", None)
    demote_request = getattr(policy, "demote_request", None)
    demote_at = demote_priority(pool.config.secondary_blocks, pool.config.secondary_offload_min_priority)
    ordered = sorted(deletions, key=lambda d: d.timestamp_ms)
    position = 0

    def deliver(now: float) -> None:
        nonlocal position
        while position < len(ordered) and ordered[position].timestamp_ms / 1000.0 <= now:
            deletion = ordered[position]
            position += 1
            if on_delete is not None:
                on_delete(deletion, now=now)
            demotes = () if demote_request is None else demote_request(
                deletion, now=now, tokens_per_block=config.tokens_per_block, priority=demote_at)
            for leaf, (request, plan) in enumerate(demotes):  # one per orphaned leaf, as the gateway sends them
                _replay_demote(pool, request, plan, config, result, ("demote", position, leaf), now)

    return deliver


def _replay_demote(pool: BlockPool, request: TraceRequest, plan, config: SimConfig,  # noqa: ANN001 - RetentionPlan
                   result: PolicyResult, key: tuple, now: float) -> None:
    """One demote request: the deleted prompt cut to its cached blocks + 1 token (``demote_length``),
    one token to generate, released at once; skipped when nothing of its own range is cached."""
    tokens = request_tokens(request, config.trace_block_size)
    start = plan.ranges[-1].start
    length = demote_length(pool.lookup(tokens, salt=_salt(request, config))[0], start, config.tokens_per_block,
                           len(tokens))
    if length is None:
        result.demote_uncached += 1
        return
    tokens = tokens[:length]
    alloc = pool.allocate(key, tokens, salt=_salt(request, config), tenant=request.tenant, plan=plan, now=now,
                          reserve_tokens=1)
    if alloc is None:
        result.demote_skipped += 1
        return
    result.demote_requests += 1
    result.demote_computed_tokens += len(tokens) - alloc.num_cached_tokens
    pool.release(key, tokens, now=now, num_computed_tokens=len(tokens))


def _replay_holding(requests, pool, config, try_admit, account, result, progress, deliver,  # noqa: ANN001
                    completed) -> None:
    """``--hold tokens``: FIFO admission, blocks held for the modelled service time; a request's
    prompt blocks are stored for reuse when its prefill ends, as TensorRT-LLM stores them
    (``BlockPool.store``), not only when it finishes."""
    # (time, order, request index, tokens, finishes): its prefill's end (finishes False), then its end
    running: list[tuple[float, int, int, object, bool]] = []
    order = 0
    by_index = {request.index: request for request in requests}
    waiting: deque[TraceRequest] = deque()

    def admit_waiting(now: float) -> None:
        nonlocal order
        while waiting:
            request = waiting[0]
            tokens, alloc = try_admit(request, now, request.output_length)
            if alloc is None:
                if running:
                    return  # head-of-line request waits for capacity
                waiting.popleft()  # cannot fit even in an idle pool
                account(request, 0, 0, True)
                _tick(progress)
                continue
            waiting.popleft()
            wait = now - request.timestamp_ms / 1000.0
            if wait > 0:
                result.delayed_requests += 1
                result.total_wait_s += wait
            account(request, alloc.reused_blocks, alloc.onboarded_blocks, False)
            prefill = (request.input_length - alloc.num_cached_tokens) / config.prefill_tokens_per_s
            finish = now + prefill + request.output_length / config.decode_tokens_per_s
            heapq.heappush(running, (now + prefill, order, request.index, tokens, False))
            heapq.heappush(running, (finish, order + 1, request.index, tokens, True))
            order += 2
            _tick(progress)

    def finish_until(limit: float | None) -> None:
        while running and (limit is None or running[0][0] <= limit):
            finish, _, index, tokens, finishes = heapq.heappop(running)
            if not finishes:  # the prefill ended: tokens[:promptLen - 1] (storeContextBlocks)
                pool.store(index, tokens, num_computed_tokens=len(tokens) - 1)
                continue
            pool.release(index, tokens, now=finish, num_computed_tokens=len(tokens))
            completed(by_index[index], finish)
            admit_waiting(finish)

    for request in requests:
        now = request.timestamp_ms / 1000.0
        finish_until(now)
        deliver(now)
        waiting.append(request)
        admit_waiting(now)
    finish_until(None)


def _tick(progress: Progress | None) -> None:
    if progress is not None:
        progress(1)


@dataclass(slots=True)
class CapacityReport:
    primary_blocks: int
    secondary_blocks: int
    results: dict[str, PolicyResult]
    belady_gpu: BeladyResult
    belady_total: BeladyResult | None  # GPU + host capacity, when a host tier exists
    age_ceiling_gpu: float = 0.0  # hit rate: the most an age-based policy could reach on the GPU (hit_density.py)

    def to_dict(self) -> dict:
        return {
            "primary_blocks": self.primary_blocks,
            "secondary_blocks": self.secondary_blocks,
            "policies": {name: r.to_dict() for name, r in self.results.items()},
            "belady_gpu": {**asdict(self.belady_gpu), "hit_rate": self.belady_gpu.hit_rate},
            "belady_total": None
            if self.belady_total is None
            else {**asdict(self.belady_total), "hit_rate": self.belady_total.hit_rate},
            "age_ceiling_gpu": self.age_ceiling_gpu,
        }


def run_simulation(
    requests: Sequence[TraceRequest],
    policies: Sequence[Callable[[], SimPolicy]],
    capacities: Sequence[int],
    *,
    host_blocks: Callable[[int], int],
    config: SimConfig = SimConfig(),
    progress: Progress | None = None,
    deletions: Sequence[ResponseDeletion] = (),
) -> list[CapacityReport]:
    """Every policy at every GPU capacity (host = ``host_blocks(gpu)``), with Belady ceilings.

    ``policies`` are factories so each run starts from fresh policy state.
    """
    prompts = Prompts(requests, config)  # shared by every replay below
    hashes = prompts.hashes(requests)
    chains: list[ChainRequest] = [
        chain_request(h, r.input_length, config.tokens_per_block) for h, r in zip(hashes, requests, strict=True)
    ]
    hulls = AgeHulls.build(chains, [r.timestamp_ms / 1000 for r in requests])
    reports: list[CapacityReport] = []
    for capacity in capacities:
        host = host_blocks(capacity)
        results: dict[str, PolicyResult] = {}
        for factory in policies:
            policy = factory()
            results[policy.name] = simulate(
                requests, policy, primary_blocks=capacity, secondary_blocks=host, config=config, hashes=hashes,
                progress=progress, deletions=deletions, prompts=prompts,
            )
        any_host = any(r.secondary_blocks for r in results.values())
        optimum = belady(chains, capacity, config.tokens_per_block)
        ceiling = hulls.at(capacity, config.tokens_per_block).capped(optimum.hit_rate)
        reports.append(
            CapacityReport(
                capacity, host, results, optimum,
                belady(chains, capacity + host, config.tokens_per_block) if any_host and host else None,
                ceiling,
            )
        )
    return reports
