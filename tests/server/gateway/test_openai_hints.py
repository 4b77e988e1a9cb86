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


async def test_a_request_without_hints_keeps_an_earlier_hints_hold_on_the_prefix_it_reuses(stack: Stack) -> None:
    """TensorRT-LLM gives a reused block the priority and duration of the request that uses it
    last, so a read without prompt_cache_retention must not drop a prefix the tenant asked to keep
    for 24 h (the class caps it at 1 h) to the class's plan: it is sent with the hint's priority
    for the rest of the hold. Another tenant's request over the same text is not touched."""
    server, proxy, port = await start_proxy(f"127.0.0.1:{stack.engine.port}")
    try:
        suffix = secrets.token_hex(3)
        name = "pins-" + suffix
        with stack.session_factory() as session:
            pools.create_pool(session, actor=ACTOR, now=stack.now(), name=name, model_name=MODEL,
                              triton_url=f"127.0.0.1:{port}", engine_spec="reference-smollm2",
                              tokens_per_block=stack.tokens_per_block, primary_blocks=256, secondary_blocks=512,
                              secondary_offload_min_priority=THRESHOLD)
        with stack.session_factory() as session:  # every segment 35: a hint (70) shows wherever it lands
            retention_classes.create_class(session, actor=ACTOR, now=stack.now(), name=name, system_priority=35,
                                           context_priority=35, turn_priority=35, decode_priority=35,
                                           hints_enabled=True, hint_max_ttl_ms=3_600_000, hint_max_priority=70)
        keeper, other = (openai.AsyncOpenAI(api_key=stack.add_tenant(f"{who}-{suffix}", pool=name,
                                                                   retention_class=name),
                                            base_url=stack.gateway.base_url + "/v1", max_retries=0)
                         for who in ("k", "o"))
        system = {"role": "system", "content": system_prompt(secrets.token_hex(4))}
        tokenizer = load_gguf_tokenizer()

        async def plan_of(api: openai.AsyncOpenAI, question: str, **extra):  # type: ignore[no-untyped-def]
            before = len(proxy.requests)
            messages = [system, {"role": "user", "content": question}]
            await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, **extra)
            sent = [r for r in proxy.requests[before:] if any(i.name == "input_ids" for i in r.inputs)]
            return parse_retention(decode_inputs(sent[0]), prepare_chat(tokenizer, messages).total)

        hinted = await plan_of(keeper, "Capital of Kenya?", prompt_cache_retention="24h")
        assert hinted.retention_at(0) == (70, 3_600_000), hinted.ranges
        # The blocks both prompts share: whole blocks of the system prompt.
        shared = prepare_chat(tokenizer, [system]).system_end // stack.tokens_per_block * stack.tokens_per_block
        assert shared >= stack.tokens_per_block
        later = await plan_of(keeper, "Capital of Ghana?")  # the same system prompt, no hint
        priority, duration = later.retention_at(0)
        assert priority == 70 and 3_500_000 < duration <= 3_600_000, later.ranges
        assert later.retention_at(shared - 1)[0] == 70
        assert later.retention_at(shared)[0] == 35, later.ranges  # past the shared blocks: the class's plan
        untouched = await plan_of(other, "Capital of Ghana?")
        assert {r.priority for r in untouched.ranges} == {35}, untouched.ranges  # another tenant: its class
    finally:
        await server.stop(0)
