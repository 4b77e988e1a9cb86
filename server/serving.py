"""The whole serving app: admin API + gateway on one registry, as ``kvgate serve`` runs it.

``build_serving_app`` is the one composition root; tests and the CLI both call it, so
what the tests exercise is what users run.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from engines.tokenizer import ChatTokenizer, default_gguf_path, load_gguf_tokenizer
from retention.routing import CostModel
from server.app import create_app
from server.gateway.admission import Admission, LocalAdmission, RedisAdmission
from server.gateway.app import install_gateway, registry_pools_and_tenants
from tenants.snapshots import PoolSnapshot
from server.gateway.errors import ServingError
from server.gateway.replicas.peer_sync import PeerSync
from server.gateway.replicas.routing import RoutingConfig
from server.gateway.services import LoopIntervals, build_gateway_services
from server.gateway.usage_journal import registry_fingerprint
from server.settings import Settings
from tenants.db import make_engine, make_session_factory

REFERENCE_SPECS = frozenset({"", "reference", "reference-smollm2"})


def default_tokenizer_for(pool: PoolSnapshot) -> ChatTokenizer:
    """The reference pool's tokenizer comes from its GGUF; GPU specs name their own."""
    if pool.engine_spec in REFERENCE_SPECS:
        return load_gguf_tokenizer(default_gguf_path())
    try:
        from engines.hf_tokenizer import load_spec_tokenizer  # GPU specs: the checkpoint's tokenizer.json

        return load_spec_tokenizer(pool.engine_spec)
    except Exception as exc:  # noqa: BLE001 - any failure is a configuration problem, not the client's
        raise ServingError(503, "tokenizer_unavailable",
                           f"no tokenizer available for engine spec '{pool.engine_spec}' of pool '{pool.name}': {exc}") from exc


def routing_config(settings: Settings) -> RoutingConfig:
    """The gateway's routing, deadline and breaker settings from ``KVGATE_*``."""
    return RoutingConfig(
        router=settings.router,
        cost=CostModel(overlap_weight=settings.router_overlap_weight, temperature=settings.router_temperature),
        first_token_timeout_s=settings.first_token_timeout_s,
        inter_token_timeout_s=settings.inter_token_timeout_s,
        answer_timeout_per_token_s=settings.answer_timeout_per_token_s,
        breaker_open_s=settings.breaker_open_s, breaker_max_open_s=settings.breaker_max_open_s,
    )


def build_serving_app(settings: Settings, *, session_factory: sessionmaker[Session] | None = None,
                      tokenizer_for: Callable[[PoolSnapshot], ChatTokenizer] = default_tokenizer_for,
                      admission: Admission | None = None, registry: CollectorRegistry | None = None,
                      auth_ttl: float = 5.0, intervals: LoopIntervals | None = None,
                      routing: RoutingConfig | None = None) -> FastAPI:
    engine = None
    if session_factory is None:
        engine = make_engine(settings.database_url)
        session_factory = make_session_factory(engine)
    app = create_app(settings, engine=engine, session_factory=session_factory)
    if admission is None:
        admission = (RedisAdmission(settings.redis_url, namespace=settings.redis_namespace,
                                    lease_ttl_s=settings.admission_lease_ttl_s)
                     if settings.redis_url else LocalAdmission())
    services = build_gateway_services(
        session_factory=session_factory, pepper=settings.effective_key_pepper(), tokenizer_for=tokenizer_for,
        admission=admission, registry=registry or CollectorRegistry(),
        pools_and_tenants=registry_pools_and_tenants(session_factory), auth_ttl=auth_ttl, intervals=intervals,
        mrc_sample_rate=settings.mrc_sample_rate,
        trace_dir=settings.trace_dir,
        routing=routing or routing_config(settings),
        usage_journal_dir=settings.usage_journal_dir if settings.usage_journal else None,
        usage_journal_fsync=settings.usage_journal_sync == "fsync",
        registry_id=registry_fingerprint(settings.database_url),
        responses_ttl_s=settings.responses_ttl_s, responses_max_bytes=settings.responses_max_bytes,
        peer_sync=PeerSync(settings.redis_url, namespace=settings.redis_namespace, lease_s=settings.routing_sync_lease_s)
        if settings.routing_sync and settings.redis_url else None,
    )
    return install_gateway(app, services)
