"""Request extensions through the official openai SDK against the live stack (reference engine):
structured outputs, forced tool calls, log probabilities, sampling extensions."""

from __future__ import annotations

import json
import secrets

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel

from engines.reference.kv_cache import KvDtype, PagedKvCache
from engines.reference.loader import load_model
from engines.reference.model import DecodeGroup, PrefillSpan, StepBatch
from server.gateway.api.prompting import ChatPrompter
from tests.server.gateway.stack import MODEL, Stack

pytestmark = pytest.mark.slow


def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    slug = "s-" + secrets.token_hex(4)
    return stack.add_tenant(slug, max_output_tokens=512, rpm_limit=100000, tpm_limit=100000000)


class Person(BaseModel):
    name: str
    age: int
    city: str


PEOPLE = [("Alice", 31, "Paris"), ("Bob", 45, "Berlin"), ("Chen", 28, "Shanghai"), ("Dana", 52, "Denver"),
          ("Emeka", 39, "Lagos"), ("Farah", 24, "Cairo"), ("Goran", 61, "Zagreb"), ("Hana", 33, "Tokyo"),
          ("Ivan", 47, "Moscow"), ("Julia", 29, "Madrid"), ("Kofi", 36, "Accra"), ("Lena", 41, "Vienna"),
          ("Mateo", 22, "Lima"), ("Nora", 58, "Oslo"), ("Omar", 44, "Dubai"), ("Priya", 27, "Mumbai"),
          ("Quinn", 35, "Dublin"), ("Rosa", 63, "Rome"), ("Sven", 50, "Stockholm"), ("Tariq", 30, "Karachi")]


def test_parse_with_a_pydantic_model_validates_20_of_20(stack: Stack, key: str) -> None:
    api = client(stack, key)
    valid = 0
    for name, age, city in PEOPLE:
        completion = api.beta.chat.completions.parse(
            model=MODEL, temperature=0, max_tokens=64, response_format=Person,
            # Like OpenAI's own guidance for JSON mode, the prompt asks for JSON: the grammar makes every
            # answer valid JSON for the schema, but cannot make this 135M model close a string it is in
            # (any text is legal inside one); without the hint 3 of these 20 ran into max_tokens.
            messages=[{"role": "system", "content": "Reply with one JSON object holding the name, age and city "
                                                    "of the person the user describes."},
                      {"role": "user", "content": f"{name} is {age} years old and lives in {city}."}],
        )
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Person), completion.choices[0].message.content
        valid += 1
    assert valid == 20


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                         "required": ["tz"]}}}


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_call_returns_valid_arguments_streaming_and_not(stack: Stack, key: str, choice) -> None:
    api = client(stack, key)
    messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    tools = [WEATHER] if choice != "required" else [WEATHER, CLOCK]
    completion = api.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                             temperature=0, max_tokens=64)
    [call] = completion.choices[0].message.tool_calls
    assert completion.choices[0].finish_reason == "tool_calls"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # streaming: delta.tool_calls accumulated the way clients do
    name, arguments, finish = None, "", None
    for chunk in api.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                             temperature=0, max_tokens=64, stream=True):
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or ():
            name = part.function.name or name
            arguments += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and name == call.function.name
    jsonschema.validate(json.loads(arguments), schema)
    # the tool result goes back as a `tool` message and the model answers in text
    follow = api.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24, tools=tools,
        messages=[*messages, completion.choices[0].message,
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "sunny"})}],
    )
    assert follow.choices[0].message.content


def test_a_forced_call_beside_a_response_format_is_the_call(stack: Stack, key: str) -> None:
    """tool_choice required with a JSON response_format (as openai-agents sends for an Agent with an
    output type on a turn that must call a tool): the forced call's guide applies, the answer is a call."""
    api = client(stack, key)
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": {
        "type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}}}
    completion = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather like in Paris today?"}],
        tools=[WEATHER], tool_choice="required", response_format=fmt, temperature=0, max_tokens=64)
    [call] = completion.choices[0].message.tool_calls
    assert completion.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_forced_call_cut_short_is_an_empty_answer_never_the_guides_wrapper(stack: Stack, key: str) -> None:
    """max_tokens stops the forced call inside its ``{"name": …}`` wrapper: no tool call, no text."""
    api = client(stack, key)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "What's the weather like in Paris today?"}],
               tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=3)
    choice = api.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert not choice.message.content, choice.message.content
    streamed = [c.choices[0] for c in api.chat.completions.create(**ask, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in streamed) == ""
    assert streamed[-1].finish_reason == "length" and not any(c.delta.tool_calls for c in streamed)


@pytest.fixture(scope="module")
def bundle():
    torch.set_num_threads(1)
    return load_model(weight_format="q4")  # as `kvgate engine serve` loads it (the stack's engine)


def _greedy_log_softmax(bundle, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with the engine's model, scheduled independently: one prefill of the prompt,
    then one decode step per token over a plain (unpaged, unshared) FP8 cache like the stack's."""
    n = len(ids)
    cache = PagedKvCache(bundle.geometry(16), KvDtype.FP8_E4M3, primary_blocks=-(-(n + steps) // 16) + 1,
                         scales=bundle.kv_scales(KvDtype.FP8_E4M3), compute_dtype=bundle.model.dtype)
    slots = torch.arange(n)
    logits = bundle.model.forward(StepBatch(torch.tensor(ids), torch.arange(n), slots, [PrefillSpan(0, n, slots, 0)],
                                            logit_rows=torch.tensor([n - 1])), cache)
    out_ids, rows = [], []
    for position in range(n, n + steps):
        row = torch.log_softmax(logits[0].float(), dim=-1)
        token = int(row.argmax())
        out_ids.append(token)
        rows.append(row)
        logits = bundle.model.forward(StepBatch(
            torch.tensor([token]), torch.tensor([position]), torch.tensor([position]),
            decode=DecodeGroup(0, torch.arange(position + 1).unsqueeze(0),
                               torch.ones(1, 1, 1, position + 1, dtype=torch.bool)),
            logit_rows=torch.tensor([0]),
        ), cache)
    return out_ids, rows


def test_logprobs_match_the_models_log_softmax(stack: Stack, key: str, bundle) -> None:
    # a nonce: no cached prefix from other tests, so the engine computes this prompt as we do
    messages = [{"role": "user", "content": f"[{secrets.token_hex(3)}] Name three colours."}]
    completion = client(stack, key).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    content = completion.choices[0].logprobs.content
    prompt = ChatPrompter(bundle.tokenizer).chat(messages).input_ids
    expected_ids, rows = _greedy_log_softmax(bundle, list(prompt), 5)
    assert len(content) == 5
    for entry, token, row in zip(content, expected_ids, rows):
        # same weights, same FP8 KV, same kernels per step shape: only block layout and batching differ
        assert entry.logprob == pytest.approx(float(row[token]), abs=0.02)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    joined = b"".join(bytes(e.bytes) for e in content).decode()
    assert joined == completion.choices[0].message.content == bundle.tokenizer.decode(expected_ids)
    text = client(stack, key).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                                 temperature=0, logprobs=2)
    block = text.choices[0].logprobs
    assert len(block.tokens) == len(block.token_logprobs) == len(block.top_logprobs) == 3
    assert "".join(block.tokens) == text.choices[0].text


def test_streamed_logprobs_and_continuous_usage(stack: Stack, key: str) -> None:
    api = client(stack, key)
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Count to five."}], temperature=0, max_tokens=8,
                logprobs=True, top_logprobs=1)
    api.chat.completions.create(**args)  # warm the prefix cache: both runs below then compute the same way
    whole = api.chat.completions.create(**args)
    entries, usages = [], []
    for chunk in api.chat.completions.create(**args, stream=True,
                                             stream_options={"include_usage": True, "continuous_usage_stats": True}):
        if chunk.usage is not None:
            usages.append(chunk.usage.completion_tokens)
        if chunk.choices and chunk.choices[0].logprobs is not None:
            entries.extend(chunk.choices[0].logprobs.content or ())
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content])
    assert usages == sorted(usages) and usages[-1] == whole.usage.completion_tokens and len(usages) > 2


def test_penalties_min_tokens_and_ignore_eos_change_the_output(stack: Stack, key: str) -> None:
    api = client(stack, key)
    short = [{"role": "user", "content": "Write yes yes yes yes yes"}]
    plain = api.chat.completions.create(model=MODEL, messages=short, temperature=0, max_tokens=32)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 16
    longer = api.chat.completions.create(model=MODEL, messages=short, temperature=0, max_tokens=32,
                                         extra_body={"min_tokens": plain.usage.completion_tokens + 8})
    assert longer.usage.completion_tokens >= plain.usage.completion_tokens + 8
    fixed = api.chat.completions.create(model=MODEL, messages=short, temperature=0, max_tokens=20,
                                        extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == 20 and fixed.choices[0].finish_reason == "length"
    counting = [{"role": "user", "content": "List the numbers from 1 to 10."}]
    base = api.chat.completions.create(model=MODEL, messages=counting, temperature=0, max_tokens=12)
    for extra in ({"presence_penalty": 2.0, "frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 3.0}}):
        changed = api.chat.completions.create(model=MODEL, messages=counting, temperature=0, max_tokens=12, **extra)
        assert changed.choices[0].message.content != base.choices[0].message.content, extra
    top = api.chat.completions.create(model=MODEL, messages=counting, temperature=0, max_tokens=1, logprobs=True)
    banned = api.chat.completions.create(model=MODEL, messages=counting, temperature=0, max_tokens=1, logprobs=True,
                                         logit_bias={str(_token_id(stack, key, top)): -100})
    assert banned.choices[0].logprobs.content[0].token != top.choices[0].logprobs.content[0].token


def _token_id(stack: Stack, key: str, completion) -> int:
    from engines.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer()
    return tokenizer.encode(bytes(completion.choices[0].logprobs.content[0].bytes).decode())[0]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("extra", "status", "code"),
    [
        ({"service_tier": "auto", "user": "u1", "metadata": {"a": "b"}, "prompt_cache_key": "k"}, 200, None),
        ({"audio": {"voice": "alloy", "format": "wav"}}, 400, "unsupported_parameter"),
        ({"reasoning_effort": "low"}, 400, "unsupported_parameter"),
        ({"functions": [{"name": "f"}]}, 400, "unsupported_parameter"),
        ({"n": 2}, 400, "invalid_request"),
        ({"top_logprobs": 2}, 400, "invalid_request"),  # without logprobs
        ({"tool_choice": "required"}, 400, "invalid_request"),  # without tools
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         400, "invalid_request"),  # the guided decoder's refusal, naming response_format
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
         400, "invalid_request"),  # the guided decoder's refusal, naming response_format
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}},
         400, "invalid_request"),  # the guided decoder's refusal, naming response_format
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
         400, "invalid_request"),  # the guided decoder's refusal, naming response_format
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}},
         400, "invalid_request"),  # the guided decoder's refusal, naming response_format
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(70)}}},
         400, "invalid_request"),
        ({"logit_bias": {"abc": 1}}, 400, "invalid_request"),
        ({"logit_bias": {"999999": 1}}, 400, "invalid_request"),
        ({"min_tokens": 2, "ignore_eos": True, "top_k": 5, "repetition_penalty": 1.1}, 200, None),
        ({"min_tokens": 3}, 400, "invalid_request"),  # above max_tokens 2
        # a guide never ends under ignore_eos on the GPU engine: refused on every pool (engines/contract.py)
        ({"ignore_eos": True, "response_format": {"type": "json_object"}}, 400, "invalid_request"),
    ],
)
def test_fields_are_honoured_ignored_or_refused_by_name(stack: Stack, key: str, extra, status, code) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    response = httpx.post(stack.gateway.base_url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert response.status_code == status, response.text
    if code is not None:
        assert response.json()["error"]["code"] == code
        if "response_format" in extra and status == 400 and not extra.get("ignore_eos"):
            assert response.json()["error"]["param"] == "response_format", response.text
