"""A pool of real reference engines (one loaded model, several ports) behind real gateways.

Engines are ``start_reference_server`` instances on loopback ports sharing one
``ModelBundle`` (each has its own KV pool, scheduler and engine thread), so one can be
stopped mid-run like a crashed replica. Gateways are the app ``kvgate serve`` builds,
served by uvicorn over HTTP, against one migrated SQLite registry holding the pool and
its replicas.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import httpx

from engines.reference.config import ReferenceEngineConfig
from engines.reference.loader import ModelBundle
from retention.hashing import block_hashes
from retention.routing import ReplicaLoad, RouteRequest
from server.gateway.api.prompting import ChatPrompter
from server.gateway.replicas.routing import PoolRoute, Replica, RoutingConfig
from server.gateway.services import LoopIntervals
from server.serving import build_serving_app
from server.settings import Settings
from tenants import keys, migrate, pools, replicas, retention_classes, tenant
from tenants.db import make_engine, make_session_factory
from tests.engines.reference.conftest import ServerHandle, start_in_thread, stop_in_thread
from tests.server.gateway.stack import GatewayServer, free_port

ACTOR = "test:fleet"
MODEL = "smollm2-135m-instruct"
POOL = "fleet"
TPB = 16
ENGINE = dict(kv_dtype="fp8_e4m3", primary_blocks=256, secondary_blocks=0, tokens_per_block=TPB,
              max_batch_size=8, max_num_tokens=256, max_input_len=768, max_output_len=160,
              # These tests are about routing: every request a replica is sent starts at once
              # (admitted on its prompt), so a flood loads the replica it was sent to at once.
              scheduler_policy="max_utilization")
PEPPER = "fleet-pepper-" + secrets.token_hex(16)


@dataclass
class Fleet:
    bundle: ModelBundle
    engines: dict[str, tuple[ServerHandle, object]]  # replica name -> (server, its loop thread)
    session_factory: object
    gateways: list[GatewayServer] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)
    salts: dict[str, str | None] = field(default_factory=dict)

    # Registry ---------------------------------------------------------------------------
    def add_tenant(self, slug: str, *, isolation: str = "salted", **limits: int) -> str:
        """``limits``: registry limit columns (e.g. ``max_concurrent_requests=2``)."""
        now = datetime.now(UTC)
        with self.session_factory() as session:
            row = tenant.create_tenant(session, actor=ACTOR, now=now, slug=slug, display_name=slug, pool=POOL,
                                       retention_class="chat", isolation=isolation, **limits)
            self.salts[slug] = None if isolation == "shared" else row.cache_salt
        with self.session_factory() as session:
            created = keys.create_key(session, actor=ACTOR, now=now, tenant=slug, pepper=PEPPER, name="t")
        self.keys[slug] = created[1] if isinstance(created, tuple) else created.plaintext
        return self.keys[slug]

    def set_state(self, replica: str, state: str) -> None:
        with self.session_factory() as session:
            replicas.set_state(session, actor=ACTOR, now=datetime.now(UTC), pool=POOL, name=replica, state=state)

    def remove(self, replica: str) -> None:
        with self.session_factory() as session:
            replicas.remove_replica(session, actor=ACTOR, now=datetime.now(UTC), pool=POOL, name=replica)

    def hang(self, replica: str, hold_ms: int = -1) -> None:
        """Fault knob: the replica's engine accepts new requests and holds them (-1: until
        cancelled) while its stats call keeps answering (``fault_first_token_hold_ms``)."""
        self.engines[replica][0].engine.config.fault_first_token_hold_ms = hold_ms

    def engine_in_flight(self, replica: str) -> int:
        """Requests the replica's engine itself holds (held ones included)."""
        return self.engines[replica][0].engine.in_flight()

    def stop_engine(self, replica: str) -> None:
        handle, thread = self.engines.pop(replica)
        stop_in_thread(handle, thread)

    def kill_engine(self, replica: str) -> None:
        """Stop the replica's server at once (no grace): its in-flight calls are aborted."""
        handle, thread = self.engines.pop(replica)
        asyncio.run_coroutine_threadsafe(handle.running.stop(grace=None), handle.loop).result(60)
        handle.loop.call_soon_threadsafe(handle.loop.stop)
        thread.join(10)

    # Gateways ---------------------------------------------------------------------------
    def route(self, gateway: int = 0) -> PoolRoute:
        return self.gateways[gateway].app.state.gateway.routing.pools[POOL]

    def replica(self, name: str, gateway: int = 0) -> Replica | None:
        return next((r for r in self.route(gateway).replicas.values() if r.name == name), None)

    def wait_state(self, name: str, state: str | None, gateway: int = 0) -> None:
        """Wait until the gateway has taken ``name``'s registry state (None: removed)."""
        def seen() -> bool:
            replica = self.replica(name, gateway)
            return replica is None if state is None else replica is not None and replica.state == state
        self.wait_until(seen, what=f"{name} {state}")

    def chat(self, slug: str, messages: list[dict], *, gateway: int = 0, max_tokens: int = 4,
             client: httpx.Client | None = None, stream: bool = False) -> httpx.Response:
        """One chat completion; ``stream``: the SSE body is read whole (``response.text``)."""
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        headers = {"Authorization": f"Bearer {self.keys[slug]}"}
        url = f"{self.gateways[gateway].base_url}/v1/chat/completions"
        if client is not None:
            return client.post(url, json=body, headers=headers, timeout=300)
        return httpx.post(url, json=body, headers=headers, timeout=300)

    def prompt_hashes(self, slug: str, messages: list[dict]) -> tuple[int, ...]:
        """The prompt's block hashes as the gateway computes them (tenant's salt included)."""
        ids = ChatPrompter(self.bundle.tokenizer).chat(messages).input_ids
        return tuple(block_hashes(ids, TPB, salt=self.salts[slug]))

    def holders(self, hashes: tuple[int, ...], *, gateway: int = 0) -> dict[str, int]:
        """Replica name -> leading blocks of ``hashes`` its index holds (this gateway's view)."""
        route = self.route(gateway)
        return {r.name: route.router.match(r.id, hashes, now=0.0).blocks for r in route.replicas.values()}

    def wait_indexed(self, hashes: tuple[int, ...], blocks: int, *, gateways=(0,), timeout: float = 60.0) -> str:
        """Wait until every listed gateway's index shows ``blocks`` leading blocks on one replica.

        Returns the replica holding the longest prefix (by the first gateway's view).
        """
        deadline = time.monotonic() + timeout
        while True:
            views = [self.holders(hashes, gateway=g) for g in gateways]
            names = [{n for n, b in v.items() if b >= blocks} for v in views]
            common = set.intersection(*names)
            if common:
                return max(sorted(common), key=lambda name: views[0][name])
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefix never indexed: {views}")
            time.sleep(0.05)

    def wait_until(self, predicate, timeout: float = 60.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached")
            time.sleep(0.05)

    def decide(self, slug: str, messages: list[dict], *, gateway: int = 0, idle: bool = False) -> str:
        """The replica this gateway's router would choose now for this prompt (no dispatch).

        ``idle``: every candidate's load given as zero, so the choice rests on the block
        index and the tie-break alone (each gateway's load is its own dispatch history).
        """
        route = self.route(gateway)
        hashes = self.prompt_hashes(slug, messages)
        candidates = route.candidates(set())
        if idle:
            candidates = [replace(c, load=ReplicaLoad(0, 0, 0, 0.0)) for c in candidates]
        decision = route.router.route(RouteRequest("probe", hashes, max(1, len(hashes) * TPB), 4),
                                      candidates, now=0.0)
        return route.replicas[decision.replica].name

    def metric(self, name: str, gateway: int = 0, **labels: str) -> float:
        text = httpx.get(f"{self.gateways[gateway].base_url}/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{"):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        for name in list(self.engines):
            self.stop_engine(name)


def start_fleet(tmp: Path, bundle: ModelBundle, *, replicas_count: int = 3, gateways: int = 1,
                settings: dict | None = None, wrap=None, routing: RoutingConfig | None = None) -> Fleet:
    """``settings``: extra gateway ``Settings`` fields (e.g. ``first_token_timeout_s``);
    ``wrap``: app -> the ASGI app uvicorn serves instead (a test middleware around it);
    ``routing``: the gateways' routing (None: the defaults)."""
    engines = {f"r{i}": start_in_thread(ReferenceEngineConfig(**ENGINE), bundle) for i in range(replicas_count)}
    url = f"sqlite:///{tmp / 'registry.db'}"
    migrate.upgrade(url=url)
    factory = make_session_factory(make_engine(url))
    now = datetime.now(UTC)
    with factory() as session:
        pools.create_pool(session, actor=ACTOR, now=now, name=POOL, model_name=MODEL, engine_spec="reference-smollm2",
                          tokens_per_block=TPB, primary_blocks=ENGINE["primary_blocks"], secondary_blocks=0,
                          secondary_offload_min_priority=30,
                          replicas=[{"name": name, "endpoint": handle.url} for name, (handle, _) in engines.items()])
    with factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=now, name="chat", system_priority=90,
                                       context_priority=60, turn_priority=40, decode_priority=20)
    fleet = Fleet(bundle, engines, factory)
    app_settings = Settings(database_url=url, admin_tokens=[f"ci:admin-{secrets.token_hex(8)}"], key_pepper=PEPPER,
                            **(settings or {}))
    for _ in range(gateways):
        app = build_serving_app(app_settings, session_factory=factory, tokenizer_for=lambda pool: bundle.tokenizer,
                                auth_ttl=0.2, intervals=LoopIntervals(usage_flush=0.5, last_used_flush=1.0,
                                                                      pool_poll=0.1), routing=routing)
        server = GatewayServer(app, free_port(), asgi=None if wrap is None else wrap(app))
        server.start()
        fleet.gateways.append(server)
    return fleet
