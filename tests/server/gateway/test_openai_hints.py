"""prompt_cache_retention / prompt_cache_key through the official openai SDK: accepted, and
the engine's retention ranges change only when the tenant's class honours hints."""

from __future__ import annotations

import secrets

import openai
import pytest

from engines.contract import parse_retention
from engines.reference.kserve import decode_inputs
from engines.tokenizer import load_gguf_tokenizer
from retention.policy.planner import RetentionClassSpec, SegmentRetention, Segments, plan_retention
from retention.types import TokenRange
from server.gateway.api.prompting import prepare_chat
from tenants import pools, retention_classes
from tests.server.gateway.recording_proxy import start_proxy
from tests.server.gateway.stack import ACTOR, MODEL, Stack
from tests.server.gateway.test_openai_e2e import system_prompt

pytestmark = pytest.mark.slow

THRESHOLD = 50
CLASS = RetentionClassSpec(SegmentRetention(90, None), SegmentRetention(60, 600_000), SegmentRetention(40, 30_000),
                           SegmentRetention(20, 30_000))  # the stack's "standard" class


def _classes(stack: Stack, suffix: str) -> tuple[str, str]:
    hinted, plain = f"hinted-{suffix}", f"plain-{suffix}"
    fields = dict(system_priority=90, context_priority=60, turn_priority=40, decode_priority=20)
    with stack.session_factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=stack.now(), name=hinted, hints_enabled=True,
                                       hint_max_ttl_ms=3_600_000, hint_max_priority=70, **fields)
    with stack.session_factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=stack.now(), name=plain, **fields)
    return hinted, plain


async def test_hint_fields_are_accepted_and_change_the_plan_only_when_the_class_allows(stack: Stack) -> None:
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    try:
        suffix = secrets.token_hex(3)
        pool_name = "hints-" + suffix
        with stack.session_factory() as session:
            pools.create_pool(session, actor=ACTOR, now=stack.now(), name=pool_name, model_name=MODEL,
                              triton_url=f"127.0.0.1:{port}", engine_spec="reference-smollm2",
                              tokens_per_block=stack.tokens_per_block, primary_blocks=256, secondary_blocks=512,
                              secondary_offload_min_priority=THRESHOLD)
        hinted_class, plain_class = _classes(stack, suffix)
        hinted = openai.AsyncOpenAI(api_key=stack.add_tenant("h-" + suffix, pool=pool_name, retention_class=hinted_class),
                                    base_url=stack.gateway.base_url + "/v1", max_retries=0)
        plain = openai.AsyncOpenAI(api_key=stack.add_tenant("p-" + suffix, pool=pool_name, retention_class=plain_class),
                                   base_url=stack.gateway.base_url + "/v1", max_retries=0)
        messages = [
            {"role": "system", "content": system_prompt(secrets.token_hex(4))},
            {"role": "user", "content": "Capital of Kenya?"},
            {"role": "assistant", "content": "Nairobi."},
            {"role": "user", "content": "And of Ghana?"},
        ]

        async def sent_tensors(api: openai.AsyncOpenAI, **extra):  # type: ignore[no-untyped-def]
            before = len(proxy.requests)
            await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, **extra)
            sent = [r for r in proxy.requests[before:] if any(i.name == "input_ids" for i in r.inputs)]
            assert len(sent) == 1
            return decode_inputs(sent[0])

        async def plan_of(api: openai.AsyncOpenAI, **extra):  # type: ignore[no-untyped-def]
            return parse_retention(await sent_tensors(api, **extra), prompt.total)

        def retention_bytes(tensors) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
            return {k: v.tobytes() for k, v in tensors.items() if k.startswith("retention_")}

        prompt = prepare_chat(load_gguf_tokenizer(), messages)
        base = plan_retention(CLASS, Segments(prompt.system_end, prompt.context_end, prompt.total),
                              offload_min_priority=THRESHOLD)
        # The openai SDK sends both fields as declared request parameters (no extra_body).
        assert await plan_of(hinted) == base
        assert await plan_of(hinted, prompt_cache_retention="in_memory", prompt_cache_key="conv-1") == base
        assert await plan_of(hinted, prompt_cache_key="conv-1") == base
        assert await plan_of(plain, prompt_cache_retention="24h", prompt_cache_key="conv-1") == base  # class says no
        # Byte for byte: the retention tensors the engine receives are the same with and without the fields.
        unhinted = retention_bytes(await sent_tensors(plain))
        assert unhinted and retention_bytes(await sent_tensors(plain, prompt_cache_retention="24h")) == unhinted
        assert retention_bytes(await sent_tensors(hinted, prompt_cache_retention="in_memory")) == unhinted

        got = await plan_of(hinted, prompt_cache_retention="24h", prompt_cache_key="conv-1")
        tpb = stack.tokens_per_block
        full = prompt.total // tpb * tpb  # hinted: full blocks only (the partial tail keeps the class's plan)
        assert full > prompt.system_end
        expected = [TokenRange(0, prompt.system_end, 90, None)]  # 90 is above the hint cap 70: kept
        if full < prompt.total:
            expected += [TokenRange(prompt.system_end, full, 70, 3_600_000), TokenRange(full, None, 40, 30_000)]
        else:
            expected += [TokenRange(prompt.system_end, None, 70, 3_600_000)]
        assert list(got.ranges) == expected
        assert (got.decode_priority, got.decode_duration_ms) == (20, 30_000)  # decode: the class's
        assert 70 >= THRESHOLD  # hinted blocks are offloaded to host on GPU eviction, not dropped

        with pytest.raises(openai.BadRequestError) as info:
            await hinted.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                 extra_body={"prompt_cache_retention": "forever"})
        assert info.value.body["param"] == "prompt_cache_retention"
    finally:
        await server.stop(0)
