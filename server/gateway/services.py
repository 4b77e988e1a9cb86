"""The gateway's injected services and their background loops.

Built once per app by the factory (``server.app.create_app``) and kept on
``app.state.gateway``; tests build their own. Background loops: usage flush, key
``last_used`` flush, pool stats polling (quota state + pool metrics), the sweep of expired stored responses. Each loop
survives its own errors and stops with the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from retention.policy.adaptive import AdaptiveConfig
from retention.policy.selection import AdaptiveSelector
from server.gateway.api.conversation_demote import Demotes
from server.gateway.api.conversation_hold import ConversationHolds
from server.gateway.admission import Admission
from server.gateway.tasks import cancel_all
from server.gateway.auth import KeyAuthenticator
from server.gateway.observe.capture import TraceCaptures
from server.gateway.api.completions import CompletionRunner
from server.gateway.api.prompting import ChatPrompter
from server.gateway.replicas.engines import EngineDirectory
from server.gateway.observe.metrics import GatewayMetrics
from server.gateway.observe.miss_ratio import MissRatioCollector, MissRatioCurves
from server.gateway.replicas.pool_monitor import PoolMonitor
from server.gateway.replicas.peer_sync import PeerSync
from server.gateway.observe.slo_guard import SloGuards
from server.gateway.response_store import DEFAULT_MAX_BYTES, DEFAULT_TTL_S, ResponseStore
from server.gateway.replicas.routing import Routing, RoutingConfig
from server.gateway.usage import UsageRecorder
from server.gateway.usage_journal import UsageJournal
from tenants.snapshots import PoolSnapshot

log = logging.getLogger("kvgate.gateway")


@dataclass(slots=True)
class LoopIntervals:
    usage_flush: float = 2.0
    last_used_flush: float = 10.0
    pool_poll: float = 1.0
    slo_guard: float = 1.0
    capture_refresh: float = 2.0
    responses_purge: float = 600.0  # expired stored responses (tenants.responses.purge_expired)


@dataclass(slots=True)
class GatewayServices:
    auth: KeyAuthenticator
    admission: Admission
    engines: EngineDirectory[ChatPrompter]
    usage: UsageRecorder
    monitor: PoolMonitor
    registry: CollectorRegistry
    metrics: GatewayMetrics
    runner: CompletionRunner
    routing: Routing
    selectors: dict[str, AdaptiveSelector] = field(default_factory=dict)  # pool -> adaptive retention (stats + duel)
    slo_guards: SloGuards | None = None  # per-pool SLO guards (server.gateway.observe.slo_guard)
    intervals: LoopIntervals = field(default_factory=LoopIntervals)
    captures: TraceCaptures | None = None  # live trace capture (server.gateway.observe.capture)
    responses: ResponseStore | None = None  # stored Responses-API responses (server.gateway.response_store)
    curves: MissRatioCurves | None = None  # online miss-ratio curves (None when sampling is off)
    draining: bool = False  # set by the SIGTERM drain (server.gateway.drain): new requests get 503
    in_flight: int = 0  # serving requests not yet fully answered (server.gateway.drain.InFlight)
    demotes: Demotes = field(default_factory=Demotes)  # demote-on-delete requests in flight (conversation_demote.py)
    # The conversation and tool-loop holds (conversation_hold.py), injected by the factory into the
    # runner too; None: the runner's own (services built by hand in tests).
    holds: ConversationHolds | None = None
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.holds is None:
            self.holds = self.runner.holds
        elif self.holds is not self.runner.holds:
            raise ValueError("the runner must plan with the services' conversation holds")

    async def _loop(self, interval: float, step, name: str) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a loop must outlive one bad iteration
                log.exception("background %s failed", name)

    async def warm_up(self) -> None:
        """Load every registered pool's tokenizer before traffic needs it."""
        await self.monitor.refresh()
        for pool in list(self.engines.pools.values()):
            try:
                await self.engines.prompter(pool)
            except Exception:  # a pool without a usable tokenizer answers 503 per request
                log.exception("no tokenizer for pool %s", pool.name)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self.warm_up()),
            asyncio.create_task(self.usage.flush()),  # what a dead gateway's journal left, at once
            asyncio.create_task(self._loop(self.intervals.usage_flush, self.usage.flush, "usage flush")),
            asyncio.create_task(self._loop(self.intervals.last_used_flush, self.auth.flush_last_used, "last-used flush")),
            asyncio.create_task(self._loop(self.intervals.pool_poll, self.monitor.refresh, "pool poll")),
        ]
        if self.routing.peer_sync is not None:  # routing sync: its own tasks, closed with the routing
            self.routing.peer_sync.start()
        retry_releases = getattr(self.admission, "retry_releases", None)
        if retry_releases is not None:  # Redis admission: slots owed back after a Redis outage

            async def give_back() -> None:
                with contextlib.suppress(Exception):  # still away: the next round tries again
                    await retry_releases()

            self._tasks.append(asyncio.create_task(self._loop(1.0, give_back, "admission releases")))
        renew_leases = getattr(self.admission, "renew_leases", None)
        if renew_leases is not None:  # Redis admission: live requests' leases kept from lapsing

            async def heartbeat() -> None:
                with contextlib.suppress(Exception):  # Redis away: the next beat tries again
                    await renew_leases()

            self._tasks.append(asyncio.create_task(
                self._loop(self.admission.renew_every_s, heartbeat, "admission lease renewal")))
        if self.responses is not None:
            self._tasks.append(asyncio.create_task(
                self._loop(self.intervals.responses_purge, self.responses.purge_expired, "responses purge")))
        if self.slo_guards is not None:
            self._tasks.append(asyncio.create_task(self._loop(self.intervals.slo_guard, self.slo_guards.tick, "SLO guard")))
        if self.captures is not None:
            self._tasks.append(asyncio.create_task(self.captures.refresh()))
            self._tasks.append(asyncio.create_task(
                self._loop(self.intervals.capture_refresh, self.captures.refresh, "capture refresh")))

    def abort_in_flight(self) -> int:
        """End every engine call still running (a drain past its timeout): each request answers
        503 ``shutting_down`` or its stream's error event (``replicas/abort.py``). Returns how
        many calls were running."""
        return self.routing.aborts.abort_all()

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        self._tasks = []
        with contextlib.suppress(Exception):
            await self.usage.flush()
        self.usage.close()
        with contextlib.suppress(Exception):
            await self.auth.flush_last_used()
        if self.captures is not None:
            with contextlib.suppress(Exception):
                await self.captures.close()
        await self.engines.close()
        await self.routing.close()
        await self.admission.close()


def build_gateway_services(*, session_factory, pepper: str, tokenizer_for, admission: Admission,
                           registry: CollectorRegistry, pools_and_tenants, auth_ttl: float = 5.0,
                           intervals: LoopIntervals | None = None, adaptive_max_entries: int = 100_000,
                           mrc_sample_rate: float = 0.01, trace_dir: Path | None = None,
                           routing: RoutingConfig | None = None, responses_ttl_s: float = DEFAULT_TTL_S,
                           responses_max_bytes: int = DEFAULT_MAX_BYTES,
                           usage_journal_dir: Path | None = None, registry_id: str = "registry",
                           usage_journal_fsync: bool = True, peer_sync: PeerSync | None = None) -> GatewayServices:
    engines: EngineDirectory[ChatPrompter] = EngineDirectory(lambda pool: ChatPrompter(tokenizer_for(pool)))
    selectors: dict[str, AdaptiveSelector] = {}

    def selector_for(pool: PoolSnapshot) -> AdaptiveSelector:
        """One selector per pool, rebuilt (statistics and contest restart) when the pool's shape changes."""
        selector = selectors.get(pool.name)
        shape = (pool.primary_blocks, pool.secondary_blocks, pool.secondary_offload_min_priority)
        if selector is None or (selector.primary_blocks, selector.secondary_blocks, selector.offload_min_priority) != shape:
            selector = selectors[pool.name] = AdaptiveSelector(
                *shape, adaptive=AdaptiveConfig(max_entries=adaptive_max_entries))
        return selector

    metrics = GatewayMetrics(registry)
    router = Routing(routing, metrics=metrics, peer_sync=peer_sync)
    metrics.watch_replicas(router.rows)
    if peer_sync is not None:
        metrics.watch_sync(router.sync_rows, lambda: asdict(peer_sync.counters), lambda: peer_sync.resubscribes)
    curves = MissRatioCurves(mrc_sample_rate)
    monitor = PoolMonitor(engines, pools_and_tenants, routing=router, curves=curves)
    metrics.watch_pools(monitor.snapshots, lambda: monitor.engine_up)
    if curves.enabled:
        registry.register(MissRatioCollector(curves, monitor.tenant_slugs))
    # The journal's directory: answered requests' usage survives a SIGKILL (server.gateway.usage_journal);
    # with usage_journal_fsync (the default) a power loss too.
    journal = (UsageJournal(usage_journal_dir, registry=registry_id, fsync=usage_journal_fsync)
               if usage_journal_dir is not None else None)
    usage = UsageRecorder(session_factory, journal=journal)
    metrics.watch_usage(usage.stats)
    guards = SloGuards(session_factory=session_factory, pools=lambda: list(engines.pools.values()), registry=registry)
    captures = TraceCaptures(session_factory, trace_dir, registry) if trace_dir is not None else None
    holds = ConversationHolds(store_ttl_ms=int(responses_ttl_s * 1000))  # one per process; the store's TTL caps a hold
    return GatewayServices(
        auth=KeyAuthenticator(session_factory, pepper=pepper, ttl=auth_ttl),
        admission=admission, engines=engines, usage=usage, monitor=monitor, registry=registry, metrics=metrics,
        runner=CompletionRunner(admission=admission, metrics=metrics, usage=usage.record, selector_for=selector_for,
                                guard=guards, curves=curves,
                                capture=captures.offer if captures is not None else None, holds=holds),
        routing=router,
        selectors=selectors, slo_guards=guards, captures=captures, curves=curves if curves.enabled else None,
        responses=ResponseStore(session_factory, ttl_s=responses_ttl_s, max_bytes=responses_max_bytes),
        intervals=intervals or LoopIntervals(), holds=holds,
    )
