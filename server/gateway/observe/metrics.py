"""The one place where gateway and pool statistics become Prometheus metrics.

Everything is registered on the ``registry`` passed in (a fresh one per app and per
test). Per-request series are labelled with the tenant's registry slug and the pool
name (both bounded by the registry); the per-tenant KV totals the admin API reads
(``GatewayMetrics.tenant_kv``) are keyed by the tenant's registry *id*, never its slug: a
slug freed by a deleted tenant and taken by a new one starts from zero. Pool gauges are
produced at scrape time by a custom collector from the latest engine stats snapshots, so
a scrape never calls an engine; the engines' cumulative block counters are exported per
replica (a pool-level sum would go down whenever a replica left rotation). Names carry
units (``_seconds``, ``_total``) and the ``kvgate_`` prefix; the dashboards in ``deploy/``
read exactly these names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engines.contract import KvMetrics
from engines.pool_stats import PoolStatsReport
from server.gateway.observe.capacity_check import CapacityCheck

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)

CACHE_OUTCOMES = ("gpu_hit", "host_hit", "miss")


def cache_outcome(kv: KvMetrics | None) -> str:
    """Where a request's cached prefix came from: ``host_hit`` if any block was onboarded
    from the host tier, ``gpu_hit`` if blocks were reused from GPU memory only, ``miss`` if
    nothing was reused (the whole prompt was computed)."""
    if kv is None or kv.reused_blocks <= 0:
        return "miss"
    return "host_hit" if kv.onboarded_blocks > 0 else "gpu_hit"


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """What the collector needs from one pool at scrape time."""

    pool: str
    stats: PoolStatsReport
    tenant_slugs: Mapping[str, str]  # engine tenant id -> registry slug (unknown ids are not exported)
    tenant_quota_blocks: Mapping[str, float]  # slug -> primary blocks allowed by its kv_quota_fraction
    demoted: Mapping[str, bool]  # slug -> currently demoted for quota
    capacity: CapacityCheck | None = None  # registered vs engine-reported blocks
    # replica name -> its last report, in rotation or not: the engine counters' source (one series each)
    replicas: Mapping[str, PoolStatsReport] = field(default_factory=dict)


# The engines' cumulative block counters (PoolStatsReport fields ``<name>_blocks``).
ENGINE_COUNTERS = ("offloaded", "onboarded", "evicted", "reused", "missed")


class PoolStatsCollector(Collector):
    def __init__(self, snapshots: Callable[[], Iterable[PoolSnapshot]],
                 engine_up: Callable[[], Mapping[str, bool]] | None = None) -> None:
        self._snapshots = snapshots
        self._engine_up = engine_up

    def describe(self):
        return []

    def collect(self):
        blocks = GaugeMetricFamily("kvgate_pool_blocks", "KV blocks per pool, tier and state", labels=["pool", "tier", "state"])
        tenant_blocks = GaugeMetricFamily("kvgate_tenant_kv_blocks", "KV blocks a tenant holds", labels=["tenant", "pool", "tier"])
        quota = GaugeMetricFamily("kvgate_tenant_kv_quota_ratio", "Primary blocks held / blocks allowed by the KV quota", labels=["tenant", "pool"])
        demoted = GaugeMetricFamily("kvgate_tenant_kv_demoted", "1 while the tenant's new blocks are demoted for quota", labels=["tenant", "pool"])
        hit_rate = GaugeMetricFamily("kvgate_pool_cache_hit_rate", "Engine-reported KV block hit rate", labels=["pool"])
        registered = GaugeMetricFamily("kvgate_pool_registered_blocks",
                                       "KV blocks per tier as registered (kvgate_pool_blocks{state=\"max\"} is the engine's)",
                                       labels=["pool", "tier"])
        mismatch = GaugeMetricFamily("kvgate_pool_capacity_mismatch",
                                     "1 while the registry's block counts or block size differ from the engine's", labels=["pool"])
        # Per replica, never summed here: a sum over the replicas in rotation goes down when one
        # leaves (Prometheus reads a reset). Each replica's series goes down only when its engine
        # restarts, which rate() handles per series; the pool's rate is the sum of its replicas'.
        counters = {
            name: CounterMetricFamily(
                f"kvgate_pool_{name}_blocks",
                f"KV blocks {name} by the replica's engine since it started (its last stats report, in rotation "
                f"or not); the pool's rate is the sum of its replicas' rates",
                labels=["pool", "replica"])
            for name in ENGINE_COUNTERS
        }
        # Copies of every mapping read here: a scrape runs in a worker thread while the event loop
        # adds and forgets pools, replicas and tenants.
        for snap in list(self._snapshots()):
            s = snap.stats
            for tier_name, tier in (("primary", s.primary), ("secondary", s.secondary)):
                blocks.add_metric([snap.pool, tier_name, "used"], tier.used_blocks)
                blocks.add_metric([snap.pool, tier_name, "free"], tier.free_blocks)
                blocks.add_metric([snap.pool, tier_name, "max"], tier.max_blocks)
            hit_rate.add_metric([snap.pool], s.cache_hit_rate)
            if snap.capacity is not None:
                registered.add_metric([snap.pool, "primary"], snap.capacity.registered_primary)
                registered.add_metric([snap.pool, "secondary"], snap.capacity.registered_secondary)
                mismatch.add_metric([snap.pool], 1.0 if snap.capacity.mismatch else 0.0)
            for replica, report in list(snap.replicas.items()):
                for name, family in counters.items():
                    family.add_metric([snap.pool, replica], getattr(report, f"{name}_blocks"))
            for tenant_id, (primary, secondary) in list(s.tenants.items()):
                slug = snap.tenant_slugs.get(tenant_id)
                if slug is None:
                    continue
                tenant_blocks.add_metric([slug, snap.pool, "primary"], primary)
                tenant_blocks.add_metric([slug, snap.pool, "secondary"], secondary)
            for slug, allowed in list(snap.tenant_quota_blocks.items()):
                held = next((p for tid, (p, _) in s.tenants.items() if snap.tenant_slugs.get(tid) == slug), 0)
                quota.add_metric([slug, snap.pool], held / allowed if allowed > 0 else 0.0)
                demoted.add_metric([slug, snap.pool], 1.0 if snap.demoted.get(slug) else 0.0)
        yield blocks
        yield tenant_blocks
        yield quota
        yield demoted
        yield hit_rate
        yield registered
        yield mismatch
        yield from counters.values()
        if self._engine_up is not None:
            up = GaugeMetricFamily("kvgate_engine_up", "1 if the pool's engine answered the gateway's last stats call", labels=["pool"])
            for pool, answered in list(self._engine_up().items()):
                up.add_metric([pool], 1.0 if answered else 0.0)
            yield up


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """What the collector needs from one replica at scrape time (``server/gateway/replicas/routing.py``)."""

    pool: str
    replica: str
    state: str  # registry state: active | draining | disabled
    healthy: bool  # circuit breaker closed
    in_flight: int
    indexed: str  # precise | approximate | unknown


class ReplicaCollector(Collector):
    def __init__(self, rows: Callable[[], Iterable[ReplicaRow]]) -> None:
        self._rows = rows

    def describe(self):
        return []

    def collect(self):
        labels = ["pool", "replica"]
        healthy = GaugeMetricFamily("kvgate_replica_healthy", "1 while the replica's circuit breaker is closed", labels=labels)
        in_flight = GaugeMetricFamily("kvgate_replica_in_flight", "Requests this gateway has in flight on the replica", labels=labels)
        state = GaugeMetricFamily("kvgate_replica_state", "1 for the replica's registry state", labels=labels + ["state"])
        index = GaugeMetricFamily("kvgate_replica_index_mode", "1 for how the router knows the replica's cache",
                                  labels=labels + ["mode"])
        for row in list(self._rows()):
            healthy.add_metric([row.pool, row.replica], 1.0 if row.healthy else 0.0)
            in_flight.add_metric([row.pool, row.replica], row.in_flight)
            state.add_metric([row.pool, row.replica, row.state], 1.0)
            index.add_metric([row.pool, row.replica, row.indexed], 1.0)
        yield healthy
        yield in_flight
        yield state
        yield index


class SyncCollector(Collector):
    """Routing sync at scrape time: ``pools()`` yields (pool, peers heard within the lease, peers'
    requests in this gateway's load); ``counts()`` maps published / received / dropped / malformed
    to notice counts since start; ``resubscribes()`` counts subscriptions made again."""

    def __init__(self, pools: Callable[[], Iterable[tuple[str, int, int]]], counts: Callable[[], Mapping[str, int]],
                 resubscribes: Callable[[], int]) -> None:
        self._pools, self._counts, self._resubscribes = pools, counts, resubscribes

    def describe(self):
        return []

    def collect(self):
        peers = GaugeMetricFamily("kvgate_routing_sync_peers", "Gateways heard from within the sync lease", labels=["pool"])
        requests = GaugeMetricFamily("kvgate_routing_sync_peer_requests",
                                     "Other gateways' requests in flight counted in this gateway's load", labels=["pool"])
        for pool, n, in_flight in list(self._pools()):
            peers.add_metric([pool], n)
            requests.add_metric([pool], in_flight)
        notices = CounterMetricFamily("kvgate_routing_sync_notices", "Routing sync notices by outcome",
                                      labels=["outcome"])
        for outcome, n in list(self._counts().items()):
            notices.add_metric([outcome], n)
        resubscribes = CounterMetricFamily("kvgate_routing_sync_resubscribes",
                                           "Routing sync subscriptions made again (a failure, or a quiet lease)")
        resubscribes.add_metric([], self._resubscribes())
        yield peers
        yield requests
        yield notices
        yield resubscribes


class UsageCollector(Collector):
    """The usage recorder's figures at scrape time (``server.gateway.usage.UsageRecorder.stats``):
    what waits for the registry, and what the journal and the registry refused."""

    def __init__(self, stats: Callable[[], Mapping[str, int]]) -> None:
        self._stats = stats

    def describe(self):
        return []

    def collect(self):
        s = dict(self._stats())
        gauges = (
            ("kvgate_usage_backlog_rows", "Usage rows (tenant x minute) counted and not yet in the registry", "backlog_rows"),
            ("kvgate_usage_pending_batches", "Sealed usage batches waiting for the registry", "pending_batches"),
            ("kvgate_usage_pending_segments", "Usage journal segments this gateway holds (one descriptor each) until "
             "their batch is in the registry", "pending_segments"),
            ("kvgate_usage_foreign_segments", "Usage journal segments of another registry fingerprint found at start "
             "(never replayed by this gateway)", "foreign_segments"),
        )
        for name, doc, key in gauges:
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], s.get(key, 0))
            yield gauge
        counters = (
            ("kvgate_usage_flush_failures", "Usage batch writes the registry failed transiently (batch kept, retried)",
             "flush_failures"),
            ("kvgate_usage_quarantined_batches", "Usage batches the registry refused for good (segment moved to the "
             "journal's quarantine/, or dropped without a journal)", "quarantined_batches"),
            ("kvgate_usage_unreadable_lines", "Usage journal lines skipped at replay (torn, unreadable or unstorable)",
             "unreadable_lines"),
        )
        for name, doc, key in counters:
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], s.get(key, 0))
            yield counter


class GatewayMetrics:
    """Per-request metrics, labelled by tenant slug and pool."""

    def __init__(self, registry: CollectorRegistry, snapshots: Callable[[], Iterable[PoolSnapshot]] | None = None,
                 engine_up: Callable[[], Mapping[str, bool]] | None = None) -> None:
        self.registry = registry
        tp = ["tenant", "pool"]
        self.requests = Counter("kvgate_requests", "Serving requests by outcome", tp + ["status"], registry=registry)
        self.prompt_tokens = Counter("kvgate_prompt_tokens", "Prompt tokens admitted", tp, registry=registry)
        self.completion_tokens = Counter("kvgate_completion_tokens", "Completion tokens generated", tp, registry=registry)
        self.ttft = Histogram("kvgate_ttft_seconds", "Time to first token (streamed requests)", tp, buckets=_LATENCY_BUCKETS, registry=registry)
        # Hit quality, not hit counts: the same TTFT split by where the prompt's
        # cached prefix came from (see cache_outcome).
        self.ttft_by_cache = Histogram("kvgate_ttft_by_cache_seconds", "Time to first token by cache outcome (streamed requests)",
                                       tp + ["cache"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram("kvgate_inter_token_seconds", "Mean inter-token latency of a streamed request",
                                     tp, buckets=_ITL_BUCKETS, registry=registry)
        self.latency = Histogram("kvgate_request_duration_seconds", "End-to-end request latency", tp, buckets=_LATENCY_BUCKETS, registry=registry)
        self.kv_reused = Counter("kvgate_kv_blocks_reused", "KV blocks reused from cache (GPU or host)", tp, registry=registry)
        self.kv_new = Counter("kvgate_kv_blocks_new", "Prompt KV blocks computed (not found in the cache)", tp,
                              registry=registry)
        self.kv_onboarded = Counter("kvgate_kv_blocks_onboarded", "KV blocks onboarded from the host tier", tp, registry=registry)
        self.rate_limited = Counter("kvgate_rate_limited", "Requests refused by admission", ["tenant", "limit"], registry=registry)
        self.quota_demotions = Counter("kvgate_quota_demotions", "Requests planned with quota demotion", tp, registry=registry)
        self.responses_not_stored = Counter(
            "kvgate_responses_not_stored", "Responses asked to be stored that were answered and not stored "
            "(store: false in the answer): the byte cap reached while they ran, or the registry failing",
            tp, registry=registry)
        self.conversation_demotes = Counter(
            "kvgate_conversation_demotes", "Demote requests after a stored response's delete (trigger delete) or a "
            "tool run's end in a message (trigger end), by outcome (sent, failed, uncached, no_cache_view); not "
            "tenant usage", tp + ["trigger", "outcome"], registry=registry)
        # Client cache hints (retention/policy/hint_plan.py): applied in full, cut by the tenant's hint
        # budget ("clipped", the plan changed for part of the hint; "no_room", not at all), or
        # left out: the class does not honour hints, the plan was demoted, or no full block ("ignored").
        self.cache_hints = Counter("kvgate_cache_hint_requests", "Requests carrying cache hints by outcome",
                                   tp + ["outcome"], registry=registry)
        self.hinted_blocks = Counter("kvgate_cache_hinted_blocks", "Prompt blocks planned under a client hint", tp,
                                     registry=registry)
        pr = ["pool", "replica"]
        self.replica_requests = Counter("kvgate_replica_requests", "Engine attempts per replica by outcome "
                                        "(ok, retried, error, rejected, cancelled)", pr + ["status"], registry=registry)
        self.replica_prompt_tokens = Counter("kvgate_replica_prompt_tokens", "Prompt tokens sent to the replica", pr,
                                             registry=registry)
        self.replica_cached_tokens = Counter("kvgate_replica_cached_tokens", "Prompt tokens the replica served from "
                                             "its KV cache", pr, registry=registry)
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}
        # (tenant id, pool) -> [requests with KV metrics, reused, new, onboarded blocks]: the sums of
        # the kvgate_kv_blocks_* counters, per tenant for the admin API (kv_view.py). By id, not
        # slug: a deleted tenant's slug taken by a new tenant must not inherit its figures.
        self.tenant_kv: dict[tuple[int, str], list[int]] = {}
        if snapshots is not None:
            registry.register(PoolStatsCollector(snapshots, engine_up))

    def watch_pools(self, snapshots: Callable[[], Iterable[PoolSnapshot]],
                    engine_up: Callable[[], Mapping[str, bool]] | None = None) -> None:
        """Export pool gauges from the latest engine stats (and whether any replica answered) at scrape time."""
        self.registry.register(PoolStatsCollector(snapshots, engine_up))

    def watch_replicas(self, rows: Callable[[], Iterable[ReplicaRow]]) -> None:
        """Export replica health and load at scrape time (called once by the services)."""
        self.registry.register(ReplicaCollector(rows))

    def watch_sync(self, pools: Callable[[], Iterable[tuple[str, int, int]]], counts: Callable[[], Mapping[str, int]],
                   resubscribes: Callable[[], int]) -> None:
        """Export routing sync's peers, notice counts and resubscriptions at scrape time (routing sync on only)."""
        self.registry.register(SyncCollector(pools, counts, resubscribes))

    def watch_usage(self, stats: Callable[[], Mapping[str, int]]) -> None:
        """Export the usage recorder's backlog and failure counters at scrape time (``UsageRecorder.stats``)."""
        self.registry.register(UsageCollector(stats))

    def observe_replica(self, *, pool: str, replica: str, status: str, prompt_tokens: int, cached_tokens: int) -> None:
        """One engine attempt on ``replica`` (a retried request counts once per attempt)."""
        child = self._child
        child(self.replica_requests, pool, replica, status).inc()
        if status == "ok":
            child(self.replica_prompt_tokens, pool, replica).inc(prompt_tokens)
            child(self.replica_cached_tokens, pool, replica).inc(cached_tokens)

    def _child(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once per label set and kept.

        Why: ``labels()`` validates and locks on every call, and a request records up to
        nine series. Children are still created on first use only, so /metrics lists the
        same series as before; label sets are bounded by the registry (tenant x pool).
        """
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_request(self, *, tenant: str, tenant_id: int, pool: str, status: str, prompt_tokens: int,
                        completion_tokens: int, ttft: float | None, latency: float, kv: KvMetrics | None,
                        demoted: bool, inter_token: float | None = None) -> None:
        """One finished request of ``tenant`` (its slug: the series' label) on ``pool``.

        ``tenant_id`` (the registry id) keys ``tenant_kv``: a slug alone cannot tell a deleted
        tenant from a new one that took its slug."""
        child = self._child
        child(self.requests, tenant, pool, status).inc()
        if prompt_tokens:
            child(self.prompt_tokens, tenant, pool).inc(prompt_tokens)
        if completion_tokens:
            child(self.completion_tokens, tenant, pool).inc(completion_tokens)
        if ttft is not None:
            child(self.ttft, tenant, pool).observe(ttft)
            child(self.ttft_by_cache, tenant, pool, cache_outcome(kv)).observe(ttft)
        if inter_token is not None:
            child(self.inter_token, tenant, pool).observe(inter_token)
        child(self.latency, tenant, pool).observe(latency)
        if kv is not None:
            totals = self.tenant_kv.get((tenant_id, pool))
            if totals is None:
                totals = self.tenant_kv[(tenant_id, pool)] = [0, 0, 0, 0]
            totals[0] += 1
            totals[1] += kv.reused_blocks
            totals[2] += kv.new_blocks
            totals[3] += kv.onboarded_blocks
            child(self.kv_reused, tenant, pool).inc(kv.reused_blocks)
            child(self.kv_new, tenant, pool).inc(kv.new_blocks)
            child(self.kv_onboarded, tenant, pool).inc(kv.onboarded_blocks)
        if demoted:
            child(self.quota_demotions, tenant, pool).inc()


class SloGuardMetrics:
    """The SLO guard's series: ``kvgate_slo_guard_tripped{pool}`` (1/0, read at scrape time) and,
    per pilot arm (``host`` = planned with the host tier, ``rollback`` = planned below the
    offload threshold), TTFT, inter-token latency and requests by cache outcome."""

    def __init__(self, registry: CollectorRegistry, tripped: Callable[[], Mapping[str, bool]]) -> None:
        arm = ["pool", "arm"]
        self.ttft = Histogram("kvgate_pilot_ttft_seconds", "Time to first token by pilot arm (streamed requests)", arm,
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram("kvgate_pilot_inter_token_seconds", "Mean inter-token latency by pilot arm", arm,
                                     buckets=_ITL_BUCKETS, registry=registry)
        self.requests = Counter("kvgate_pilot_requests", "Requests by pilot arm and cache outcome", arm + ["cache"],
                                registry=registry)
        registry.register(_TrippedCollector(tripped))

    def observe(self, *, pool: str, arm: str, ttft: float | None, inter_token: float | None, cache: str) -> None:
        self.requests.labels(pool, arm, cache).inc()
        if ttft is not None:
            self.ttft.labels(pool, arm).observe(ttft)
        if inter_token is not None:
            self.inter_token.labels(pool, arm).observe(inter_token)


class _TrippedCollector(Collector):
    def __init__(self, tripped: Callable[[], Mapping[str, bool]]) -> None:
        self._tripped = tripped

    def describe(self):
        return []

    def collect(self):
        gauge = GaugeMetricFamily("kvgate_slo_guard_tripped",
                                  "1 while the SLO guard has the pool's host tier rolled back", labels=["pool"])
        for pool, tripped in list(self._tripped().items()):
            gauge.add_metric([pool], 1.0 if tripped else 0.0)
        yield gauge
