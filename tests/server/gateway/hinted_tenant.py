"""A tenant whose pool points at a recording proxy and whose class allows hints (and, unless
told otherwise, the conversation hold; the run's-end demote only when told): the live hold and
demote tests look at what the gateway sends the engine for it."""

from __future__ import annotations

import secrets

from tenants import pools, retention_classes
from tests.server.gateway.conftest import TOKENS_PER_BLOCK
from tests.server.gateway.stack import ACTOR, MODEL, Stack


def add_hinted_tenant(stack: Stack, prefix: str, port: int, *, secondary_blocks: int, max_ttl_ms: int,
                      max_priority: int, conversation_hold: bool = True,
                      end_demote: bool = False) -> tuple[str, str]:
    """(a fresh suffix, the new tenant's API key): pool and class named ``<prefix>-<suffix>``,
    every priority of the class 35, hints on with the whole quota, the conversation hold as
    ``conversation_hold`` says and the run's-end demote as ``end_demote`` says. Keep
    ``max_ttl_ms`` short: the engine is shared with the rest of the suite and a duration cannot
    be revoked."""
    x = secrets.token_hex(3)
    name = f"{prefix}-{x}"
    with stack.session_factory() as session:
        pools.create_pool(session, actor=ACTOR, now=stack.now(), name=name, model_name=MODEL,
                          triton_url=f"127.0.0.1:{port}", engine_spec="reference-smollm2",
                          tokens_per_block=TOKENS_PER_BLOCK, primary_blocks=256, secondary_blocks=secondary_blocks,
                          secondary_offload_min_priority=30)
    with stack.session_factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=stack.now(), name=name,
                                       system_priority=35, context_priority=35, turn_priority=35,
                                       decode_priority=35, hints_enabled=True, hint_max_ttl_ms=max_ttl_ms,
                                       hint_max_priority=max_priority, hint_quota_fraction=1.0,
                                       conversation_hold_enabled=conversation_hold,
                                       conversation_end_demote_enabled=end_demote)
    return x, stack.add_tenant(name, pool=name, retention_class=name, kv_quota_fraction=1.0)
