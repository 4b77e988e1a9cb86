"""The engine's block counters on /metrics (``kvgate_pool_{offloaded,onboarded,evicted,reused,missed}_blocks_total``)
as a gateway exports them while its replicas leave and rejoin rotation.

Each is a Prometheus counter: a series that goes down is read as a reset, and ``rate()`` then
counts the whole new value as growth. So the series are per replica, from each replica's last
stats report whatever its breaker says (out of rotation, timed out or unreachable, it keeps its
series): a series goes down only when that replica's engine restarted, and a replica removed
from the registry loses its series. Pool gauges (capacity, free blocks) still count the replicas
in rotation only, as quotas do.

Real ``Routing`` / ``PoolMonitor`` / ``GatewayMetrics``, fake engine clients and an injected clock;
``Fleet`` also feeds ``tests/deploy/test_prometheus.py``, which runs the shipped rules over what it
exports with ``promtool``.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engines.pool_stats import PoolStatsReport, TierStats
from server.gateway.observe.metrics import GatewayMetrics
from server.gateway.replicas.engine_client import EngineUnavailable
from server.gateway.replicas.engines import EngineDirectory
from server.gateway.replicas.pool_monitor import PoolMonitor
from server.gateway.replicas.routing import Routing, RoutingConfig
from tenants.snapshots import PoolSnapshot, ReplicaSnapshot

# Blocks per minute each engine counts (offloads per onboard: 40).
PER_MINUTE = {"offloaded": 240, "onboarded": 6, "evicted": 60, "reused": 300, "missed": 120}
COUNTERS = tuple(f"kvgate_pool_{name}_blocks_total" for name in PER_MINUTE)
Series = tuple[str, tuple[tuple[str, str], ...]]  # metric name, sorted labels


class Engine:
    """One replica's engine: counters cumulative since it started; its stats answer unless unreachable."""

    def __init__(self, base: int) -> None:
        self.base, self.minutes, self.reachable = base, 0, True

    def tick(self) -> None:
        self.minutes += 1

    def restart(self) -> None:
        self.base = self.minutes = 0

    async def stats(self, timeout=5.0, *, events_since=None):  # noqa: ANN001, ANN201
        if not self.reachable:
            raise EngineUnavailable("connection refused")
        counts = {f"{name}_blocks": self.base + rate * self.minutes for name, rate in PER_MINUTE.items()}
        return PoolStatsReport(16, TierStats(10, 4, 6), TierStats(20, 20, 0), **counts)

    async def close(self) -> None:
        pass


class Fleet:
    """One pool, one gateway, replicas with fake engines; ``minute()`` is one poll a minute apart.
    Build inside the event loop (engine clients need one)."""

    def __init__(self, bases: dict[str, int]) -> None:
        self.now = 1000.0
        self.engines = {name: Engine(base) for name, base in bases.items()}
        self.routing = Routing(RoutingConfig(router="round-robin", breaker_open_s=1.0, breaker_max_open_s=4.0),
                               clock=lambda: self.now)
        self.pool = self._snapshot(list(bases))
        self.monitor = PoolMonitor(EngineDirectory(lambda pool: None), lambda: [(self.pool, [])],
                                   routing=self.routing, clock=lambda: self.now)
        self.route = self.routing.route(self.pool)
        for replica in self.route.replicas.values():
            replica.client = self.engines[replica.name]
        self.registry = CollectorRegistry()
        GatewayMetrics(self.registry, self.monitor.snapshots, lambda: self.monitor.engine_up)

    @staticmethod
    def _snapshot(names: list[str]) -> PoolSnapshot:
        return PoolSnapshot(1, "p", "m", "kvgate_llm", "spec", 16, 10, 20, 30,
                            tuple(ReplicaSnapshot(int(n[1:]), n, f"127.0.0.1:{9000 + int(n[1:])}", "active", 1)
                                  for n in names))

    def replica(self, name: str):  # noqa: ANN201
        return next(r for r in self.route.replicas.values() if r.name == name)

    def time_out(self, name: str) -> None:
        """A request to ``name`` got no first token in time: out of rotation, its stats still answer."""
        self.route.mark_timed_out(self.replica(name), self.now)

    def serve(self, name: str) -> None:
        """A request was served by ``name``: back in rotation."""
        self.route.mark_served(self.replica(name))

    def remove(self, name: str) -> None:
        """The operator removed ``name`` from the registry."""
        self.pool = self._snapshot([n for n in self.engines if n != name and self._listed(n)])

    def _listed(self, name: str) -> bool:
        return any(r.name == name for r in self.pool.replicas)

    async def minute(self) -> None:
        self.now += 60
        for engine in self.engines.values():
            engine.tick()
        await self.monitor.refresh()

    def scrape(self) -> dict[Series, float]:
        text = generate_latest(self.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def counters(scrape: dict[Series, float]) -> dict[Series, float]:
    return {key: value for key, value in scrape.items() if key[0] in COUNTERS}


def test_a_replica_leaving_rotation_never_makes_a_counter_series_go_down() -> None:
    async def scenario() -> None:
        fleet = Fleet({"r0": 50_000, "r1": 40_000})
        steps: list[tuple[str, dict[Series, float]]] = []

        async def step(what: str) -> dict[Series, float]:
            await fleet.minute()
            scrape = fleet.scrape()
            steps.append((what, scrape))
            return scrape

        await step("both in rotation")
        await step("both in rotation")
        fleet.time_out("r0")
        suspect = await step("r0 timed out: out of rotation, its stats answer")
        fleet.engines["r0"].reachable = False
        await step("r0 unreachable: its breaker opens")
        unreachable = await step("r0 still unreachable")
        fleet.engines["r0"].reachable = True
        await step("r0's stats answer again (still suspect)")
        fleet.serve("r0")
        await step("r0 served a request: back in rotation")

        # No series of any counter ever goes down while no engine restarted.
        for (before_what, before), (after_what, after) in zip(steps, steps[1:]):
            for key, value in counters(after).items():
                if key in counters(before):
                    assert value >= counters(before)[key], (
                        f"{key[0]}{dict(key[1])} went down from {counters(before)[key]:g} ({before_what}) "
                        f"to {value:g} ({after_what}): Prometheus reads a reset")

        # One series per replica, kept (at its last report) while the replica is out of rotation.
        for _, scrape in steps:
            assert {dict(labels)["replica"] for name, labels in counters(scrape) if name == COUNTERS[0]} == {"r0", "r1"}
        offloaded = [scrape[(COUNTERS[0], (("pool", "p"), ("replica", "r0")))] for _, scrape in steps]
        assert offloaded == [50_000 + 240 * m for m in (1, 2, 3, 3, 3, 6, 7)]  # flat while unreachable
        for name, rate in PER_MINUTE.items():
            assert unreachable[(f"kvgate_pool_{name}_blocks_total", (("pool", "p"), ("replica", "r1")))] == 40_000 + rate * 5

        # The pool's gauges still count the replicas in rotation only (quota arithmetic).
        assert suspect[("kvgate_pool_blocks", (("pool", "p"), ("state", "max"), ("tier", "primary")))] == 10
        assert steps[-1][1][("kvgate_pool_blocks", (("pool", "p"), ("state", "max"), ("tier", "primary")))] == 20

    asyncio.run(scenario())


def test_a_restart_resets_only_its_own_series_and_a_removed_replica_loses_its_series() -> None:
    async def scenario() -> None:
        fleet = Fleet({"r0": 50_000, "r1": 40_000})
        await fleet.minute()
        fleet.engines["r0"].restart()
        await fleet.minute()
        scrape = counters(fleet.scrape())
        offloaded = {dict(labels)["replica"]: v for (name, labels), v in scrape.items() if name == COUNTERS[0]}
        assert offloaded == {"r0": 240, "r1": 40_000 + 2 * 240}  # r1's series does not see r0's reset

        fleet.remove("r1")
        await fleet.minute()
        scrape = counters(fleet.scrape())
        assert scrape and all(dict(labels)["replica"] == "r0" for _, labels in scrape)

    asyncio.run(scenario())
