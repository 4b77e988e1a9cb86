"""Client hints end to end on a deliberately small pool (reference engine, GPU + host tier).

A tenant whose class honours 1 h hints asks to keep one prompt (``prompt_cache_retention``
"24h") and not another; a noisy neighbour, whose class also honours hints, floods the GPU
with prompts it marks "24h" too. The hinted prompt survives the flood, the unhinted one
does not, and the neighbour's hints stop at its share of its quota (seen in the retention
ranges the engine receives, through a recording proxy).
"""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest

from engines.contract import parse_retention
from engines.reference.kserve import decode_inputs
from retention.hashing import block_hashes
from tenants import pools, retention_classes
from tests.server.gateway.recording_proxy import start_proxy
from tests.server.gateway.stack import ACTOR, MODEL, Stack, build_stack
from tests.server.gateway.test_openai_e2e import metric, system_prompt

pytestmark = pytest.mark.slow
TPB = 16
PRIMARY, SECONDARY = 48, 192
THRESHOLD = 30
HINT_PRIORITY = 60
ENGINE_ARGS = ["--tokens-per-block", str(TPB), "--primary-blocks", str(PRIMARY), "--secondary-blocks", str(SECONDARY),
               "--max-input-len", "512", "--max-output-len", "64", "--max-batch-size", "4",
               "--offload-min-priority", str(THRESHOLD)]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Stack:
    built = build_stack(tmp_path_factory.mktemp("hints"), engine_args=ENGINE_ARGS, tokens_per_block=TPB,
                        primary=PRIMARY, secondary=SECONDARY, offload_min_priority=THRESHOLD, engine_timeout=600.0)
    yield built
    built.gateway.stop()
    built.engine.kill()


def hinted_blocks(request, total: int) -> set[int]:  # type: ignore[no-untyped-def]
    """Indices of the full prompt blocks the engine was asked to keep at the hint priority."""
    plan = parse_retention(decode_inputs(request), total)
    return {b for b in range(total // TPB) if plan.retention_at(b * TPB)[0] == HINT_PRIORITY}


def hinted_hashes(request, total: int) -> set[int]:  # type: ignore[no-untyped-def]
    """The same blocks by their chained hash: one tenant's requests that share a prefix (the chat
    template's default system prompt) share these blocks, and the budget counts each once."""
    tensors = decode_inputs(request)
    chain = block_hashes(tuple(int(t) for t in tensors["input_ids"].tolist()), TPB)
    return {chain[b] for b in hinted_blocks(request, total)}


async def test_a_hinted_prefix_outlives_a_flood_and_the_neighbours_hints_stop_at_its_share(small: Stack) -> None:
    server, proxy, port = await start_proxy(f"127.0.0.1:{small.engine.port}")
    try:
        x = secrets.token_hex(3)
        pool = f"hinted-{x}"
        with small.session_factory() as session:
            pools.create_pool(session, actor=ACTOR, now=small.now(), name=pool, model_name=MODEL,
                              triton_url=f"127.0.0.1:{port}", engine_spec="reference-smollm2", tokens_per_block=TPB,
                              primary_blocks=PRIMARY, secondary_blocks=SECONDARY,
                              secondary_offload_min_priority=THRESHOLD)
        with small.session_factory() as session:
            # Unhinted blocks at 20, below the offload threshold: evicted means dropped.
            retention_classes.create_class(session, actor=ACTOR, now=small.now(), name=f"keep-{x}",
                                           system_priority=20, context_priority=20, turn_priority=20,
                                           decode_priority=20, hints_enabled=True, hint_max_ttl_ms=3_600_000,
                                           hint_max_priority=HINT_PRIORITY, hint_quota_fraction=0.5)
        with small.session_factory() as session:
            retention_classes.create_class(session, actor=ACTOR, now=small.now(), name=f"noisy-{x}",
                                           system_priority=35, context_priority=35, turn_priority=35,
                                           decode_priority=35, hints_enabled=True, hint_max_ttl_ms=3_600_000,
                                           hint_max_priority=HINT_PRIORITY, hint_quota_fraction=0.25)
        # keeper: quota 0.5 of 48 = 24 blocks, hints up to 12; neighbour: quota 48 (never demoted), hints up to 12.
        keeper = openai.AsyncOpenAI(api_key=small.add_tenant(f"keep-{x}", pool=pool, retention_class=f"keep-{x}",
                                                             kv_quota_fraction=0.5),
                                    base_url=small.gateway.base_url + "/v1", max_retries=0, timeout=120)
        noisy = openai.AsyncOpenAI(api_key=small.add_tenant(f"noisy-{x}", pool=pool, retention_class=f"noisy-{x}",
                                                            kv_quota_fraction=1.0),
                                   base_url=small.gateway.base_url + "/v1", max_retries=0, timeout=120)
        kept = [{"role": "system", "content": system_prompt(secrets.token_hex(4))},
                {"role": "user", "content": "Capital of Peru?"}]
        unhinted = [{"role": "system", "content": system_prompt(secrets.token_hex(4))},
                    {"role": "user", "content": "Capital of Chile?"}]

        async def ask(api, messages, **hints):  # type: ignore[no-untyped-def]
            before = len(proxy.requests)
            reply = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                                      **hints)
            (sent,) = [r for r in proxy.requests[before:] if any(i.name == "input_ids" for i in r.inputs)]
            return reply, sent

        first, sent = await ask(keeper, kept, prompt_cache_retention="24h", prompt_cache_key=f"conv-{x}")
        total = first.usage.prompt_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert hinted_blocks(sent, total) == set(range(total // TPB))  # every full block, within the budget of 12
        assert total // TPB <= 12
        other, sent = await ask(keeper, unhinted)
        assert other.usage.prompt_tokens_details.cached_tokens == 0 and not hinted_blocks(sent, other.usage.prompt_tokens)

        neighbour_hinted: set[int] = set()
        for _ in range(3):  # ~23 blocks each: the flood overruns the 48-block GPU tier
            words = " ".join(secrets.token_hex(3) for _ in range(60))
            reply, sent = await ask(noisy, [{"role": "user", "content": words}], prompt_cache_retention="24h")
            neighbour_hinted |= hinted_hashes(sent, reply.usage.prompt_tokens)
        assert len(neighbour_hinted) == 12  # 0.25 of its 48-block quota, then no more, however it asks

        again, _ = await ask(keeper, unhinted)
        assert again.usage.prompt_tokens_details.cached_tokens == 0  # evicted at 20: dropped
        kept_again, _ = await ask(keeper, kept, prompt_cache_retention="24h")
        # Kept at 60 through the flood: every full block but the last is reused (one prompt token is always computed).
        assert kept_again.usage.prompt_tokens_details.cached_tokens >= (total // TPB - 1) * TPB
        scrape = httpx.get(small.gateway.base_url + "/metrics").text
        hints = "kvgate_cache_hint_requests_total"
        assert metric(small, hints, scrape=scrape, tenant=f"keep-{x}", outcome="applied") == 2
        # Every flood prompt was cut by the budget ("clipped" while the shared template prefix still fits).
        assert metric(small, hints, scrape=scrape, tenant=f"noisy-{x}", outcome="applied") == 0
        assert metric(small, hints, scrape=scrape, tenant=f"noisy-{x}", outcome="clipped") + metric(
            small, hints, scrape=scrape, tenant=f"noisy-{x}", outcome="no_room") == 3
        assert metric(small, "kvgate_cache_hinted_blocks_total", scrape=scrape, tenant=f"noisy-{x}") >= 12
    finally:
        await server.stop(0)
