"""Oracle reference policies: priority bands from *perfect* knowledge of future reuse.

They answer "how good could a predictor-driven policy be on this trace?". ``adaptive``
(and any policy like it) predicts, online, whether a block will be used again and turns
that into a priority band; the pool then evicts the lowest band first, LRU inside a band
(TensorRT-LLM's ``LRUEvictionPolicy``). An oracle policy replaces the prediction with the
truth, read from the whole request list, and runs through the same :class:`BlockPool`:

* ``oracle-reuse``        — band ``KEEP`` if the block is used again at all (by a later
                            request whose matchable prefix holds it), else ``DROP``;
* ``oracle-reuse-within`` — band ``KEEP`` iff the next use is at most ``horizon_s``
                            seconds after this request (trace timestamps), else ``DROP``;
* ``oracle-next-use``     — several bands by the time to the next use (sooner = higher),
                            the best a perfect "how soon does it come back" predictor
                            can express with fixed priorities;
* ``oracle-popularity``   — priority by *how many times* the block is used in the next
                            ``window_s`` seconds (more = higher, none = ``DROP``): perfect
                            knowledge of each block's near-future popularity, i.e. more
                            than any frequency, recency or rate estimator can learn online.

Every block's priority is set each time a request touches it (an explicit priority
overrides on reuse, as in TensorRT-LLM), from *that* request's knowledge of the next use.
A parent's next use is never later than its child's, so bands never increase along a
chain (the running minimum below only guards the invariant). No durations: with exact
knowledge a kept block is touched again before it would need to expire.

They are offline (they need the future) and therefore simulator-only, built from the
request list. They are not an upper bound for *every* policy — only Belady is
(``retention/simulation/belady.py``) — but for any policy whose mechanism is "predict reuse, set a
band, LRU inside the band" they are the ceiling of a perfect predictor of the same
question.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from retention.simulation.belady import NEVER, chain_request, next_uses
from retention.simulation.simulator import SimConfig, request_hashes
from retention.trace import TraceRequest
from retention.types import MAX_PRIORITY, TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY, RetentionPlan, merged_ranges

KEEP = 60  # above the default 35 and above the offload threshold
DROP = 0  # evicted first; never offloaded


def _chains(requests: Sequence[TraceRequest], config: SimConfig) -> list:
    """Each request as the pool hashes it: chained keys of its full blocks (``ChainRequest``)."""
    hashes = request_hashes(requests, config)
    return [chain_request(h, r.input_length, config.tokens_per_block) for h, r in zip(hashes, requests, strict=True)]


def next_use_gaps(requests: Sequence[TraceRequest], config: SimConfig = SimConfig()) -> list[list[float | None]]:
    """For each request and full pool block: seconds until the next request that can hit it (None = never)."""
    out: list[list[float | None]] = []
    for request, nxt in zip(requests, next_uses(_chains(requests, config)), strict=True):
        now = request.timestamp_ms / 1000.0
        out.append([None if j == NEVER else requests[j].timestamp_ms / 1000.0 - now for j in nxt])
    return out


def future_use_counts(requests: Sequence[TraceRequest], window_s: float, config: SimConfig = SimConfig()) -> list[list[int]]:
    """For each request and full pool block: how many later requests within ``window_s`` seconds can hit it.

    A later request counts when its matchable prefix holds the block and its timestamp is at
    most ``window_s`` after this request's (same model as :func:`next_use_gaps`; requests are
    in timestamp order, so a block's use times are sorted by request index).
    """
    chains = _chains(requests, config)
    uses: dict[int, tuple[list[int], list[float]]] = {}  # key -> (request indices, timestamps s)
    for index, (chain, request) in enumerate(zip(chains, requests, strict=True)):
        for key in chain.keys[: chain.matchable_blocks]:
            indices, times = uses.setdefault(key, ([], []))
            indices.append(index)
            times.append(request.timestamp_ms / 1000.0)
    out: list[list[int]] = []
    for index, (chain, request) in enumerate(zip(chains, requests, strict=True)):
        limit = request.timestamp_ms / 1000.0 + window_s
        row = []
        for key in chain.keys:
            indices, times = uses.get(key, ((), ()))
            row.append(max(0, bisect_right(times, limit) - bisect_right(indices, index)))
        out.append(row)
    return out


@dataclass(frozen=True, slots=True)
class GapBands:
    """Priority from a known next-use gap: ``bands`` = ((max gap s, priority), ...), ascending gaps.

    A gap at most ``bands[i][0]`` (first match) gets ``bands[i][1]``; a gap matching no band,
    or ``None`` (never used again / past the request's full blocks), gets ``DROP``.
    """

    bands: tuple[tuple[float, int], ...]

    def __call__(self, gap: float | None) -> int:
        if gap is None:
            return DROP
        for limit, priority in self.bands:
            if gap <= limit:
                return priority
        return DROP


POPULAR_BASE = 36  # one use in the window: just above the default 35


def popularity_priority(count: int | None) -> int:
    """More known uses in the window = higher priority; none = ``DROP``."""
    return DROP if not count else min(MAX_PRIORITY, POPULAR_BASE - 1 + count)


@dataclass(slots=True)
class OraclePolicy:
    """Per-block priorities ``rank(known[request][block])`` from facts read off the future; LRU among equals."""

    name: str
    known: Sequence[Sequence]  # by request index, per full block (next-use gap, use count, ...)
    rank: Callable[[object], int]
    uses_host: bool = False
    offload_min_priority: int = TRTLLM_DEFAULT_OFFLOAD_MIN_PRIORITY

    def priority(self, value: object) -> int:
        return self.rank(value)

    def plan(self, request: TraceRequest, hashes: list[int], *, now: float, pool) -> RetentionPlan:  # noqa: ANN001
        """One range per block, running minimum (a parent is never below its child)."""
        bpt = pool.config.tokens_per_block
        known = self.known[request.index]
        spans = []
        ceiling = MAX_PRIORITY
        for index in range(-(-request.input_length // bpt)):
            ceiling = min(ceiling, self.rank(known[index] if index < len(known) else None))
            spans.append((index * bpt, (index + 1) * bpt, ceiling, None))
        return RetentionPlan(merged_ranges(spans), DROP, None)

    def observe(self, request, hashes, allocation, *, now, pool) -> None:  # noqa: ANN001 - SimPolicy protocol
        return None


def oracle_popularity(counts: list[list[int]], window_s: float) -> OraclePolicy:
    """Priority by the known number of uses in the next ``window_s`` seconds (:func:`future_use_counts`)."""
    return OraclePolicy(f"oracle-popularity-{window_s:g}s", counts, popularity_priority)


def oracle_reuse(gaps: list[list[float | None]]) -> OraclePolicy:
    """KEEP iff the block is ever used again."""
    return OraclePolicy("oracle-reuse", gaps, GapBands(((float("inf"), KEEP),)))


def oracle_reuse_within(gaps: list[list[float | None]], horizon_s: float) -> OraclePolicy:
    """KEEP iff the block's next use is within ``horizon_s`` seconds."""
    return OraclePolicy(f"oracle-reuse-within-{horizon_s:g}s", gaps, GapBands(((horizon_s, KEEP),)))


DEFAULT_NEXT_USE_BANDS = ((10.0, 90), (30.0, 80), (100.0, 70), (300.0, 60), (1000.0, 50), (float("inf"), 40))


def oracle_next_use(gaps: list[list[float | None]], bands=DEFAULT_NEXT_USE_BANDS) -> OraclePolicy:  # noqa: ANN001
    """Sooner next use = higher band (default: ≤10 s, 30, 100, 300, 1000 s, later); never = DROP."""
    return OraclePolicy("oracle-next-use", gaps, GapBands(tuple(bands)))


ORACLE_NAMES = ("oracle-reuse", "oracle-reuse-within-<S>s", "oracle-next-use", "oracle-popularity-<S>s")
_WINDOWED = ("oracle-reuse-within-", "oracle-popularity-")


def is_oracle_name(name: str) -> bool:
    return name.startswith("oracle-")


def parse_oracle_name(name: str) -> float | None:
    """Validate an oracle policy name; returns the seconds of ``-within-<S>s`` / ``-popularity-<S>s`` names.

    Raises ``ValueError`` naming the accepted forms.
    """
    if name in ("oracle-reuse", "oracle-next-use"):
        return None
    for prefix in _WINDOWED:
        if name.startswith(prefix) and name.endswith("s"):
            try:
                seconds = float(name[len(prefix) : -1])
            except ValueError:
                seconds = float("nan")
            if seconds > 0 and seconds != float("inf"):
                return seconds
    raise ValueError(f"unknown oracle policy {name!r}; known: {', '.join(ORACLE_NAMES)} (S = seconds > 0, e.g. 30)")


def oracle_factories(names: Sequence[str], requests: Sequence[TraceRequest], config: SimConfig = SimConfig()):  # noqa: ANN201
    """``{name: factory}`` for the oracle names among ``names``; the future is read once per kind."""
    wanted = [n for n in names if is_oracle_name(n)]
    if not wanted:
        return {}
    gaps = next_use_gaps(requests, config) if any(not n.startswith("oracle-popularity-") for n in wanted) else []
    out = {}
    for name in wanted:
        seconds = parse_oracle_name(name)
        if name == "oracle-reuse":
            out[name] = lambda: oracle_reuse(gaps)
        elif name == "oracle-next-use":
            out[name] = lambda: oracle_next_use(gaps)
        elif name.startswith("oracle-popularity-"):
            counts = future_use_counts(requests, seconds, config)  # type: ignore[arg-type]
            out[name] = lambda c=counts, w=seconds: oracle_popularity(c, w)
        else:
            out[name] = lambda h=seconds: oracle_reuse_within(gaps, h)
    return out
