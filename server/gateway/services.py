"""The gateway's injected services and their background loops.

Built once per app by the factory (``server.app.create_app``) and kept on
``app.state.gateway``; tests build their own. Background loops: usage flush, key
``last_used`` flush, pool stats polling (quota state + pool metrics). Each loop
survives its own errors and stops with the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from retention.adaptive import AdaptiveConfig, ReuseStats
from server.gateway.admission import Admission
from server.gateway.auth import KeyAuthenticator
from server.gateway.completions import CompletionRunner
from server.gateway.engines import EngineDirectory
from server.gateway.metrics import GatewayMetrics
from server.gateway.pool_monitor import PoolMonitor
from server.gateway.routing import Routing, RoutingConfig
from server.gateway.usage import UsageRecorder

log = logging.getLogger("kvgate.gateway")


@dataclass(slots=True)
class LoopIntervals:
    usage_flush: float = 2.0
    last_used_flush: float = 10.0
    pool_poll: float = 1.0


@dataclass(slots=True)
class GatewayServices:
    auth: KeyAuthenticator
    admission: Admission
    engines: EngineDirectory
    usage: UsageRecorder
    monitor: PoolMonitor
    registry: CollectorRegistry
    metrics: GatewayMetrics
    runner: CompletionRunner
    routing: Routing
    reuse: dict[str, ReuseStats] = field(default_factory=dict)  # pool -> adaptive retention statistics
    intervals: LoopIntervals = field(default_factory=LoopIntervals)
    draining: bool = False  # set by the SIGTERM drain (server.gateway.drain): new requests get 503
    in_flight: int = 0  # serving requests not yet fully answered (server.gateway.drain.InFlight)
    _tasks: list[asyncio.Task] = field(default_factory=list)

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
            asyncio.create_task(self._loop(self.intervals.usage_flush, self.usage.flush, "usage flush")),
            asyncio.create_task(self._loop(self.intervals.last_used_flush, self.auth.flush_last_used, "last-used flush")),
            asyncio.create_task(self._loop(self.intervals.pool_poll, self.monitor.refresh, "pool poll")),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        with contextlib.suppress(Exception):
            await self.usage.flush()
        with contextlib.suppress(Exception):
            await self.auth.flush_last_used()
        await self.engines.close()
        await self.routing.close()
        await self.admission.close()


def build_gateway_services(*, session_factory, pepper: str, tokenizer_for, admission: Admission,
                           registry: CollectorRegistry, pools_and_tenants, auth_ttl: float = 5.0,
                           intervals: LoopIntervals | None = None, adaptive_max_entries: int = 100_000,
                           routing: RoutingConfig | None = None) -> GatewayServices:
    engines = EngineDirectory(tokenizer_for)
    reuse: dict[str, ReuseStats] = {}

    def reuse_for(pool: str) -> ReuseStats:
        stats = reuse.get(pool)
        if stats is None:
            stats = reuse[pool] = ReuseStats(AdaptiveConfig(max_entries=adaptive_max_entries))
        return stats

    metrics = GatewayMetrics(registry)
    router = Routing(routing, metrics=metrics)
    metrics.watch_replicas(router.rows)
    monitor = PoolMonitor(engines, pools_and_tenants, routing=router)
    metrics.watch_pools(monitor.snapshots)
    usage = UsageRecorder(session_factory)
    return GatewayServices(
        auth=KeyAuthenticator(session_factory, pepper=pepper, ttl=auth_ttl),
        admission=admission, engines=engines, usage=usage, monitor=monitor, registry=registry, metrics=metrics,
        runner=CompletionRunner(admission=admission, metrics=metrics, usage=usage.record, reuse_for=reuse_for),
        routing=router,
        reuse=reuse,
        intervals=intervals or LoopIntervals(),
    )
