"""Tool calls against stop strings and long silences, and the Messages routes' request checks, over
real HTTP (the official ``anthropic`` and ``openai`` SDKs where the client's view matters) against the
live stack and the reference engine."""

from __future__ import annotations

import json
import secrets

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.gateway.stack import MODEL, Stack
from tests.server.gateway.test_messages_e2e import GREEDY, WEATHER, client, hinted_key
from tests.server.gateway.test_openai_e2e import client as openai_client

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Is it raining in Oslo?"}]
FUNCTION = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                              "parameters": WEATHER["input_schema"]}}
# a history after which the model calls the tool on its own (tool_choice auto), at temperature 0
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                              "input": {"city": "Paris"}}]},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                        {"type": "text", "text": "And the weather in Rome? Call the tool."}]}]
CALLER = "Always answer by calling a tool."


@pytest.fixture
def key(stack: Stack) -> str:
    return stack.add_tenant("mt-" + secrets.token_hex(4))


def _calls(reply) -> list[tuple[str, dict]]:
    return [(b.name, b.input) for b in reply.content if b.type == "tool_use"]


def test_stop_sequences_never_cut_a_forced_call_in_either_dialect(stack: Stack, key: str) -> None:
    api = client(stack, key)
    forced = {"type": "tool", "name": "get_weather"}
    plain = api.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                                tool_choice=forced)
    [(name, arguments)] = _calls(plain)
    stops = ["get_weather", "city"]  # both inside the guided call's JSON
    for choice in (forced, {"type": "any"}):
        reply = api.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                                    tool_choice=choice, stop_sequences=stops)
        assert (reply.stop_reason, reply.stop_sequence, _calls(reply)) == ("tool_use", None, [(name, arguments)])
    with api.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                             tool_choice=forced, stop_sequences=stops) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, _calls(final)) == ("tool_use", [(name, arguments)])
    # the same core serves OpenAI chat: "stop" leaves a forced call whole too
    chat = openai_client(stack, key)
    for stream in (False, True):
        made = chat.chat.completions.create(model=MODEL, max_tokens=64, temperature=0, messages=ASK,
                                            tools=[FUNCTION], tool_choice="required", stop=stops, stream=stream)
        if stream:
            chunks = list(made)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
            assert finish == ["tool_calls"] and json.loads(calls[0].function.arguments) == arguments
        else:
            [call] = made.choices[0].message.tool_calls
            assert made.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == arguments


def test_a_stop_sequence_inside_an_auto_call_leaves_it_whole_in_either_dialect(stack: Stack, key: str) -> None:
    api = client(stack, key)
    plain = api.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=HISTORY, tools=[WEATHER],
                                system=CALLER)
    [(name, arguments)] = _calls(plain)
    city = arguments["city"]
    reply = api.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=HISTORY, tools=[WEATHER],
                                system=CALLER, stop_sequences=[city, "</tool_call>"])
    assert (reply.stop_reason, _calls(reply)) == ("tool_use", [(name, arguments)])
    assert not any("<tool_call>" in b.text for b in reply.content if b.type == "text")  # no markup as text
    with api.messages.stream(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=HISTORY, tools=[WEATHER],
                             system=CALLER, stop_sequences=[city]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, _calls(final)) == ("tool_use", [(name, arguments)])
    # OpenAI chat, the same conversation (the Messages path renders it the same way, tools after the system text)
    messages = [{"role": "system", "content": CALLER}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "And the weather in Rome? Call the tool."}]
    chat = openai_client(stack, key)
    base = chat.chat.completions.create(model=MODEL, max_tokens=60, temperature=0, messages=messages, tools=[FUNCTION])
    if base.choices[0].message.tool_calls:  # the same model, another prompt: only if it calls here too
        [call] = base.choices[0].message.tool_calls
        stopped = chat.chat.completions.create(model=MODEL, max_tokens=60, temperature=0, messages=messages,
                                               tools=[FUNCTION], stop=[json.loads(call.function.arguments)["city"]])
        assert stopped.choices[0].finish_reason == "tool_calls"
        assert [c.function.arguments for c in stopped.choices[0].message.tool_calls] == [call.function.arguments]
        assert "<tool_call>" not in (stopped.choices[0].message.content or "")


def test_a_stop_sequence_in_the_content_still_stops_with_tools_offered(stack: Stack, key: str) -> None:
    api = client(stack, key)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    plain = api.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ask, tools=[WEATHER])
    assert not _calls(plain)
    word = plain.content[0].text.split(" ")[2]
    reply = api.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ask, tools=[WEATHER],
                                stop_sequences=[word])
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", word)
    assert plain.content[0].text.startswith(reply.content[0].text) and word not in reply.content[0].text


def test_an_output_format_with_tools_answers_with_tool_use_or_the_formats_json(stack: Stack, key: str) -> None:
    """``output_config.format`` with tool_choice auto: the output is tool_use blocks (stop reason
    ``tool_use``, inputs that follow the tool's schema) or a text block that is the format's JSON;
    which one is the model's choice, only the shape is checked (with disable_parallel_tool_use too)."""
    api = client(stack, key)
    answer = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 60}}, "required": ["text"],
              "additionalProperties": False}
    for question, choice in (("Weather in Rome? Call the tool.", {"type": "auto"}),
                             ("Weather in Rome? Call the tool.", {"type": "auto", "disable_parallel_tool_use": True}),
                             ("Answer in JSON: what is the capital of France?", {"type": "auto"})):
        reply = api.messages.create(model=MODEL, max_tokens=160, messages=[{"role": "user", "content": question}],
                                    tools=[WEATHER], tool_choice=choice,
                                    extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema",
                                                                                       "schema": answer}}})
        calls = _calls(reply)
        if calls:
            assert reply.stop_reason == "tool_use" and all(b.type == "tool_use" for b in reply.content)
            assert len(calls) == 1 or not choice.get("disable_parallel_tool_use"), calls
            for name, arguments in calls:
                assert name == "get_weather"
                jsonschema.validate(arguments, WEATHER["input_schema"])
        else:
            [block] = reply.content
            assert reply.stop_reason == "end_turn" and block.type == "text"
            jsonschema.validate(json.loads(block.text), answer)


@pytest.fixture
def fast_keep_alive(stack: Stack, monkeypatch):
    """The runner's keep-alive interval at its smallest: one after every engine chunk a call holds back."""
    monkeypatch.setattr(stack.gateway.app.state.gateway.runner, "keep_alive", 0.0, raising=False)


def test_a_streamed_call_sends_pings_while_it_is_generated(stack: Stack, key: str, fast_keep_alive) -> None:
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "stream": True, "messages": ASK, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    with httpx.stream("POST", stack.gateway.base_url + "/v1/messages", json=body, timeout=120,
                      headers={"x-api-key": key}) as response:
        frames = response.read().decode().strip().split("\n\n")
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    first_block = names.index("content_block_start")
    assert names[0] == "message_start" and names[1:first_block] == ["ping"] * (first_block - 1)
    assert first_block > 3  # the first ping, then one per chunk the call was held for
    assert "ping" not in names[first_block:]  # the call's block and the message's end follow unbroken
    assert all(f'"type":"{name}"' in frame for name, frame in zip(names, frames, strict=True))
    # the SDK takes the pings in its stride (its MessageStream does not pass them on) and assembles the call
    with client(stack, key).messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ASK,
                                            tools=[WEATHER], tool_choice={"type": "any"}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "message_stop" in kinds and final.stop_reason == "tool_use" and _calls(final)[0][0] == "get_weather"
    # OpenAI chat: SSE comment lines, which the openai SDK skips
    chat = openai_client(stack, key)
    raw = httpx.post(stack.gateway.base_url + "/v1/chat/completions", timeout=120,
                     headers={"authorization": f"Bearer {key}"},
                     json={"model": MODEL, "max_tokens": 64, "temperature": 0, "stream": True, "messages": ASK,
                           "tools": [FUNCTION], "tool_choice": "required"}).text
    assert raw.count(": keep-alive\n\n") > 2 and raw.endswith("data: [DONE]\n\n")
    chunks = list(chat.chat.completions.create(model=MODEL, max_tokens=64, temperature=0, messages=ASK,
                                               tools=[FUNCTION], tool_choice="required", stream=True))
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [t.function.name for t in calls] == ["get_weather"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_a_long_silence_a_streamed_call_sends_its_one_ping(stack: Stack, key: str) -> None:
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "stream": True, "messages": ASK, "tools": [WEATHER],
            "tool_choice": {"type": "any"}}
    with httpx.stream("POST", stack.gateway.base_url + "/v1/messages", json=body, timeout=120,
                      headers={"x-api-key": key}) as response:
        names = [f.split("\n")[0] for f in response.read().decode().strip().split("\n\n")]
    assert names.count("event: ping") == 1  # a call of a few seconds: under the default interval


def test_a_conversation_of_more_than_1024_messages_is_served_and_bad_content_is_named_plainly(stack: Stack,
                                                                                          key: str) -> None:
    api = client(stack, key)
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "ok"} for i in range(1101)]
    assert api.messages.count_tokens(model=MODEL, messages=long).input_tokens > 1101
    url, headers = stack.gateway.base_url + "/v1/messages", {"x-api-key": key}
    for body, message in (
            ({"messages": [{"role": "user", "content": 5}]},
             "messages.0.content: must be a string or a list of content blocks"),
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1025}]},
             "messages.0.content: a maximum of 1024 content blocks may be provided, got 1025"),
            ({"messages": ASK, "system": 5}, "system: must be a string or a list of system blocks"),
            ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages.0.content.0: must be a content block object")):
        refused = httpx.post(url, headers=headers, json={"model": MODEL, "max_tokens": 4, **body})
        assert refused.status_code == 400 and refused.json()["error"]["message"] == message


def test_a_breakpoint_on_one_tool_covers_that_tool_only(stack: Stack) -> None:
    api = client(stack, hinted_key(stack))
    tag = secrets.token_hex(4)
    first = {"name": "tool_a", "description": f"[{tag}] " + "Looks things up in the first catalogue. " * 8,
             "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    second = {"name": "tool_b", "description": "Looks things up in the second catalogue. " * 8,
              "input_schema": {"type": "object"}}
    hi = [{"role": "user", "content": "hi"}]
    alone = api.messages.count_tokens(model=MODEL, tools=[first], messages=hi, system="S").input_tokens
    both = api.messages.count_tokens(model=MODEL, tools=[first, second], messages=hi, system="S").input_tokens
    usage = api.messages.create(model=MODEL, max_tokens=2, tools=[first, second], tool_choice={"type": "none"},
                                system="S", messages=hi).usage
    hour = usage.cache_creation.ephemeral_1h_input_tokens
    # tool_a's line (and what opens the prompt before it), up to the block holding its end: less than the
    # whole prompt with tool_a alone; before, the breakpoint covered tool_b too (more than that prompt)
    assert 0 < hour < alone < both and usage.cache_creation.ephemeral_5m_input_tokens == 0


@pytest.mark.parametrize(("thinking", "message"), [
    ({"type": "adaptive", "budget_tokens": 5}, "thinking.budget_tokens: Extra inputs are not permitted"),
    ({"type": "disabled", "budget_tokens": "x"}, "thinking.budget_tokens: Extra inputs are not permitted"),
    ({"type": ["enabled"]}, "thinking.type: must be one of 'enabled', 'disabled', 'adaptive', 'between_tools'"),
    ({"type": "adaptive", "display": "loud"}, "thinking.display: must be 'summarized' or 'omitted'"),
    ({"type": "enabled", "budget_tokens": "x"}, "thinking.budget_tokens: must be an integer"),
    ({"type": "enabled", "budget_tokens": 1024}, "thinking: extended thinking is not supported by this gateway"),
])
def test_thinking_takes_each_variants_fields(stack: Stack, key: str, thinking: dict, message: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(stack, key).messages.create(model=MODEL, max_tokens=2, messages=ASK, extra_body={"thinking": thinking})
    assert refused.value.body["error"]["message"] == message


def test_thinking_variants_with_their_own_fields_are_served(stack: Stack, key: str) -> None:
    api = client(stack, key)
    for thinking in ({"type": "disabled"}, {"type": "adaptive", "display": "omitted"}):
        assert api.messages.create(model=MODEL, max_tokens=2, messages=ASK, thinking=thinking).type == "message"


def test_an_empty_x_api_key_leaves_the_bearer_key(stack: Stack, key: str) -> None:
    url = stack.gateway.base_url + "/v1/messages/count_tokens"
    body = {"model": MODEL, "messages": ASK}
    served = httpx.post(url, json=body, headers={"x-api-key": "", "authorization": f"Bearer {key}"})
    assert served.status_code == 200 and served.json()["input_tokens"] > 0
    missing = httpx.post(url, json=body, headers={"x-api-key": ""})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(url, json=body, headers={"x-api-key": "kvg_wrong", "authorization": f"Bearer {key}"})
    assert wrong.status_code == 401  # a key that is sent still wins


def test_an_unknown_model_is_404_before_the_body_is_read(stack: Stack, key: str) -> None:
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]
    api = client(stack, key)
    with pytest.raises(anthropic.NotFoundError) as create:
        api.messages.create(model="claude-3", max_tokens=4, messages=image)
    with pytest.raises(anthropic.NotFoundError) as count:
        api.messages.count_tokens(model="claude-3", messages=image)
    for refused in (create, count):
        assert refused.value.body["error"]["type"] == "not_found_error"
        assert "claude-3" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # the right model: the image is what is refused
        api.messages.create(model=MODEL, max_tokens=4, messages=image)
