"""Tool calls at the edges, through the official ``openai`` SDK against the live stack (reference
engine), on both OpenAI dialects: output cut by its limit in the middle of a call, an output format
with tools the model may call (the format's JSON or calls), function names and parameter schemas."""

from __future__ import annotations

import json
import secrets

import jsonschema
import openai
import pytest

from tests.server.gateway.stack import MODEL, Stack
from tests.server.gateway.test_openai_e2e import client

pytestmark = pytest.mark.slow

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                                 "parameters": PARAMETERS}}
PAIRS = (("Oslo", "Paris"), ("Rome", "Berlin"), ("Madrid", "Vienna"))


@pytest.fixture
def key(stack: Stack) -> str:
    return stack.add_tenant("tl-" + secrets.token_hex(4))


def _items() -> list[dict]:
    """A few-shot history whose assistant answers with two parallel calls (the 135M model copies it)."""
    items: list[dict] = []
    for i, (a, b) in enumerate(PAIRS):
        items += [{"role": "user", "content": f"Weather in {a} and {b}?"},
                  {"type": "function_call", "call_id": f"c{i}a", "name": "get_weather", "arguments": json.dumps({"city": a})},
                  {"type": "function_call", "call_id": f"c{i}b", "name": "get_weather", "arguments": json.dumps({"city": b})},
                  {"type": "function_call_output", "call_id": f"c{i}a", "output": "sunny"},
                  {"type": "function_call_output", "call_id": f"c{i}b", "output": "rain"},
                  {"role": "assistant", "content": f"{a} is sunny, {b} has rain."}]
    return items + [{"role": "user", "content": "Weather in London and Dublin?"}]


def _messages() -> list[dict]:
    """The same history as chat messages."""
    messages: list[dict] = []
    for i, (a, b) in enumerate(PAIRS):
        calls = [{"id": f"c{i}{s}", "type": "function",
                  "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}} for s, c in (("a", a), ("b", b))]
        messages += [{"role": "user", "content": f"Weather in {a} and {b}?"},
                     {"role": "assistant", "content": "", "tool_calls": calls},
                     {"role": "tool", "tool_call_id": f"c{i}a", "content": "sunny"},
                     {"role": "tool", "tool_call_id": f"c{i}b", "content": "rain"},
                     {"role": "assistant", "content": f"{a} is sunny, {b} has rain."}]
    return messages + [{"role": "user", "content": "Weather in London and Dublin?"}]


def test_chat_calls_cut_by_max_tokens_finish_with_length(stack: Stack, key: str) -> None:
    """OpenAI's finish reason for output its limit cut is "length", tool calls or not: the call cut short
    is not reported as a finished "tool_calls" answer, and the calls that were whole are still listed."""
    api = client(stack, key)
    ask = dict(model=MODEL, messages=_messages(), tools=[CHAT_WEATHER], temperature=0)
    whole = api.chat.completions.create(**ask, max_tokens=200)
    assert whole.choices[0].finish_reason == "tool_calls" and len(whole.choices[0].message.tool_calls) == 2
    limit = whole.usage.completion_tokens - 3  # inside the second call's closing tag
    cut = api.chat.completions.create(**ask, max_tokens=limit)
    assert cut.usage.completion_tokens == limit
    choice = cut.choices[0]
    assert choice.finish_reason == "length"
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == \
        [json.loads(whole.choices[0].message.tool_calls[0].function.arguments)]
    finish, calls = None, 0
    for chunk in api.chat.completions.create(**ask, max_tokens=limit, stream=True):
        if chunk.choices:
            calls += len(chunk.choices[0].delta.tool_calls or ())
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and calls == 1


def test_responses_cut_by_max_output_tokens_are_incomplete(stack: Stack, key: str) -> None:
    api = client(stack, key)
    ask = dict(model=MODEL, input=_items(), tools=[WEATHER], temperature=0, store=False)
    whole = api.responses.create(**ask, max_output_tokens=200)
    assert whole.status == "completed" and [o.type for o in whole.output] == ["function_call", "function_call"]
    limit = whole.usage.output_tokens - 3
    cut = api.responses.create(**ask, max_output_tokens=limit)
    assert cut.usage.output_tokens == limit
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in cut.output] == ["function_call"] and cut.output[0].arguments == whole.output[0].arguments
    events = list(api.responses.create(**ask, max_output_tokens=limit, stream=True))
    assert events[-1].type == "response.incomplete", [e.type for e in events]
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in events[-1].response.output] == ["function_call"]


ANSWER = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 60}}, "required": ["text"],
          "additionalProperties": False}


def _either_shape(calls: list[tuple[str, str]], text: str | None, *, parallel: bool = True) -> str:
    """The output under a format with tools the model may call: tool calls to the defined function with
    arguments that follow its schema, and no text; or no call and text that is the format's JSON."""
    if calls:
        assert not text, text
        assert parallel or len(calls) == 1, calls
        for name, arguments in calls:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), PARAMETERS)
        return "calls"
    jsonschema.validate(json.loads(text), ANSWER)
    return "json"


def test_a_json_format_with_tools_the_model_may_call_answers_either_shape(stack: Stack, key: str) -> None:
    """A format with tool_choice auto (openai-agents' Agent with output_type and tools) is served: the
    guide allows the format's JSON or tool-call blocks, and whichever the model writes parses — calls
    with finish reason "tool_calls", or the JSON answer. Which one the 135M model picks is its own
    business; the shapes are checked, on both OpenAI dialects, streamed and not."""
    api = client(stack, key)
    fmt = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": ANSWER, "strict": True}}
    asks = ((_messages(), {}), (_messages(), {"parallel_tool_calls": False}),
            ([{"role": "user", "content": "Answer in JSON: what is the capital of France?"}], {}))
    for messages, extra in asks:
        parallel = extra.get("parallel_tool_calls", True)
        ask = dict(model=MODEL, messages=messages, tools=[CHAT_WEATHER], temperature=0, max_tokens=160,
                   response_format=fmt, **extra)
        choice = api.chat.completions.create(**ask).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        shape = _either_shape(calls, choice.message.content, parallel=parallel)
        assert choice.finish_reason == ("tool_calls" if shape == "calls" else "stop")
        text, streamed, finish = "", {}, None
        for chunk in api.chat.completions.create(**ask, stream=True):
            if chunk.choices:
                delta = chunk.choices[0].delta
                text += delta.content or ""
                for call in delta.tool_calls or ():
                    name, arguments = streamed.get(call.index, ("", ""))
                    streamed[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
                finish = chunk.choices[0].finish_reason or finish
        assert _either_shape([streamed[i] for i in sorted(streamed)], text, parallel=parallel) == shape
        assert finish == choice.finish_reason
    # the Responses dialect: function_call items, or a message whose text is the format's JSON
    for extra in ({}, {"parallel_tool_calls": False}):
        reply = api.responses.create(model=MODEL, input=_items(), tools=[WEATHER], temperature=0, max_output_tokens=160,
                                     store=False, text={"format": {"type": "json_schema", "name": "Answer",
                                                                   "schema": ANSWER, "strict": True}}, **extra)
        assert reply.status == "completed"
        calls = [(o.name, o.arguments) for o in reply.output if o.type == "function_call"]
        _either_shape(calls, reply.output_text, parallel=not extra)
    # tools shown but never called: the format's own guide
    shown = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                        tools=[CHAT_WEATHER], tool_choice="none",
                                        response_format={"type": "json_object"})
    assert shown.choices[0].finish_reason in ("stop", "length")


def test_a_format_with_tools_refuses_what_the_combined_grammar_cannot_carry(stack: Stack, key: str) -> None:
    """A schema pattern has no JSON-safe form in TensorRT-LLM's xgrammar (0.1.25): a 400 naming the field."""
    api = client(stack, key)
    coded = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
             "required": ["code"]}
    with pytest.raises(openai.BadRequestError) as chat:
        api.chat.completions.create(model=MODEL, messages=_messages(), tools=[CHAT_WEATHER], max_tokens=8,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "Answer", "schema": coded}})
    assert chat.value.body["param"] == "response_format" and "pattern" in chat.value.body["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        api.responses.create(model=MODEL, input="Hi", max_output_tokens=8, store=False,
                             tools=[WEATHER, {"type": "function", "name": "lookup", "parameters": coded}],
                             text={"format": {"type": "json_object"}})
    assert responses.value.body["param"] == "tools.1.parameters"


def test_function_names_and_parameter_schemas_are_checked_on_both_dialects(stack: Stack, key: str) -> None:
    api = client(stack, key)
    for name in ('get"weather', "get weather", "get\nweather"):
        with pytest.raises(openai.BadRequestError) as caught:
            api.responses.create(model=MODEL, input="Weather in Oslo?", tools=[{**WEATHER, "name": name}],
                                 tool_choice={"type": "function", "name": name}, max_output_tokens=8, store=False)
        assert caught.value.body["param"] == "tools.0.name", name
    with pytest.raises(openai.BadRequestError) as choice:
        api.responses.create(model=MODEL, input="Hi", tools=[WEATHER], max_output_tokens=8, store=False,
                             tool_choice={"type": "function", "name": "get weather"})
    assert choice.value.body["param"] == "tool_choice.name"
    scalar = {"type": "string"}
    with pytest.raises(openai.BadRequestError) as responses:
        api.responses.create(model=MODEL, input="Hi", tools=[{**WEATHER, "parameters": scalar}], max_output_tokens=8,
                             store=False)
    assert responses.value.body["param"] == "tools.0.parameters" and '"object"' in responses.value.body["message"]
    with pytest.raises(openai.BadRequestError) as chat:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                    tools=[{"type": "function", "function": {"name": "f", "parameters": scalar}}])
    assert chat.value.body["param"] == "tools.0.function.parameters" and '"object"' in chat.value.body["message"]
    # a function without parameters ({}) is served on both
    bare = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       tools=[{"type": "function", "function": {"name": "now", "parameters": {}}}])
    assert bare.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert api.responses.create(model=MODEL, input="Hi", max_output_tokens=8, store=False,
                                tools=[{"type": "function", "name": "now", "parameters": {}}]).status
