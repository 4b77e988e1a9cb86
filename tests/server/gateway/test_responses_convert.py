"""The Responses dialect's conversion and rendering on the real tokenizer and template: items,
tools, formats, refusals by name, conversation hints, and a stored chain's prompt."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engines.tokenizer import load_gguf_tokenizer
from retention.policy.hints import TTL_1H_MS, TTL_24H_MS, Breakpoint
from retention.policy.planner import SegmentRetention
from server.gateway.api.conversion import Conversation
from server.gateway.admission import AdmissionError, Limits, check_sizes
from server.gateway.api.responses_convert import (check_items, conversation_hints, convert, in_responses_words,
                                                  normalize_items, refuse_unservable, request_items)
from server.gateway.api.responses_render import ResponsesDialect
from server.gateway.api.responses_schemas import ResponsesRequest
from server.gateway.api.prompting import ChatPrompter
from server.gateway.api.tools import CALL_OPEN
from server.gateway.errors import ServingError

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def prompter() -> ChatPrompter:
    return ChatPrompter(load_gguf_tokenizer())


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})


def served(body: ResponsesRequest, history: list[dict] | None = None) -> Conversation:
    """What the route does with a body (and the stored chain it continues) before the prompt."""
    refuse_unservable(body)
    items = request_items(body)
    check_items(history or [], items)
    return convert(body, (history or []) + items)


def refused(param: str, history: list[dict] | None = None, **fields) -> ServingError:
    body = request(**fields)
    with pytest.raises(ServingError) as caught:
        served(body, history)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    return caught.value


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    body = request(instructions="Be brief.")
    conversation = convert(body, normalize_items(body.input))
    assert conversation.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert conversation.tools is None and conversation.guide is None


def test_items_become_chat_messages_with_tool_calls() -> None:
    items = normalize_items([
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Rain "},
                                                         {"type": "input_text", "text": "in Oslo?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Light rain"},
    ])
    assert all(item["id"] for item in items) and len({item["id"] for item in items}) == 5
    conversation = convert(request(tools=[WEATHER]), items)
    roles = [m["role"] for m in conversation.messages]
    assert roles == ["developer", "user", "assistant", "tool"]  # the call joins the assistant message it follows
    assert conversation.messages[1]["content"] == "Rain in Oslo?"
    assert conversation.messages[2]["content"].startswith("Checking.\n" + CALL_OPEN)
    assert '"get_weather"' in conversation.messages[0]["content"]  # tool definitions in the system message
    assert conversation.tools is not None and conversation.tools.mode == "auto"
    # the fields the SDK's item params may carry besides these are taken and ignored
    echoed = normalize_items([
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}", "namespace": "n",
         "caller": {"type": "direct"}},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok", "name": "get_weather",
         "namespace": "n", "caller": None},
    ])
    assert [m["role"] for m in convert(request(tools=[WEATHER]), echoed).messages] == ["system", "assistant", "tool"]


def test_tool_choice_and_formats_become_guides() -> None:
    forced = convert(request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}),
                     normalize_items("Hi"))
    assert forced.tools.mode == "forced" and '"const":"get_weather"' in forced.guide.text
    required = convert(request(tools=[WEATHER], tool_choice="required"), normalize_items("Hi"))
    assert required.tools.mode == "forced"
    # a format beside a forced call: the call's guide (the output is a call; the format has no text to shape)
    both = convert(request(tools=[WEATHER], tool_choice="required", text={"format": {"type": "json_object"}}),
                   normalize_items("Hi"))
    assert both.tools.mode == "forced" and both.guide == required.guide
    assert convert(request(tools=[WEATHER], tool_choice="none"), normalize_items("Hi")).tools.parses is False
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = convert(request(text={"format": {"type": "json_schema", "name": "c", "schema": schema, "strict": True}}),
                  normalize_items("Hi"))
    assert json.loads(fmt.guide.text) == schema
    assert json.loads(convert(request(text={"format": {"type": "json_object"}}), normalize_items("Hi")).guide.text) \
        == {"type": "object"}
    assert convert(request(text={"format": {"type": "text"}}), normalize_items("Hi")).guide is None


@pytest.mark.parametrize(("param", "fields"), [
    ("tools.0.type", {"tools": [{"type": "web_search"}]}),
    ("tools.0.type", {"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}),
    ("tools.0.type", {"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}),
    ("tools.0.type", {"tools": [{"type": "computer_use_preview"}]}),
    ("tool_choice.type", {"tool_choice": {"type": "web_search_preview"}}),
    ("background", {"background": True}),
    ("conversation", {"conversation": "conv_1"}),
    ("prompt", {"prompt": {"id": "pmpt_1"}}),
    ("reasoning", {"reasoning": {"effort": "medium"}}),
    ("truncation", {"truncation": "auto"}),
    ("include.0", {"include": ["reasoning.encrypted_content"]}),
    ("input.0.content.0.type", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
    ("input.0.content.0.type", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
    ("input.0.type", {"input": [{"type": "reasoning", "summary": []}]}),
    ("input.0.type", {"input": [{"type": "web_search_call", "id": "ws_1"}]}),
    ("input.0.role", {"input": [{"role": "robot", "content": "x"}]}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tool_choice.name", {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}),
    ("text.format.schema", {"text": {"format": {"type": "json_schema", "name": "x"}}}),
    # the chat dialect's function names (^[a-zA-Z0-9_-]{1,64}$), on the tools and the choice
    ("tools.0.name", {"tools": [{**WEATHER, "name": 'get"weather'}]}),
    ("tools.0.name", {"tools": [{**WEATHER, "name": "get weather"}]}),
    ("tools.0.name", {"tools": [{**WEATHER, "name": "get_weather\n"}]}),
    ("tools.0.name", {"tools": [{**WEATHER, "name": "x" * 65}]}),
    ("tool_choice.name", {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get weather"}}),
    # a function's arguments are a JSON object: its parameters an object schema
    ("tools.0.parameters", {"tools": [{**WEATHER, "parameters": {"type": "string"}}]}),
    ("tools.0.parameters", {"tools": [{**WEATHER, "parameters": {"properties": {"city": {"type": "string"}}}}]}),
])
def test_what_cannot_be_served_is_refused_by_name(param: str, fields: dict) -> None:
    error = refused(param, **fields)
    assert param.split(".")[0] in error.message


@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "name": "A", "schema": {"type": "object"}, "strict": True}])
def test_a_json_format_with_tools_the_model_may_call_is_the_format_or_calls(fmt: dict) -> None:
    """openai-agents' ``Agent(tools=..., output_type=Model)`` sends exactly this: the guide allows the
    format's JSON or function calls (one EBNF grammar, union_guide); ``parallel_tool_calls`` false, one call."""
    for choice in ({}, {"tool_choice": "auto"}):
        conversation = served(request(tools=[WEATHER], text={"format": fmt}, **choice))
        assert conversation.tools.mode == "auto" and conversation.guide.kind == "ebnf_grammar"
        assert '"<tool_call>\\n"' in conversation.guide.text and "format_root" in conversation.guide.text
    single = served(request(tools=[WEATHER], text={"format": fmt}, parallel_tool_calls=False))
    assert not single.tools.parallel and 'tool_calls ::= tool_call\n' in single.guide.text
    # tools shown but never called: the format's own JSON-schema guide
    assert convert(request(tools=[WEATHER], tool_choice="none", text={"format": fmt}),
                   normalize_items("Hi")).guide.kind == "json_schema"
    assert served(request(tools=[WEATHER], text={"format": {"type": "text"}})).tools.mode == "auto"


def test_valid_names_and_parameterless_functions_are_served() -> None:
    bare = {"type": "function", "name": "Get-Time_2", "parameters": {}}
    conversation = served(request(tools=[WEATHER, bare], tool_choice={"type": "function", "name": "Get-Time_2"}))
    assert conversation.tools.mode == "forced" and '"const":"Get-Time_2"' in conversation.guide.text


def test_reasoning_effort_none_is_served() -> None:
    refuse_unservable(request(reasoning={"effort": "none"}))


def test_a_continuation_rebuilds_the_same_tokens_as_the_whole_history(prompter: ChatPrompter) -> None:
    """What a continuation converts (stored input items + stored output items + new input) gives
    the input_ids of the same conversation sent whole, the way the SDK sends it back."""
    turn1 = request(instructions="Be brief.", tools=[WEATHER], input="Rain in Oslo?")
    stored_in = normalize_items(turn1.input)
    dialect = ResponsesDialect(turn1, previous_response_id=None, store=None)
    from server.gateway.api.completions import Outcome
    from server.gateway.api.tools import ToolCall

    outcome = Outcome(pieces=["Let me check."], completion_tokens=9, finish_reason="tool_calls",
                      tool_calls=[ToolCall("call_abc", "get_weather", '{"city": "Oslo"}')])
    stored_out = dialect.output(SimpleNamespace(logprobs=None), outcome)  # type: ignore[arg-type]
    new = [{"type": "function_call_output", "call_id": "call_abc", "output": "Light rain"},
           {"role": "user", "content": "Thanks. And tomorrow?"}]
    turn2 = request(instructions="Be brief.", tools=[WEATHER], input=new)
    chained = convert(turn2, stored_in + stored_out + normalize_items(turn2.input))
    whole_body = request(instructions="Be brief.", tools=[WEATHER],
                         input=[{"role": "user", "content": "Rain in Oslo?"}, *stored_out, *new])
    whole = convert(whole_body, normalize_items(whole_body.input))
    assert chained.messages == whole.messages
    ids = prompter.chat(chained.messages).input_ids
    assert ids == prompter.chat(whole.messages).input_ids
    assert len(ids) > prompter.chat(convert(turn1, stored_in).messages).total


def test_conversation_hints() -> None:
    context = SegmentRetention(60, None)
    plain = conversation_hints(request(), total=100, context=context, conversation=False)
    assert plain.empty
    keyed = conversation_hints(request(prompt_cache_key="k", prompt_cache_retention="in_memory"), total=100,
                               context=context, conversation=True)
    assert keyed.cache_key == "k" and keyed.retention == "in_memory"
    assert keyed.breakpoints == (Breakpoint(100, TTL_1H_MS),)
    assert conversation_hints(request(), total=100, context=SegmentRetention(60, 120_000),
                              conversation=True).breakpoints == (Breakpoint(100, 120_000),)
    assert conversation_hints(request(prompt_cache_retention="24h"), total=7, context=context,
                              conversation=True).breakpoints == (Breakpoint(7, TTL_24H_MS),)


def test_a_conversation_routes_by_its_root_unless_the_client_keys_it() -> None:
    context = SegmentRetention(60, None)
    rooted = conversation_hints(request(), total=10, context=context, conversation=True, root_id="resp_a")
    assert rooted.cache_key == "kvgate-conversation:resp_a"
    # the client's own prompt_cache_key is its grouping, and wins over the conversation's root
    assert conversation_hints(request(prompt_cache_key="team"), total=10, context=context, conversation=True,
                              root_id="resp_a").cache_key == "team"
    assert conversation_hints(request(), total=10, context=context, conversation=False).cache_key is None


def _events(frames: list[bytes]) -> list[dict]:
    out = []
    for frame in b"".join(frames).decode().strip().split("\n\n"):
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        out.append(event)
    return out


def _job(tokens_per_block: int = 16, prompter: ChatPrompter | None = None):  # what the renderer reads of a job
    pool = SimpleNamespace(tokens_per_block=tokens_per_block)
    return SimpleNamespace(prompt=SimpleNamespace(total=40), tenant=SimpleNamespace(pool=pool),
                           logprobs=None if prompter is None else 0, parses_tools=prompter is not None,
                           token_texts=None if prompter is None else prompter.token_texts,
                           tokenizer=None if prompter is None else prompter.tokenizer)


async def _collect(dialect: ResponsesDialect, job, outcome, deltas) -> list[dict]:  # type: ignore[no-untyped-def]
    return _events([frame async for frame in dialect.stream(job, outcome, deltas)])


async def test_a_mid_stream_engine_failure_is_an_error_then_response_failed() -> None:
    from server.gateway.api.completions import Outcome

    async def deltas():  # type: ignore[no-untyped-def]
        yield "Par"
        raise ServingError(503, "engine_unavailable", "the model's engine is unavailable; retry shortly")

    stored: list[dict] = []

    async def store(response: dict) -> bool:
        stored.append(response)
        return True

    events = await _collect(ResponsesDialect(request(), previous_response_id=None, store=store), _job(), Outcome(),
                            deltas())
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added", "response.output_text.delta", "error",
                                           "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(7))
    assert events[-2]["code"] == "engine_unavailable"  # the error event keeps the gateway's code
    failed = events[-1]["response"]
    # the response's error code is one of the SDK's ResponseError codes; its output is what was streamed
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["usage"] is None and failed["completed_at"] is None
    [message] = failed["output"]
    assert message["id"] == events[2]["item"]["id"]  # the message the stream opened
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "Par"
    assert stored == []  # a failed response is not stored


async def test_a_failed_stream_carries_the_usage_billed_for_its_tokens() -> None:
    """The tokens a failed stream generated are billed (completions.CompletionRunner._finish): its
    ``response.failed`` says so, as ``response.completed`` would."""
    from server.gateway.api.completions import Outcome

    outcome = Outcome()

    async def deltas():  # type: ignore[no-untyped-def]
        outcome.completion_tokens = 3
        outcome.pieces.append("Paris is")
        yield "Paris is"
        raise ServingError(503, "engine_unavailable", "the model's engine is unavailable; retry shortly")

    events = await _collect(ResponsesDialect(request(), previous_response_id=None, store=None), _job(), outcome,
                            deltas())
    failed = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and failed["status"] == "failed"
    assert failed["usage"]["output_tokens"] == 3 and failed["usage"]["input_tokens"] == 40
    assert failed["usage"]["total_tokens"] == 43


async def test_a_stream_that_fails_before_any_text_has_no_output() -> None:
    from server.gateway.api.completions import Outcome

    async def deltas():  # type: ignore[no-untyped-def]
        raise ServingError(503, "engine_unavailable", "the model's engine is unavailable; retry shortly")
        yield ""  # an async generator that fails at once

    events = await _collect(ResponsesDialect(request(), previous_response_id=None, store=None), _job(), Outcome(),
                            deltas())
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["output"] == []


async def test_stream_of_text_then_tool_calls_is_stored_before_completed() -> None:
    from server.gateway.api.completions import Outcome
    from server.gateway.api.tools import ToolCall

    outcome = Outcome(completion_tokens=12, finish_reason="tool_calls")
    order: list[str] = []

    async def deltas():  # type: ignore[no-untyped-def]
        for piece in ("Let me ", "check."):
            outcome.pieces.append(piece)
            yield piece
        outcome.tool_calls = [ToolCall("call_1", "get_weather", '{"city":"Oslo"}'),
                              ToolCall("call_2", "get_weather", '{"city":"Rome"}')]

    async def store(response: dict) -> bool:
        order.append("stored")
        assert [item["type"] for item in response["output"]] == ["message", "function_call"]  # max_tool_calls
        return False  # e.g. the byte cap was reached meanwhile

    body = request(tools=[WEATHER], max_tool_calls=1)
    events = await _collect(ResponsesDialect(body, previous_response_id="resp_prev", store=store), _job(), outcome,
                            deltas())
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert order == ["stored"]
    final = events[-1]["response"]
    assert final["store"] is False and final["previous_response_id"] == "resp_prev"
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert events[6]["text"] == "Let me check." and events[11]["arguments"] == '{"city":"Oslo"}'
    # 40 prompt tokens, 16 a block, none read from the cache: its 2 full blocks (32 tokens) were written
    assert final["usage"] == {"input_tokens": 40,
                              "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 32},
                              "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 52}
    assert isinstance(final["completed_at"], int) and final["completed_at"] >= final["created_at"]


@pytest.mark.parametrize(("reused", "cached", "written"), [(0, 0, 32), (1, 16, 16), (2, 32, 0), (3, 39, 0)])
def test_usage_says_the_prompt_tokens_written_to_the_cache(reused: int, cached: int, written: int) -> None:
    """Full blocks of the prompt (40 tokens, 16 a block: 32) less those read, never below 0; a third block
    (TensorRT-LLM's partial reuse) reads at most the prompt's tokens but the last, always computed."""
    from engines.contract import KvMetrics
    from server.gateway.api.completions import Outcome

    dialect = ResponsesDialect(request(), previous_response_id=None, store=None)
    outcome = Outcome(pieces=["Hi"], completion_tokens=1, finish_reason="stop", kv=KvMetrics(reused_blocks=reused))
    body = dialect.body(_job(), outcome)  # type: ignore[arg-type]
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": cached, "cache_write_tokens": written}
    assert body["status"] == "completed" and isinstance(body["completed_at"], int)
    length = Outcome(pieces=["Hi"], completion_tokens=1, finish_reason="length")
    cut = dialect.body(_job(), length)  # type: ignore[arg-type]
    assert cut["status"] == "incomplete" and cut["completed_at"] is None


@pytest.mark.parametrize(("param", "fields"), [
    ("input.0.type", {"input": [{"type": ["message"], "role": "user", "content": "x"}]}),
    ("input.0.content.0.type", {"input": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]}),
    ("tools.0.type", {"tools": [{"type": ["function"], "name": "f"}]}),
    ("tool_choice.type", {"tools": [WEATHER], "tool_choice": {"type": ["function"]}}),
    ("tool_choice.name", {"tools": [WEATHER], "tool_choice": {"type": "function", "name": ["get_weather"]}}),
    ("text.format.type", {"text": {"format": {"type": ["json_object"]}}}),
    ("input.0.content", {"input": [{"role": "user", "content": 7}]}),
    ("input.0.arguments", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}),
    ("text.format.strict", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "maybe"}}}),
    ("text.format.description", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {},
                                                     "description": 7}}}),
])
def test_malformed_json_is_a_400_not_a_500(param: str, fields: dict) -> None:
    refused(param, **fields)


def test_item_ids_must_not_repeat_in_the_request_or_its_chain() -> None:
    error = refused("input", input=[{"id": "x1", "role": "user", "content": "a"},
                                    {"id": "x1", "role": "user", "content": "b"}])
    assert error.message == "Duplicate item found with id 'x1'." and error.code == "invalid_request"
    history = normalize_items([{"id": "x1", "role": "user", "content": "a"}])
    again = refused("input", history, input=[{"id": "x1", "role": "user", "content": "b"}])
    assert again.message == "Duplicate item found with id 'x1'."
    assert served(request(input=[{"id": "x2", "role": "user", "content": "b"}]), history).messages[-1]["content"] == "b"


CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'}


@pytest.mark.parametrize(("message", "items"), [
    ("No tool call found for function call output with call_id 'call_x'.",
     [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_x", "output": "42"}]),
    ("No tool call found for function call output with call_id 'c1'.",  # an output before its call
     [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c1", "output": "42"}, CALL]),
    ("No tool output found for function call 'c1'.",
     [{"role": "user", "content": "hi"}, CALL, {"role": "user", "content": "again"}]),
    ("No tool output found for function call 'c1'.",
     [CALL, {**CALL, "call_id": "c2"}, {"type": "function_call_output", "call_id": "c2", "output": "x"}]),
])
def test_tool_calls_and_outputs_must_pair_up(message: str, items: list) -> None:
    assert refused("input", tools=[WEATHER], input=items).message == message


def test_a_continuation_answers_the_calls_that_ended_its_chain() -> None:
    history = normalize_items([{"role": "user", "content": "Rain in Oslo?"}, CALL])
    assert served(request(tools=[WEATHER], input=history)).tools  # a call may end a request: answered next turn
    for sent in ("never mind", []):
        ignored = refused("input", history, tools=[WEATHER], input=sent)
        assert ignored.message == "No tool output found for function call 'c1'."
    answer = request(tools=[WEATHER], input=[{"type": "function_call_output", "call_id": "c1", "output": "rain"}])
    assert served(answer, history).messages[-1] == {"role": "tool", "content": "rain"}


def test_outputs_sent_out_of_order_answer_their_own_calls() -> None:
    """The template renders results without ids (in call order): a run of outputs follows its calls' order."""
    calls = [CALL, {**CALL, "call_id": "c2", "arguments": '{"city":"Rome"}'}]
    answered = [{"type": "function_call_output", "call_id": "c2", "output": "sun in Rome"},
                {"type": "function_call_output", "call_id": "c1", "output": "rain in Oslo"}]
    ask = {"role": "user", "content": "Oslo and Rome?"}
    swapped = served(request(tools=[WEATHER], input=[ask, *calls, *answered]))
    in_order = served(request(tools=[WEATHER], input=[ask, *calls, *answered[::-1]]))
    assert [m["content"] for m in swapped.messages[-2:]] == ["rain in Oslo", "sun in Rome"]
    assert swapped.messages == in_order.messages


def test_a_call_id_reused_in_a_later_turn_is_answered_by_that_turns_output() -> None:
    """Turn 1 calls c1; turn 2 calls c2 then c1 again and answers them out of order: each output goes
    to the latest call of its id, and the first turn's c1 still needs its own output."""
    ask = {"role": "user", "content": "Oslo, then Rome and Oslo?"}
    rome = {**CALL, "call_id": "c2", "arguments": '{"city":"Rome"}'}
    first = [ask, CALL, {"type": "function_call_output", "call_id": "c1", "output": "rain in Oslo"}]
    second = [rome, CALL, {"type": "function_call_output", "call_id": "c2", "output": "sun in Rome"},
              {"type": "function_call_output", "call_id": "c1", "output": "snow in Oslo"}]
    messages = served(request(tools=[WEATHER], input=first + second)).messages
    assert [m["content"] for m in messages[-2:]] == ["sun in Rome", "snow in Oslo"]
    # the second turn's output for c1 does not answer the first turn's call too
    unanswered = [ask, CALL, rome, CALL, *second[2:]]
    assert refused("input", tools=[WEATHER], input=unanswered).message == "No tool output found for function call 'c1'."
    # two outputs after the second c1 both answer it, never the first turn's c1
    twice = [ask, CALL, {"role": "user", "content": "again?"}, CALL,
             {"type": "function_call_output", "call_id": "c1", "output": "o1"},
             {"type": "function_call_output", "call_id": "c1", "output": "o2"}]
    assert refused("input", tools=[WEATHER], input=twice).message == "No tool output found for function call 'c1'."


def test_metadata_within_openais_bounds() -> None:
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from server.gateway.errors import validation_error

    request(metadata={f"k{i:02}" + "k" * 61: "v" * 512 for i in range(16)})  # at the bounds: served
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}, {f"k{i}": "v" for i in range(17)}):
        with pytest.raises(ValidationError) as caught:
            request(metadata=metadata)
        error = validation_error(RequestValidationError(caught.value.errors()))
        assert error.status == 400 and error.param == "metadata", error.message


def test_a_null_stream_is_false() -> None:
    assert request(stream=None).stream is False and request(stream=True).stream is True


def _validation(**fields) -> ServingError:  # type: ignore[no-untyped-def]
    """The 400 the app answers for a body the schema refuses."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from server.gateway.errors import validation_error

    with pytest.raises(ValidationError) as caught:
        ResponsesRequest.model_validate({"model": "m", **fields})
    return validation_error(RequestValidationError(caught.value.errors()))


@pytest.mark.parametrize(("fields", "says"), [
    ({"input": [{"role": "user", "content": "a"}] * 1025}, "array too long: at most 1024 items, got 1025"),
    ({"input": "a" * 1_000_001}, "string too long: at most 1000000 characters"),
    ({"input": 5}, "must be a string or a list of input items"),
])
def test_an_input_out_of_bounds_names_input(fields: dict, says: str) -> None:
    error = _validation(**fields)
    assert error.status == 400 and error.param == "input" and says in error.message, error.message


def test_a_query_parameter_error_names_the_parameter() -> None:
    from fastapi.exceptions import RequestValidationError

    from server.gateway.errors import validation_error

    for loc, param in ((("query", "limit"), "limit"), (("query", "after"), "after"),
                       (("body", "input"), "input"), (("body", "tools", 0, "query"), "tools.0.query")):
        error = validation_error(RequestValidationError([{"loc": loc, "msg": "bad", "type": "value_error"}]))
        assert error.param == param and error.message == f"{param}: bad"


def test_input_may_be_left_out_of_a_continuation_only() -> None:
    history = normalize_items([{"role": "user", "content": "Rain in Oslo?"},
                               {"role": "assistant", "content": "Light rain."}])
    body = ResponsesRequest.model_validate({"model": "m", "previous_response_id": "resp_1"})
    assert request_items(body) == []
    assert [m["role"] for m in served(body, history).messages] == ["user", "assistant"]
    # the chain ended in a call: a continuation without input still owes its output
    called = normalize_items([{"role": "user", "content": "Rain in Oslo?"}, CALL])
    with pytest.raises(ServingError) as caught:
        served(ResponsesRequest.model_validate({"model": "m", "previous_response_id": "resp_1", "tools": [WEATHER]}),
               called)
    assert caught.value.param == "input" and caught.value.message == "No tool output found for function call 'c1'."
    for fields in ({}, {"input": None}):  # without previous_response_id, input is required
        with pytest.raises(ServingError) as caught:
            request_items(ResponsesRequest.model_validate({"model": "m", **fields}))
        assert caught.value.status == 400 and caught.value.param == "input", caught.value.message


def test_an_assistant_message_has_its_own_parts_only() -> None:
    error = refused("input.0.content.0.type", input=[{"role": "assistant", "content": [{"type": "input_text",
                                                                                         "text": "a"}]},
                                                     {"role": "user", "content": "b"}])
    assert "output_text or refusal" in error.message
    served(request(input=[{"role": "assistant", "content": "a plain string"}, {"role": "user", "content": "b"}]))
    parts = [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "no"}]
    assert served(request(input=[{"role": "assistant", "content": parts}, {"role": "user", "content": "b"}])) \
        .messages[0] == {"role": "assistant", "content": "ano"}


@pytest.mark.parametrize("strict", ["yes", 1, {}])
def test_a_tools_strict_is_a_boolean(strict: object) -> None:
    refused("tools.0.strict", tools=[{**WEATHER, "strict": strict}])
    for ok in (True, False, None):
        served(request(tools=[{**WEATHER, "strict": ok}]))


@pytest.mark.parametrize("item", [
    {"type": "custom_tool_call_output", "call_id": "c", "output": "x"},
    {"type": "custom_tool_call", "call_id": "c", "name": "x", "input": "y"},
    {"type": "mcp_call", "id": "m", "server_label": "s", "name": "f", "arguments": "{}"},
    {"type": "mcp_list_tools", "id": "m", "server_label": "s", "tools": []},
    {"type": "mcp_approval_request", "id": "m", "server_label": "s", "name": "f", "arguments": "{}"},
    {"type": "mcp_approval_response", "approval_request_id": "m", "approve": True},
    {"type": "shell_call_output", "call_id": "c", "output": []},
    {"type": "apply_patch_call_output", "call_id": "c", "status": "completed"},
    {"type": "tool_search_output", "tools": []},
])
def test_built_in_tool_items_are_refused_by_name(item: dict) -> None:
    error = refused("input.0.type", input=[item])
    assert error.code == "unsupported_parameter" and "built-in tools" in error.message, error.message
    assert item["type"] in error.message


def admission_refusal(limits: Limits, *, prompt_tokens: int, max_output_tokens: int) -> ServingError:
    """Admission's size refusal as the request core raises it (``Runner.run``: the limit is the param)."""
    with pytest.raises(AdmissionError) as caught:
        check_sizes(limits, prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens)
    return ServingError(caught.value.status, "limit_exceeded", str(caught.value), param=caught.value.limit)


def test_a_prompt_over_the_tenants_limit_is_context_length_exceeded() -> None:
    error = in_responses_words(admission_refusal(Limits(max_prompt_tokens=100), prompt_tokens=101,
                                                 max_output_tokens=10))
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "input")
    assert "101 tokens" in error.message and "max_prompt_tokens is 100" in error.message


def test_max_output_tokens_over_the_tenants_names_max_output_tokens() -> None:
    refusal = admission_refusal(Limits(max_output_tokens=256), prompt_tokens=10, max_output_tokens=300)
    error = in_responses_words(refusal)
    assert error is refusal and (error.status, error.code, error.param) == (400, "limit_exceeded", "max_output_tokens")
    assert error.message == "300 output tokens asked for; this tenant's max_output_tokens is 256"


def test_the_engines_refusal_of_a_long_prompt_is_context_length_exceeded() -> None:
    """The core's answer to the engine contract's refusal (``context_length_exceeded``, named after
    the chat field), in this API's words: param ``input``."""
    core = ServingError(400, "context_length_exceeded", "the prompt has 5003 tokens and this model accepts at most "
                        "2048", param="messages")
    error = in_responses_words(core)
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "input")
    assert "5003 tokens" in error.message and "at most 2048" in error.message
    other = ServingError(400, "engine_rejected", "the engine refused the request: top_logprobs > 0 is not served")
    assert in_responses_words(other) is other
    gone = ServingError(503, "engine_unavailable", "the model's engine is unavailable; retry shortly")
    assert in_responses_words(gone) is gone


TOOL_TEXT = "Let me check."
TOOL_BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _tool_outcome(prompter: ChatPrompter):  # type: ignore[no-untyped-def]
    """Text, then a tool call block the core held back: (outcome, text token count)."""
    from engines.contract import TokenLogProbs
    from server.gateway.api.completions import Outcome
    from server.gateway.api.tools import ToolCall

    text_ids, call_ids = prompter.tokenizer.encode(TOOL_TEXT), prompter.tokenizer.encode(TOOL_BLOCK)
    ids = text_ids + call_ids
    outcome = Outcome(pieces=[TOOL_TEXT], completion_tokens=len(ids), finish_reason="tool_calls",
                      token_ids=ids, log_probs=[TokenLogProbs(-0.01 * (i + 1)) for i in range(len(ids))],
                      tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Oslo"}')])
    return outcome, len(text_ids)


def test_a_messages_logprobs_are_its_texts_tokens_not_a_tool_calls(prompter: ChatPrompter) -> None:
    outcome, count = _tool_outcome(prompter)
    dialect = ResponsesDialect(request(tools=[WEATHER], include=["message.output_text.logprobs"]),
                               previous_response_id=None, store=None)
    message, call = dialect.output(_job(prompter=prompter), outcome)  # type: ignore[arg-type]
    logprobs = message["content"][0]["logprobs"]
    assert "".join(entry["token"] for entry in logprobs) == message["content"][0]["text"] == TOOL_TEXT
    assert [entry["logprob"] for entry in logprobs] == [lp.logprob for lp in outcome.log_probs[:count]]
    assert call["type"] == "function_call"
    # no tool call split off: the text is the whole generation, every token's log probs
    outcome.tool_calls, outcome.pieces = [], [TOOL_TEXT + TOOL_BLOCK]
    [whole] = dialect.output(_job(prompter=prompter), outcome)  # type: ignore[arg-type]
    assert len(whole["content"][0]["logprobs"]) == len(outcome.log_probs)
    # a forced call cut short: no call, no text, so no log probs (the tokens were the guide's wrapper)
    outcome.pieces = []
    [empty] = dialect.output(_job(prompter=prompter), outcome)  # type: ignore[arg-type]
    assert empty["content"][0]["text"] == "" and empty["content"][0]["logprobs"] == []


async def test_streamed_logprobs_are_the_texts_tokens_not_a_tool_calls(prompter: ChatPrompter) -> None:
    """Per token, then the text's last token in one engine chunk with the call's: the delta carries
    the text's tokens only, and ``.done`` the same as the deltas together."""
    from server.gateway.api.completions import Outcome

    whole, count = _tool_outcome(prompter)
    outcome = Outcome(completion_tokens=whole.completion_tokens, finish_reason="tool_calls")
    decode = prompter.tokenizer.new_decode_stream().push

    async def deltas():  # type: ignore[no-untyped-def]
        for i in range(count):
            last = i == count - 1  # arrives with the whole call block, which the core holds back
            upto = len(whole.token_ids) if last else i + 1
            outcome.token_ids.extend(whole.token_ids[len(outcome.token_ids):upto])
            outcome.log_probs.extend(whole.log_probs[len(outcome.log_probs):upto])
            piece = decode(whole.token_ids[i])
            outcome.pieces.append(piece)
            yield piece
        outcome.tool_calls = whole.tool_calls

    body = request(tools=[WEATHER], include=["message.output_text.logprobs"])
    events = await _collect(ResponsesDialect(body, previous_response_id=None, store=None), _job(prompter=prompter),
                            outcome, deltas())
    text_logprobs = [lp.logprob for lp in whole.log_probs[:count]]
    sent = [entry for e in events if e["type"] == "response.output_text.delta" for entry in e["logprobs"]]
    assert [entry["logprob"] for entry in sent] == text_logprobs
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["text"] == TOOL_TEXT and done["logprobs"] == sent
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["logprobs"] == sent and final["output"][1]["type"] == "function_call"


def test_prompt_cache_options_ttl_is_read_as_prompt_cache_retention() -> None:
    """The SDK's replacement of the deprecated ``prompt_cache_retention``: its ``ttl`` is the same
    intent ("12h" the extended retention, "30m" the default), a conflict and what cannot be
    served are refused by name, and the options applied are echoed."""
    context = SegmentRetention(60, None)
    for ttl, retention, breakpoint_ttl in (("12h", "24h", TTL_24H_MS), ("30m", "in_memory", TTL_1H_MS)):
        body = request(prompt_cache_options={"ttl": ttl})
        refuse_unservable(body)
        hints = conversation_hints(body, total=7, context=context, conversation=True)
        assert hints.retention == retention and hints.breakpoints == (Breakpoint(7, breakpoint_ttl),)
        agreeing = request(prompt_cache_options={"ttl": ttl, "mode": "implicit", "prewarm": False},
                           prompt_cache_retention=retention)
        refuse_unservable(agreeing)  # both given, the same intent: served
    echo = ResponsesDialect(request(prompt_cache_options={"ttl": "12h"}), previous_response_id=None,
                            store=None).response("completed", [])
    assert echo["prompt_cache_options"] == {"mode": "implicit", "ttl": "12h", "comparison_response_id": None}
    assert echo["prompt_cache_retention"] is None
    assert ResponsesDialect(request(), previous_response_id=None, store=None).response(
        "completed", [])["prompt_cache_options"] is None
    refused("prompt_cache_options.ttl", prompt_cache_options={"ttl": "12h"}, prompt_cache_retention="in_memory")
    refused("prompt_cache_options.mode", prompt_cache_options={"mode": "explicit"})
    refused("prompt_cache_options.prewarm", prompt_cache_options={"prewarm": True})
    for fields, param in (({"prompt_cache_options": {"ttl": "5m"}}, "prompt_cache_options.ttl"),
                          ({"prompt_cache_options": {"ttl": "12h", "retention": "x"}},
                           "prompt_cache_options.retention")):
        error = _validation(input="Hi", **fields)
        assert error.status == 400 and error.param == param, error.message


def test_the_stored_bound_counts_the_body_and_the_output_a_request_may_write() -> None:
    """What the byte cap's pre-check adds to the input items: the echoed body (exact) and the output
    bound from the output tokens, larger with tools and with log probs."""
    plain = ResponsesDialect(request(), previous_response_id=None, store=None)
    body = {k: v for k, v in plain.response("completed", []).items() if k != "output"}
    echoed = len(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode())
    assert plain.stored_bound(100) == echoed + 512 + 256 + 4 * 100
    assert plain.stored_bound(200) - plain.stored_bound(100) == 400
    long = ResponsesDialect(request(instructions="x" * 5000), previous_response_id=None, store=None)
    assert long.stored_bound(100) - plain.stored_bound(100) == len("\"" + "x" * 5000 + "\"") - len("null")  # echoed
    tools = ResponsesDialect(request(tools=[WEATHER]), previous_response_id=None, store=None)
    assert tools.stored_bound(64) > plain.stored_bound(64) + 4 * 256  # up to 64 // 16 calls
    logprobs = ResponsesDialect(request(include=["message.output_text.logprobs"], top_logprobs=2),
                                previous_response_id=None, store=None)
    assert logprobs.stored_bound(10) > plain.stored_bound(10) + 10 * 3 * 96 - 1
