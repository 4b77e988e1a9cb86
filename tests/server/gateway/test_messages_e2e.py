"""The Anthropic Messages dialect through clients we did not write (the official ``anthropic``
SDK, langchain-anthropic's ChatAnthropic) against the live stack and the reference engine."""

from __future__ import annotations

import json
import secrets

import anthropic
import httpx
import jsonschema
import pytest
from langchain_anthropic import ChatAnthropic
from pydantic import BaseModel, Field

from tenants import retention_classes
from tests.server.gateway.stack import ACTOR, MODEL, Stack
from tests.server.gateway.test_openai_e2e import GENERATED_ID
from tests.server.gateway.test_openai_e2e import client as openai_client
from tests.server.gateway.test_openai_e2e import system_prompt

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"], "additionalProperties": False}}


GREEDY = {"temperature": 0}  # the SDK no longer has a parameter for it; the API still takes it


def client(stack: Stack, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url=stack.gateway.base_url, max_retries=0, timeout=120)


@pytest.fixture
def key(stack: Stack) -> str:
    return stack.add_tenant("a-" + secrets.token_hex(4))


def hinted_key(stack: Stack, *, hint_quota_fraction: float = 1.0) -> str:
    """A tenant on the shared pool whose class honours hints (up to 1 h) at priority 35, the
    class's own and the engine's expiry priority: its hints lengthen durations only, so the
    shared engine's other tenants see no difference."""
    name = "ah-" + secrets.token_hex(4)
    with stack.session_factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=stack.now(), name=name, system_priority=35,
                                       context_priority=35, turn_priority=35, decode_priority=35,
                                       hints_enabled=True, hint_max_ttl_ms=3_600_000, hint_max_priority=35,
                                       hint_quota_fraction=hint_quota_fraction)
    return stack.add_tenant(name, retention_class=name, kv_quota_fraction=1.0)


def test_create_answers_like_the_chat_completion_of_the_same_prompt(stack: Stack, key: str) -> None:
    reply = client(stack, key).messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=QUESTION)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.model == MODEL and reply.stop_reason in ("end_turn", "max_tokens")
    [block] = reply.content
    assert block.type == "text" and "Paris" in block.text
    chat = openai_client(stack, key).chat.completions.create(model=MODEL, max_tokens=24, temperature=0,
                                                             messages=QUESTION)
    assert block.text == chat.choices[0].message.content  # one core: same prompt, same tokens, same answer
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == \
        chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.cache_creation_input_tokens == 0  # no cache_control: nothing written under a breakpoint


def test_stream_sends_anthropics_events_in_order(stack: Stack, key: str) -> None:
    api = client(stack, key)
    whole = api.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=QUESTION)
    with api.messages.stream(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=QUESTION) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "ping")]  # "text": the SDK's own helper events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens - \
        final.usage.cache_read_input_tokens
    # raw bytes: every frame names its event, and the names match the data's type
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "stream": True}
    with httpx.stream("POST", stack.gateway.base_url + "/v1/messages", json=body, timeout=120,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = response.read().decode().strip().split("\n\n")
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert all(f'"type":"{name}"' in frame for name, frame in zip(names, frames, strict=True))


def test_stop_sequences_end_with_stop_sequence(stack: Stack, key: str) -> None:
    api = client(stack, key)
    plain = api.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=QUESTION)
    text = plain.content[0].text
    cut = text.split(" ")[2]  # a word the answer certainly contains
    reply = api.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=QUESTION, stop_sequences=[cut])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == cut
    assert text.startswith(reply.content[0].text) and cut not in reply.content[0].text


def test_a_forced_tool_call_returns_schema_valid_input(stack: Stack, key: str) -> None:
    api = client(stack, key)
    ask = [{"role": "user", "content": "Is it raining in Oslo?"}]
    reply = api.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"})
    assert reply.stop_reason == "tool_use"
    [call] = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # streamed: the input arrives as input_json_delta and the SDK assembles the same object
    with api.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ask, tools=[WEATHER],
                             tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas == ["input_json_delta"] and final.stop_reason == "tool_use"
    assert final.content[-1].input == call.input
    # the tool's answer goes back as a tool_result and the model continues
    follow = api.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Light rain, 6 C"}]}])
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > reply.usage.input_tokens


def test_cache_control_usage_on_the_first_and_second_call(stack: Stack) -> None:
    api = client(stack, hinted_key(stack))
    system = [{"type": "text", "text": system_prompt(secrets.token_hex(4)) * 2, "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": "Capital of Italy?"}]
    counted = api.messages.count_tokens(model=MODEL, system=system, messages=ask).input_tokens
    first = api.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, system=system, messages=ask).usage
    second = api.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, system=system, messages=ask).usage
    for usage in (first, second):
        assert usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens == counted
        assert usage.cache_creation.ephemeral_1h_input_tokens == 0
        assert usage.cache_creation.ephemeral_5m_input_tokens == usage.cache_creation_input_tokens
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 100  # the system prompt
    assert second.cache_read_input_tokens > 0  # served from the blocks the first call left
    assert second.cache_read_input_tokens % 16 == 0  # whole 16-token blocks
    # what was read is no longer created: the system prompt's tokens split between the two
    assert second.cache_creation_input_tokens + second.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens < first.cache_creation_input_tokens
    # streamed, message_start already carries the split (from the engine's first response)
    with api.messages.stream(model=MODEL, max_tokens=4, extra_body=GREEDY, system=system, messages=ask) as stream:
        start = next(e for e in stream if e.type == "message_start").message.usage
        final = stream.get_final_message().usage
    assert start.cache_read_input_tokens == final.cache_read_input_tokens >= second.cache_read_input_tokens
    assert start.input_tokens + start.cache_creation_input_tokens + start.cache_read_input_tokens == counted


def test_a_breakpoint_on_the_last_turn_is_read_by_the_next_turn(stack: Stack) -> None:
    api = client(stack, hinted_key(stack))
    marked = {"type": "ephemeral"}
    first_turn = [{"role": "user", "content": [{"type": "text", "text": system_prompt(secrets.token_hex(4)),
                                                "cache_control": marked}]}]
    first = api.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=first_turn)
    prompt = first.usage.input_tokens + first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    assert first.usage.cache_creation_input_tokens > 0
    second = api.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=[
        *first_turn, {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": [{"type": "text", "text": "And in French?", "cache_control": marked}]}])
    # the whole first prompt is a prefix of the second: every full block of it is read back
    assert second.usage.cache_read_input_tokens >= (prompt // 16) * 16
    assert second.usage.cache_creation_input_tokens > 0  # the new turn, written under its breakpoint


def test_cache_creation_counts_only_the_hints_the_gateway_applied(stack: Stack, key: str) -> None:
    hour = {"type": "ephemeral", "ttl": "1h"}
    ask = [{"role": "user", "content": "Capital of Spain?"}]

    def first_call(api_key: str):
        system = [{"type": "text", "text": system_prompt(secrets.token_hex(4)) * 2, "cache_control": hour}]
        api = client(stack, api_key)
        counted = api.messages.count_tokens(model=MODEL, system=system, messages=ask).input_tokens
        usage = api.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, system=system, messages=ask).usage
        assert usage.cache_read_input_tokens == 0
        assert usage.input_tokens + usage.cache_creation_input_tokens == counted
        return usage

    # The default class does not honour hints: nothing is kept under the breakpoint.
    ignored = first_call(key)
    assert ignored.cache_creation_input_tokens == 0
    split = ignored.cache_creation
    assert (split.ephemeral_5m_input_tokens, split.ephemeral_1h_input_tokens) == (0, 0)
    # A class that honours them: the system prompt's full blocks, kept for 1 h.
    applied = first_call(hinted_key(stack))
    assert applied.cache_creation_input_tokens > 100 and applied.cache_creation_input_tokens % 16 == 0
    assert applied.cache_creation.ephemeral_1h_input_tokens == applied.cache_creation_input_tokens
    # The hint budget has room for two blocks (1/128 of 256): the rest was not kept under the hint.
    clipped = first_call(hinted_key(stack, hint_quota_fraction=1 / 128))
    assert clipped.cache_creation_input_tokens == clipped.cache_creation.ephemeral_1h_input_tokens == 32


def test_output_config_format_constrains_the_answer_to_the_schema(stack: Stack, key: str) -> None:
    schema = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 20},
                                               "capital": {"type": "string", "maxLength": 20}},
              "required": ["country", "capital"], "additionalProperties": False}
    reply = client(stack, key).messages.create(
        model=MODEL, max_tokens=64, extra_body=GREEDY, messages=[{"role": "user", "content": "Italy's capital?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_a_body_over_the_limit_is_413_in_anthropics_shape(stack: Stack, key: str) -> None:
    big = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    response = httpx.post(stack.gateway.base_url + "/v1/messages", headers={"x-api-key": key}, json=big, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"
    # sent chunked (no Content-Length to refuse up front): found while read, still a 413, on every route
    raw = json.dumps(big).encode()

    def chunks():
        for start in range(0, len(raw), 1 << 20):
            yield raw[start:start + (1 << 20)]

    for path, body_shape in (("/v1/messages", "request_too_large"), ("/v1/messages/count_tokens", "request_too_large"),
                             ("/v1/chat/completions", "payload_too_large"), ("/v1/responses", "payload_too_large")):
        response = httpx.post(stack.gateway.base_url + path, content=chunks(), timeout=60,
                              headers={"x-api-key": key, "Authorization": f"Bearer {key}",
                                       "Content-Type": "application/json"})
        assert response.status_code == 413, (path, response.text)
        error = response.json()["error"]
        assert body_shape in (error.get("type"), error.get("code")), (path, error)


def test_count_tokens_counts_the_prompt_with_its_tools(stack: Stack, key: str) -> None:
    api = client(stack, key)
    bare = api.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    with_tools = api.messages.count_tokens(model=MODEL, messages=QUESTION, tools=[WEATHER]).input_tokens
    reply = api.messages.create(model=MODEL, max_tokens=1, messages=QUESTION)
    assert bare == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert with_tools > bare + 50  # the tool definitions are in the prompt


def test_count_tokens_takes_a_trailing_assistant_turn_and_bad_types_are_400_on_every_route(stack: Stack,
                                                                                           key: str) -> None:
    api = client(stack, key)

    def counted(*answer, **fields) -> int:
        messages = [*QUESTION, *({"role": "assistant", "content": text} for text in answer)]
        return api.messages.count_tokens(model=MODEL, messages=messages, **fields).input_tokens

    bare = counted()  # the question, its generation prompt opening the assistant turn
    short = counted("Paris.", speed="standard")
    longer = counted("Paris. It has been the capital of France since the Middle Ages.")
    # the answer's text and the end of its turn are counted, more text counts more
    assert bare + 3 <= short and short + 8 <= longer
    # Anthropic's optional empty final assistant message: the open turn, counted as the question alone
    assert counted("") == counted([]) == bare
    # a list where a string is expected: 400 in Anthropic's shape on create, stream and count_tokens (was a 500)
    bad = {"model": MODEL, "messages": QUESTION, "cache_control": {"type": "ephemeral", "ttl": ["5m"]}}
    for path, body in (("", {**bad, "max_tokens": 4}), ("", {**bad, "max_tokens": 4, "stream": True}),
                       ("/count_tokens", bad)):
        response = httpx.post(stack.gateway.base_url + "/v1/messages" + path, json=body, timeout=60,
                              headers={"x-api-key": key})
        assert response.status_code == 400, (path, response.text)
        assert response.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": 'cache_control.ttl: must be "5m" or "1h"'},
                                   "request_id": response.headers["request-id"]}


def test_errors_raise_the_sdks_classes_with_anthropics_body(stack: Stack, key: str) -> None:
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(stack, "kvg_not_a_key").messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    assert auth.value.body["type"] == "error" and auth.value.body["error"]["type"] == "authentication_error"
    api = client(stack, key)
    with pytest.raises(anthropic.BadRequestError) as image:
        api.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert image.value.body["error"]["type"] == "invalid_request_error"
    assert image.value.body["error"]["message"].startswith("messages.0.content.0.type:")
    with pytest.raises(anthropic.NotFoundError):
        api.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=QUESTION)
    limited = stack.add_tenant("rpm-" + secrets.token_hex(3), rpm_limit=1)
    client(stack, limited).messages.create(model=MODEL, max_tokens=1, messages=QUESTION)
    with pytest.raises(anthropic.RateLimitError) as rate:
        client(stack, limited).messages.create(model=MODEL, max_tokens=1, messages=QUESTION)
    assert rate.value.body["error"]["type"] == "rate_limit_error" and rate.value.response.headers.get("retry-after")


def test_validation_errors_have_each_dialects_shape(stack: Stack, key: str) -> None:
    base = stack.gateway.base_url
    bad = httpx.post(base + "/v1/messages", headers={"x-api-key": key}, json={"model": MODEL, "messages": QUESTION})
    assert bad.status_code == 400
    assert bad.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                     "message": "max_tokens: Field required"},
                          "request_id": bad.headers["request-id"]}
    unknown = httpx.post(base + "/v1/messages", headers={"authorization": f"Bearer {key}"},
                         json={"model": MODEL, "max_tokens": 4, "messages": QUESTION, "frequency_penalty": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["message"].endswith("frequency_penalty")
    missing = httpx.post(base + "/v1/messages/count_tokens", json={"model": MODEL, "messages": QUESTION})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    malformed = [{"model": MODEL, "max_tokens": "3", "messages": QUESTION}, {"model": MODEL, "max_tokens": 3},
                 {"model": MODEL, "max_tokens": 3, "messages": "hi"}, {"model": MODEL, "max_tokens": 3, "messages": [5]},
                 {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": 5}]},
                 {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": [5]}]},
                 {"model": MODEL, "max_tokens": 3, "messages": QUESTION, "tools": [5]},
                 {"model": MODEL, "max_tokens": 3, "messages": QUESTION, "tools": [{"name": 5, "input_schema": {}}]},
                 {"model": MODEL, "max_tokens": 3, "messages": QUESTION, "tool_choice": {"type": "bogus"}},
                 {"model": MODEL, "max_tokens": 3, "messages": QUESTION, "system": [{"type": "image"}]},
                 {"model": MODEL, "max_tokens": 3, "messages": QUESTION, "temperature": 1.5},
                 {"model": MODEL, "max_tokens": 3, "messages": QUESTION, "stop_sequences": [""]}, [], "text"]
    for body in malformed:
        response = httpx.post(base + "/v1/messages", headers={"x-api-key": key}, json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    garbled = httpx.post(base + "/v1/messages", headers={"x-api-key": key, "content-type": "application/json"},
                         content=b"{not json")
    assert garbled.status_code == 400 and garbled.json()["error"]["type"] == "invalid_request_error"
    openai = httpx.post(base + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                        json={"model": MODEL, "messages": QUESTION, "max_tokens": 0})
    assert openai.status_code == 400 and openai.json()["error"]["code"] == "invalid_request"  # unchanged


def test_error_bodies_carry_the_request_id_and_a_tool_breakpoint_covers_the_tools(stack: Stack, key: str) -> None:
    # Anthropic's error body names the request, with the id of its request-id header
    bad = httpx.post(stack.gateway.base_url + "/v1/messages", headers={"x-api-key": key},
                     json={"model": MODEL, "messages": QUESTION})
    assert bad.status_code == 400 and GENERATED_ID.fullmatch(bad.json()["request_id"])
    assert bad.json()["request_id"] == bad.headers["request-id"]
    api = client(stack, key)
    with pytest.raises(anthropic.BadRequestError) as typo:  # a misspelled cache_control is refused, not dropped
        api.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_contrl": {"type": "ephemeral"}}]}])
    assert typo.value.body["error"]["message"] == "messages.0.content.0.cache_contrl: Extra inputs are not permitted"
    assert typo.value.body["request_id"] == typo.value.request_id
    # an empty system is no system: the template's default one, as when it is omitted
    counted = [api.messages.count_tokens(model=MODEL, messages=QUESTION, **fields).input_tokens
               for fields in ({}, {"system": ""}, {"system": []})]
    assert counted[0] == counted[1] == counted[2]
    # the tools open the prompt: a 1 h breakpoint on them and a 5 min one on the system text
    # keep the tools for 1 h and the system text after them for 5 min
    hinted = client(stack, hinted_key(stack))
    system = [{"type": "text", "text": system_prompt(secrets.token_hex(4)) * 2, "cache_control": {"type": "ephemeral"}}]
    tools = [{**WEATHER, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    total = hinted.messages.count_tokens(model=MODEL, tools=tools, system=system, messages=QUESTION).input_tokens
    tools_only = hinted.messages.count_tokens(model=MODEL, tools=tools, messages=QUESTION).input_tokens
    usage = hinted.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, tools=tools, system=system,
                                   messages=QUESTION).usage
    assert usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens == total
    hour, five = usage.cache_creation.ephemeral_1h_input_tokens, usage.cache_creation.ephemeral_5m_input_tokens
    # the tools' blocks, up to the block holding their end; before, both breakpoints ended with the system
    # text, all of it kept (and reported) for 1 h
    assert 0 < hour < tools_only + stack.tokens_per_block and five > 0


class GetWeather(BaseModel):
    """Current weather for a city."""

    city: str = Field(description="the city", max_length=40)


def test_langchain_chat_anthropic_invoke_and_bind_tools(stack: Stack, key: str) -> None:
    chat = ChatAnthropic(model=MODEL, base_url=stack.gateway.base_url, api_key=key, temperature=0, max_tokens=32,
                         max_retries=0, timeout=120)
    answer = chat.invoke([("user", "What is the capital of France? Answer in one word.")])
    assert "Paris" in answer.content and answer.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.text for chunk in chat.stream([("user", "What is the capital of France? Answer in one word.")]))
    assert streamed == answer.content
    message = chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke([("user", "Is it raining in Oslo?")])
    [call] = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
    # bind_tools(strict=True) sends "strict": true with tool_choice auto: served, the call best effort
    auto = chat.bind_tools([GetWeather], strict=True).invoke([("user", "Is it raining in Oslo?")])
    assert all(call["name"] == "GetWeather" for call in auto.tool_calls)


def test_tool_results_pair_with_their_calls_per_turn(stack: Stack, key: str) -> None:
    # Anthropic combines consecutive messages of a role into one turn: results split over two user
    # messages, or text after the calls in a second assistant message, still pair with the calls
    def use(*ids: str) -> dict:
        return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "get_weather",
                                                  "input": {"city": "Oslo"}} for i in ids]}

    def answer(call_id: str) -> dict:
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "3 C"}]}

    ask = {"role": "user", "content": "Weather in Oslo, twice?"}
    api = client(stack, key)
    for messages in ([ask, use("toolu_A", "toolu_B"), answer("toolu_A"), answer("toolu_B")],
                     [ask, use("toolu_A"), {"role": "assistant", "content": "Checking."}, answer("toolu_A")]):
        reply = api.messages.create(model=MODEL, max_tokens=4, tools=[WEATHER], messages=messages)
        assert reply.type == "message" and reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0


def test_engine_lost_mid_stream_is_an_error_event_then_529_overloaded(stack: Stack) -> None:
    # Last in this module: it kills the stack's engine (and restarts it).
    key = stack.add_tenant("down-" + secrets.token_hex(3))
    body = {"model": MODEL, "max_tokens": 200, "stream": True, "messages": QUESTION,
            "system": "Write a very long essay about every capital city of Europe."}
    try:
        with httpx.stream("POST", stack.gateway.base_url + "/v1/messages", json=body, timeout=120,
                          headers={"x-api-key": key}) as response:
            assert response.status_code == 200
            frames = []
            for line in response.iter_lines():
                if line.startswith("event: "):
                    frames.append(line.removeprefix("event: "))
                    if frames.count("content_block_delta") == 2:
                        stack.engine.kill()
        assert frames[-1] == "error" and "message_stop" not in frames
        with pytest.raises(anthropic.OverloadedError) as down:
            client(stack, key).messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
        assert down.value.status_code == 529 and down.value.body["error"]["type"] == "overloaded_error"
    finally:
        stack.engine.start()
    assert client(stack, key).messages.create(model=MODEL, max_tokens=2, messages=QUESTION).usage.output_tokens >= 1


def test_every_answer_carries_a_request_id(stack: Stack, key: str) -> None:
    api = client(stack, key)
    raw = api.messages.with_raw_response.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=QUESTION)
    sent = raw.headers["request-id"]
    assert GENERATED_ID.fullmatch(sent) and "x-request-id" not in raw.headers  # Anthropic's header on its API
    assert raw.parse()._request_id == sent
    reply = api.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=QUESTION)
    assert GENERATED_ID.fullmatch(reply._request_id or "") and reply._request_id != sent
    with api.messages.stream(model=MODEL, max_tokens=2, messages=QUESTION) as stream:  # the SSE response too
        assert GENERATED_ID.fullmatch(stream.request_id or "")  # the SDK's final message has no _request_id
        assert stream.get_final_message().content
    counted = api.messages.with_raw_response.count_tokens(model=MODEL, messages=QUESTION)
    assert GENERATED_ID.fullmatch(counted.headers["request-id"])
    with pytest.raises(anthropic.NotFoundError) as info:
        api.messages.create(model="nope", max_tokens=2, messages=QUESTION)
    assert GENERATED_ID.fullmatch(info.value.request_id or "") and info.value.body["type"] == "error"


def test_the_request_id_is_the_servers_and_a_valid_client_id_travels_beside_it(stack: Stack, key: str) -> None:
    api = client(stack, key)
    raw = api.messages.with_raw_response.create(model=MODEL, max_tokens=1, messages=QUESTION,
                                                extra_headers={"x-client-request-id": "corr.9:z", "request-id": "corr.9:z"})
    assert raw.headers["x-client-request-id"] == "corr.9:z"
    assert GENERATED_ID.fullmatch(raw.parse()._request_id or "") and raw.headers["request-id"] == raw.parse()._request_id
    for bad in ("two words", "r" * 200):
        raw = api.messages.with_raw_response.create(model=MODEL, max_tokens=1, messages=QUESTION,
                                                    extra_headers={"x-client-request-id": bad})
        assert GENERATED_ID.fullmatch(raw.parse()._request_id or "") and "x-client-request-id" not in raw.headers, bad
