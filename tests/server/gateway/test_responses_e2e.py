"""The OpenAI Responses dialect through clients we did not write (the official ``openai`` SDK's
``responses`` resource, openai-agents' ``Runner`` on both of its OpenAI models) against the
live stack and the reference engine; stored responses in the registry's database."""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from datetime import UTC, datetime, timedelta

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from sqlalchemy import select, update

from tenants.models import StoredResponse
from tests.server.gateway.stack import MODEL, Stack
from tests.server.gateway.test_openai_e2e import client, system_prompt

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


@pytest.fixture
def key(stack: Stack) -> str:
    return stack.add_tenant("r-" + secrets.token_hex(4))


def test_create_answers_like_the_chat_completion_of_the_same_prompt(stack: Stack, key: str) -> None:
    api = client(stack, key)
    reply = api.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24, store=False)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == MODEL
    assert reply.status in ("completed", "incomplete") and reply.store is False
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant"
    assert "Paris" in reply.output_text
    chat = api.chat.completions.create(model=MODEL, max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": QUESTION}])
    assert reply.output_text == chat.choices[0].message.content  # one core: same prompt, same answer
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    assert reply.usage.input_tokens_details.cached_tokens % 16 == 0
    with pytest.raises(openai.NotFoundError):  # store: false is not stored
        api.responses.retrieve(reply.id)


def test_stream_sends_the_responses_events_in_order(stack: Stack, key: str) -> None:
    api = client(stack, key)
    whole = api.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=12, store=False)
    events = list(api.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=12, stream=True,
                                       store=False))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          final]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    done = events[-1].response
    assert done.output_text == text and done.usage.output_tokens == whole.usage.output_tokens
    # the SDK's own stream helper assembles the same response
    with api.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=12,
                              store=False) as stream:
        assembled = stream.get_final_response()
    assert assembled.output_text == text


def test_a_function_tool_round_trip(stack: Stack, key: str) -> None:
    api = client(stack, key)
    ask = [{"role": "user", "content": "Is it raining in Oslo?"}]
    first = api.responses.create(model=MODEL, input=ask, tools=[WEATHER], temperature=0, max_output_tokens=64,
                                 tool_choice={"type": "function", "name": "get_weather"}, store=False)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # streamed: the arguments arrive as function_call_arguments events
    events = list(api.responses.create(model=MODEL, input=ask, tools=[WEATHER], temperature=0, max_output_tokens=64,
                                       tool_choice={"type": "function", "name": "get_weather"}, store=False,
                                       stream=True))
    kinds = [e.type for e in events]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert events[-3].arguments == call.arguments
    # the tool's output goes back as a function_call_output item and the model answers in text
    follow = api.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=24, store=False,
                                  input=[*ask, call.model_dump(exclude_none=True),
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": "Light rain, 6 C"}])
    assert follow.output[0].type == "message" and follow.output_text
    assert follow.usage.input_tokens > first.usage.input_tokens


class Capital(BaseModel):
    country: str
    city: str


def test_structured_output_with_parse(stack: Stack, key: str) -> None:
    api = client(stack, key)
    parsed = api.responses.parse(model=MODEL, input="The capital of France, as JSON.", text_format=Capital,
                                 temperature=0, max_output_tokens=48, store=False)
    assert isinstance(parsed.output_parsed, Capital)
    as_object = api.responses.create(model=MODEL, input="The capital of France, as JSON.", temperature=0,
                                     max_output_tokens=48, store=False, text={"format": {"type": "json_object"}})
    assert as_object.output_text.startswith("{")  # guided: an object from the first token (a 135M model
    if as_object.status == "completed":           # may nest until max_output_tokens cuts it)
        assert isinstance(json.loads(as_object.output_text), dict)


def test_previous_response_id_over_three_turns(stack: Stack, key: str) -> None:
    api = client(stack, key)
    instructions = system_prompt(secrets.token_hex(4))
    turns = ["What is the capital of France?", "And of Italy?", "And of Spain?"]
    replies = []
    previous = None
    for turn in turns:
        reply = api.responses.create(model=MODEL, instructions=instructions, input=turn, temperature=0,
                                     max_output_tokens=16, previous_response_id=previous)
        assert reply.store is True and reply.previous_response_id == previous
        replies.append(reply)
        previous = reply.id
    cached = [r.usage.input_tokens_details.cached_tokens for r in replies]
    inputs = [r.usage.input_tokens for r in replies]
    assert inputs[0] < inputs[1] < inputs[2]
    assert cached[0] < cached[1] < cached[2], cached  # each turn reads the conversation the last one left
    # the same conversation sent whole, without the store: the same prompt
    history: list = []
    for turn, reply in zip(turns, replies):
        history += [{"role": "user", "content": turn}, *[item.model_dump(exclude_none=True) for item in reply.output]]
    whole = api.responses.create(model=MODEL, instructions=instructions, input=history[:-1], temperature=0,
                                 max_output_tokens=16, store=False)
    assert whole.usage.input_tokens == inputs[2]
    # Token for token the same prompt: it reuses every block the third turn's prompt left (the engine
    # reuses at most length - 1 tokens), which a prompt differing anywhere before its last block
    # could not. The generated text is not compared: the third turn computed its prompt's tail,
    # this request reuses it, and greedy decoding on the CPU engine's q4 weights can break a
    # near-tie differently between the two (seen: "Madrid" / "Spain").
    reusable = (inputs[2] - 1) // stack.tokens_per_block * stack.tokens_per_block
    assert whole.usage.input_tokens_details.cached_tokens >= reusable, (whole.usage, inputs)


def test_retrieve_input_items_delete_and_tenants(stack: Stack, key: str) -> None:
    api = client(stack, key)
    items = [{"role": "user", "content": f"Say the word {w}."} for w in ("one", "two", "three")]
    reply = api.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=8,
                                 metadata={"case": "retrieve"})
    got = api.responses.retrieve(reply.id)
    assert got.id == reply.id and got.output_text == reply.output_text and got.metadata == {"case": "retrieve"}
    assert got.usage.input_tokens == reply.usage.input_tokens
    listed = api.responses.input_items.list(reply.id)
    texts = [item.content[0].text for item in listed.data]
    assert texts == ["Say the word three.", "Say the word two.", "Say the word one."]  # newest first by default
    page = api.responses.input_items.list(reply.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Say the word one.", "Say the word two."] and page.has_more
    rest = api.responses.input_items.list(reply.id, order="asc", limit=2, after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["Say the word three."] and not rest.has_more
    # another tenant: not found, exactly like an id that never existed (as a previous_response_id: OpenAI's 400)
    other = client(stack, stack.add_tenant("r-" + secrets.token_hex(4)))
    for call in (lambda: other.responses.retrieve(reply.id), lambda: other.responses.delete(reply.id),
                 lambda: other.responses.input_items.list(reply.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        other.responses.create(model=MODEL, input="Hi", previous_response_id=reply.id)
    assert caught.value.body["code"] == "previous_response_not_found"
    api.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(reply.id)
    # expired: past its TTL the row is gone for the client, and a continuation cannot use it
    kept = api.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=4)
    with stack.session_factory() as session, session.begin():
        session.execute(update(StoredResponse).where(StoredResponse.id == kept.id)
                        .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(kept.id)
    with pytest.raises(openai.BadRequestError):  # previous_response_not_found
        api.responses.create(model=MODEL, input="Hi", previous_response_id=kept.id)


def test_refusals_name_the_field(stack: Stack, key: str) -> None:
    url = stack.gateway.base_url + "/v1/responses"
    headers = {"Authorization": f"Bearer {key}"}
    cases = {
        "tools.0.type": {"tools": [{"type": "web_search"}]},
        "background": {"background": True},
        "conversation": {"conversation": "conv_123"},
        "reasoning": {"reasoning": {"effort": "high"}},
        "input.0.content.0.type": {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
        "truncation": {"truncation": "auto"},
        "include.0": {"include": ["file_search_call.results"]},
        "nonsense": {"nonsense": 1},
    }
    for param, extra in cases.items():
        response = httpx.post(url, headers=headers, timeout=60, json={"model": MODEL, "input": "Hi", **extra})
        assert response.status_code == 400, (param, response.text)
        error = response.json()["error"]
        assert error["param"] == param and param.split(".")[0] in error["message"], error
    missing = httpx.get(url + "/resp_nope", headers=headers, timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"


def test_text_that_is_not_unicode_and_schemas_the_engine_cannot_compile_are_400s(stack: Stack, key: str) -> None:
    """A lone UTF-16 surrogate escape is no character: refused where the body is parsed (before it
    could reach the tokenizer, an echoed field or the store), on every dialect, while an escaped
    pair (one emoji) is text. A schema the engine's grammar compiler refuses names its field."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    base = stack.gateway.base_url
    lone = {
        "/v1/responses": [b'{"model": "%s", "input": "Hi \\ud800", "max_output_tokens": 2}',
                          b'{"model": "%s", "input": "Hi", "max_output_tokens": 2, "metadata": {"k": "\\udc00"}}',
                          b'{"model": "%s", "input": "Hi", "max_output_tokens": 2, "stream": true, '
                          b'"metadata": {"k": "x\\ud800"}}',
                          b'{"model": "%s", "input": "Hi", "max_output_tokens": 2, "prompt_cache_key": "\\ud800"}'],
        "/v1/chat/completions": [b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", '
                                 b'"content": "Hi \\ud800"}]}'],
        "/v1/messages": [b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}'],
    }
    for path, bodies in lone.items():
        for body in bodies:
            r = httpx.post(base + path, content=body.replace(b"%s", MODEL.encode()), headers=headers, timeout=120)
            assert r.status_code == 400 and "lone UTF-16 surrogate" in r.text, (path, body, r.text)
    for path, body in (("/v1/chat/completions", b'{"model": "%s", "max_tokens": 2, "temperature": NaN, '
                                                 b'"messages": [{"role": "user", "content": "Hi"}]}'),
                       ("/v1/messages", b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "assistant", '
                                        b'"content": [{"type": "tool_use", "id": "toolu_1", "name": "f", '
                                        b'"input": {"t": Infinity}}]}]}')):
        r = httpx.post(base + path, content=body.replace(b"%s", MODEL.encode()), headers=headers, timeout=120)
        assert r.status_code == 400 and "is not a JSON value" in r.text, (path, r.text)
    for body, says in ((b'{"model": "%s", "input": "Hi", "temperature": 1e999}', "too large for a number"),
                       (b'{"model": "%s", "input": [{"role": "user", "content": "Hi \xed\xa0\x80"}]}', "not UTF-8")):
        r = httpx.post(base + "/v1/responses", content=body.replace(b"%s", MODEL.encode()), headers=headers, timeout=120)
        assert r.status_code == 400 and says in r.text, (body, r.text)
    pair = b'{"model": "%s", "input": "Say \\ud83d\\ude00", "max_output_tokens": 2, "metadata": {"k": "\\ud83d\\ude00"}}'
    ok = httpx.post(base + "/v1/responses", content=pair.replace(b"%s", MODEL.encode()), headers=headers, timeout=120)
    assert ok.status_code == 200 and ok.json()["metadata"] == {"k": "\U0001F600"}, ok.text
    # a NUL in an id: not found, as any id no response can have
    assert httpx.get(base + "/v1/responses/resp_%00x", headers=headers, timeout=60).status_code == 404
    bad = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(["}}, "required": ["code"]}
    for path, extra, field in (
            ("/v1/responses", {"input": "Hi", "max_output_tokens": 8,
                               "text": {"format": {"type": "json_schema", "name": "c", "schema": bad}}}, "text.format"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "c", "schema": bad}}},
             "response_format")):
        for stream in (False, True):
            r = httpx.post(base + path, json={"model": MODEL, "stream": stream, **extra}, headers=headers, timeout=120)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["param"] == field and error["code"] == "invalid_request", error
            assert "Unclosed" in error["message"] and ".cc:" not in error["message"], error
    # more output than the engine gives per request (within the tenant's 1024; the engine's is 256), asked or
    # the tenant's default: named by the dialect's field, the engine's limit said
    for path, extra, field in (("/v1/responses", {"input": "Hi", "max_output_tokens": 1000}, "max_output_tokens"),
                               ("/v1/responses", {"input": "Hi"}, "max_output_tokens"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 1000}, "max_tokens"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_completion_tokens": 1000}, "max_completion_tokens")):
        r = httpx.post(base + path, json={"model": MODEL, **extra}, headers=headers, timeout=120)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and "at most" in error["message"], (path, r.text)


def _agents_weather(stack: Stack, key: str) -> tuple[list, object, list[str]]:
    """openai-agents against the gateway: its two models (Responses, Chat Completions), a weather
    function tool, and the cities the tool was called with (tracing off: nothing leaves the machine)."""
    from agents import function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return f"Light rain in {city}, 6 C"

    sdk = openai.AsyncOpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=120)
    models = [OpenAIResponsesModel(model=MODEL, openai_client=sdk),
              OpenAIChatCompletionsModel(model=MODEL, openai_client=sdk)]
    return models, get_weather, calls


def test_agents_runner_with_a_function_tool_on_both_models(stack: Stack, key: str) -> None:
    from agents import Agent, ModelSettings, Runner

    models, get_weather, calls = _agents_weather(stack, key)
    for model in models:
        name = type(model).__name__
        calls.clear()
        # Forced call, and the tool's output is the answer: deterministic on a 135M model.
        agent = Agent(name="weather", instructions="Answer with the weather tool.", model=model,
                      tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="get_weather"))
        result = Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=2)
        assert len(calls) == 1, name  # the tool ran once, on the model's (schema-valid) call
        assert result.final_output == f"Light rain in {calls[0]}, 6 C", name
        kinds = [item.type for item in result.new_items]
        assert kinds == ["tool_call_item", "tool_call_output_item"], (name, kinds)
        # The conversation so far (the call and its output as items) goes back for a text answer.
        follow = Agent(name="writer", instructions="Answer in one sentence.", model=model,
                       model_settings=ModelSettings(temperature=0, max_tokens=24))
        again = Runner.run_sync(follow, [*result.to_input_list(), {"role": "user", "content": "Summarise it."}],
                                max_turns=1)
        assert isinstance(again.final_output, str) and again.final_output, name
        assert [item.type for item in again.new_items] == ["message_output_item"], name


def test_agents_runner_with_an_output_type_and_a_function_tool_on_both_models(stack: Stack, key: str) -> None:
    """An Agent with both ``output_type`` and ``tools`` (a format with tool_choice auto, which kvgate used
    to refuse): every model turn is either tool calls, which the Runner executes with schema-valid
    arguments, or the final output, which validates as the output type. Which one the 135M model
    writes is its own choice; only the shapes are checked (here it answers the first question and
    calls the tool for the second, at temperature 0)."""
    from typing import Literal

    from agents import Agent, ModelSettings, Runner
    from agents.exceptions import MaxTurnsExceeded
    from pydantic import Field

    class Report(BaseModel):
        city: str = Field(max_length=24)
        sky: Literal["sun", "rain", "snow"]

    models, get_weather, calls = _agents_weather(stack, key)
    for model in models:
        name = type(model).__name__
        for question, parallel in (("Answer in JSON: what is the capital of France?", None),
                                   ("What is the weather in Oslo?", False)):
            calls.clear()
            agent = Agent(name="reporter", instructions="You are a helpful assistant.", model=model,
                          tools=[get_weather], output_type=Report,
                          model_settings=ModelSettings(temperature=0, max_tokens=96, parallel_tool_calls=parallel))
            try:
                result = Runner.run_sync(agent, question, max_turns=2)
            except MaxTurnsExceeded as exc:  # every turn called the tool: no final output, no bad one either
                final, items, turns = None, exc.run_data.new_items, exc.run_data.raw_responses
                assert items and {item.type for item in items} <= {"tool_call_item", "tool_call_output_item"}, name
            else:
                final, items, turns = result.final_output, result.new_items, result.raw_responses
                assert isinstance(final, Report), (name, final)  # the Runner validated the format's JSON
                assert items[-1].type == "message_output_item", name
            made = [item for item in items if item.type == "tool_call_item"]
            assert len(calls) == len(made) and all(isinstance(city, str) and city for city in calls), (name, calls)
            if parallel is False:  # one call a turn at most
                assert all(sum(out.type == "function_call" for out in turn.output) <= 1 for turn in turns), name


def test_logprobs_when_included(stack: Stack, key: str) -> None:
    api = client(stack, key)
    reply = api.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=6, store=False,
                                 include=["message.output_text.logprobs"], top_logprobs=2)
    [part] = reply.output[0].content
    assert len(part.logprobs) == reply.usage.output_tokens
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob for entry in part.logprobs)  # greedy: the top one
    events = list(api.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=6, store=False,
                                       include=["message.output_text.logprobs"], top_logprobs=2, stream=True))
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in done.logprobs]  # the same request's
    # Another request: the same tokens; the figures may differ in the last digits (a prompt read from
    # cached KV blocks is not bit-identical to one computed afresh).
    assert [x.token for x in streamed] == [x.token for x in part.logprobs]


@contextlib.contextmanager
def second_gateway(stack: Stack, tmp_path, **settings):  # type: ignore[no-untyped-def]
    """Another gateway process's app on the same registry and engine (what a restart gives)."""
    from server.serving import build_serving_app
    from server.settings import Settings
    from tests.server.gateway.stack import PEPPER, GatewayServer, free_port

    url = stack.session_factory.kw["bind"].url.render_as_string(hide_password=False)
    app = build_serving_app(Settings(database_url=url, admin_tokens=["ci:" + "x" * 40], key_pepper=PEPPER,
                                     trace_dir=tmp_path / "traces", **settings))
    server = GatewayServer(app, free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_stored_responses_outlive_the_gateway(stack: Stack, key: str, tmp_path) -> None:
    """A second gateway on the same registry (what a restart is) reads, continues and deletes them."""
    api = client(stack, key)
    first = api.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=8)
    with second_gateway(stack, tmp_path) as other:
        again = openai.OpenAI(api_key=key, base_url=other.base_url + "/v1", max_retries=0, timeout=120)
        got = again.responses.retrieve(first.id)
        assert got.output_text == first.output_text and got.usage.input_tokens == first.usage.input_tokens
        follow = again.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id,
                                        temperature=0, max_output_tokens=8)
        assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        again.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):  # deleted through the other gateway: gone here too
        api.responses.retrieve(first.id)


def test_the_byte_cap_refuses_or_does_not_store(stack: Stack, key: str, tmp_path) -> None:
    with second_gateway(stack, tmp_path, responses_max_bytes=1) as tiny:
        api = openai.OpenAI(api_key=key, base_url=tiny.base_url + "/v1", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as caught:  # refused before the engine runs
            api.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4)
        assert caught.value.body["code"] == "response_store_full" and caught.value.body["param"] == "store"
        assert api.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, store=False).output_text
    # room for the input, not for the whole response (its body echoes the request): refused before it runs too
    with second_gateway(stack, tmp_path, responses_max_bytes=600) as small:
        api = openai.OpenAI(api_key=key, base_url=small.base_url + "/v1", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as caught:
            api.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4)
        assert caught.value.body["code"] == "response_store_full"


def test_the_wire_shapes_the_sdk_types_and_what_a_stored_chain_refuses(stack: Stack, key: str) -> None:
    """Raw bodies the SDK's own models validate (usage's cache_write_tokens, completed_at), the
    stored GET's refusals, a continuation that keeps its chain alive, and refused inputs."""
    from openai.types.responses import Response

    url = stack.gateway.base_url + "/v1/responses"
    headers = {"Authorization": f"Bearer {key}"}
    ask = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 4}
    first = httpx.post(url, headers=headers, timeout=120, json=ask).json()
    Response.model_validate(first)
    details, total = first["usage"]["input_tokens_details"], first["usage"]["input_tokens"]
    full = total // stack.tokens_per_block * stack.tokens_per_block
    assert details["cache_write_tokens"] == max(0, full - details["cached_tokens"]), first["usage"]
    assert (first["completed_at"] is not None) == (first["status"] == "completed")
    assert httpx.get(f"{url}/{first['id']}", headers=headers, timeout=60).json() == first  # stored as sent
    assert httpx.get(f"{url}/{first['id']}", headers=headers, params={"stream": "false"}, timeout=60).json() == first
    for param, value in (("stream", "true"), ("starting_after", "3")):
        refused = httpx.get(f"{url}/{first['id']}", headers=headers, params={param: value}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    # a continuation raises its chain's expiry past its own (by half a TTL): the conversation lives at least as
    # long as its newest turn
    second = httpx.post(url, headers=headers, timeout=120, json={**ask, "input": "And of Italy?",
                                                                 "previous_response_id": first["id"], "stream": None})
    assert second.status_code == 200, second.text  # stream: null is false
    second_id = second.json()["id"]
    with stack.session_factory() as session:
        expiry = dict(session.execute(select(StoredResponse.id, StoredResponse.expires_at).where(
            StoredResponse.id.in_([first["id"], second_id]))).all())
    assert expiry[first["id"]] > expiry[second_id]  # was a few seconds before it
    # its ancestor deleted, the second turn is still readable but no longer continuable, and says why
    httpx.delete(f"{url}/{first['id']}", headers=headers, timeout=60).raise_for_status()
    assert httpx.get(f"{url}/{second_id}", headers=headers, timeout=60).status_code == 200
    broken = httpx.post(url, headers=headers, timeout=60, json={**ask, "previous_response_id": second_id})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "previous_response_id"
    assert broken.json()["error"]["code"] == "previous_response_not_found"
    assert broken.json()["error"]["message"] == (f"Previous response with id '{second_id}' not found. Response "
                                                 f"'{second_id}' cannot be continued: the response "
                                                 f"'{first['id']}' it continues was deleted or has expired.")
    for items, message in (
        ([{"id": "x1", "role": "user", "content": "a"}, {"id": "x1", "role": "user", "content": "b"}],
         "Duplicate item found with id 'x1'."),
        ([{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_x", "output": "42"}],
         "No tool call found for function call output with call_id 'call_x'."),
    ):
        bad = httpx.post(url, headers=headers, timeout=60, json={**ask, "input": items})
        assert bad.status_code == 400 and bad.json()["error"] == {
            "message": message, "type": "invalid_request_error", "param": "input", "code": "invalid_request"}


def test_openais_answers_for_the_context_window_limits_query_params_and_a_continuation_without_input(
        stack: Stack, key: str) -> None:
    """A prompt over the engine's input limit (2048 here, under the tenant's 8192), a
    ``max_output_tokens`` over the tenant's (1024), bad ``input_items`` query parameters, and a
    continuation that leaves ``input`` out."""
    url = stack.gateway.base_url + "/v1/responses"
    headers = {"Authorization": f"Bearer {key}"}
    ask = {"model": MODEL, "input": "Hi", "temperature": 0, "max_output_tokens": 2}
    for stream in (False, True):
        long = httpx.post(url, headers=headers, timeout=120, json={**ask, "input": "word " * 3000, "stream": stream})
        error = long.json()["error"]
        assert long.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "input")
        assert re.search(r"the prompt has \d+ tokens and this model accepts at most 2048\.", error["message"]), error
    big = httpx.post(url, headers=headers, timeout=60, json={**ask, "max_output_tokens": 2000}).json()["error"]
    assert big["param"] == "max_output_tokens" and big["message"].startswith("2000 output tokens asked for;"), big
    first = httpx.post(url, headers=headers, timeout=120, json=ask).json()
    for params, param in (({"limit": 0}, "limit"), ({"after": "a" * 65}, "after")):
        bad = httpx.get(f"{url}/{first['id']}/input_items", headers=headers, params=params, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    no_input = {k: v for k, v in ask.items() if k != "input"}
    second = httpx.post(url, headers=headers, timeout=120, json={**no_input, "previous_response_id": first["id"]})
    assert second.status_code == 200 and second.json()["previous_response_id"] == first["id"], second.text
    assert httpx.get(f"{url}/{second.json()['id']}/input_items", headers=headers, timeout=60).json()["data"] == []
    missing = httpx.post(url, headers=headers, timeout=60, json=no_input)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input", missing.text
