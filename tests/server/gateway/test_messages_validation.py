"""What the Anthropic dialect refuses or normalizes before it builds a prompt: the fields of each
block (the SDK's param types), tool_choice per variant, tool names, blank text and stop sequences,
an empty system, the error body's request id, and the tools-first prompt whose tool breakpoint
covers exactly the tools."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from anthropic.types import (CacheControlEphemeralParam, TextBlockParam, ToolParam, ToolResultBlockParam,
                             ToolUseBlockParam)
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from engines.tokenizer import load_gguf_tokenizer
from retention.policy.hint_plan import HintPolicy
from retention.policy.hint_quota import HintLedger, plan_with_hints
from retention.policy.hints import TTL_1H_MS, TTL_5M_MS
from retention.types import RetentionPlan, TokenRange
from server.gateway.api import messages_convert
from server.gateway.api.messages_convert import cache_hints, convert
from retention.policy.hint_quota import cache_creation
from server.gateway.api.messages_render import MESSAGES, error_body
from server.gateway.api.messages_schemas import MessagesRequest
from server.gateway.api.prompting import ChatPrompter, TextMark
from server.gateway.api.tools import render_messages, tools_system_text
from server.gateway.context import REQUEST_ID
from server.gateway.errors import ServingError, validation_error
from tests.server.gateway.messages_bodies import EPHEMERAL, WEATHER, count_request, request, user

HOUR = {"type": "ephemeral", "ttl": "1h"}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
EXTRA = "Extra inputs are not permitted"


@pytest.fixture(scope="module")
def prompter() -> ChatPrompter:
    return ChatPrompter(load_gguf_tokenizer())


def refused(field: str, **fields) -> str:
    with pytest.raises(ServingError) as caught:
        convert(request(**fields))
    assert caught.value.status == 400 and caught.value.param == field, caught.value.message
    with pytest.raises(ServingError) as counted:  # count_tokens converts the same body
        convert(count_request(**{k: v for k, v in fields.items()}), generate=False)
    assert counted.value.param == field
    return caught.value.message


def answered(result: dict, call: dict = CALL) -> list[dict]:
    return [user("Weather in Oslo?"), {"role": "assistant", "content": [call]}, user([result])]


def result(**extra) -> dict:
    return {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 C", **extra}


def sdk_fields(param) -> frozenset[str]:
    return frozenset(param.__required_keys__ | param.__optional_keys__)


def test_each_block_takes_exactly_the_sdks_fields() -> None:
    assert messages_convert._TEXT_FIELDS == sdk_fields(TextBlockParam)
    assert messages_convert._TOOL_USE_FIELDS == sdk_fields(ToolUseBlockParam)
    assert messages_convert._TOOL_RESULT_FIELDS == sdk_fields(ToolResultBlockParam)
    assert messages_convert._TOOL_FIELDS == sdk_fields(ToolParam)
    assert messages_convert._CACHE_CONTROL_FIELDS == sdk_fields(CacheControlEphemeralParam)


@pytest.mark.parametrize("fields, field", [
    ({"messages": [user([{"type": "text", "text": "hi", "cache_contrl": EPHEMERAL}])]}, "messages.0.content.0.cache_contrl"),
    ({"system": [{"type": "text", "text": "s", "cache-control": EPHEMERAL}]}, "system.0.cache-control"),
    ({"messages": [user("a"), {"role": "assistant", "content": [{"type": "text", "text": "b", "x": 1}]}, user("c")]},
     "messages.1.content.0.x"),
    ({"tools": [WEATHER], "messages": answered(result(), {**CALL, "text": "x"})}, "messages.1.content.0.text"),
    ({"tools": [WEATHER], "messages": answered(result(iserror=True))}, "messages.2.content.0.iserror"),
    ({"tools": [WEATHER], "messages": answered(result(content=[{"type": "text", "text": "3 C", "cache_ctrl": EPHEMERAL}]))},
     "messages.2.content.0.content.0.cache_ctrl"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "tll": "1h"}}]},
     "system.0.cache_control.tll"),
    ({"tools": [{**WEATHER, "input_shema": {}}]}, "tools.0.input_shema"),
])
def test_an_unknown_field_on_a_block_is_refused_in_anthropics_words(fields, field) -> None:
    assert refused(field, **fields) == f"{field}: {EXTRA}"


def test_echoed_sdk_blocks_pass_and_their_extra_fields_are_checked() -> None:
    call = {**CALL, "caller": {"type": "direct"}, "toolset_name": None, "cache_control": EPHEMERAL}
    conv = convert(request(tools=[WEATHER], messages=[
        user([{"type": "text", "text": "Weather in Oslo?", "citations": None}]),
        {"role": "assistant", "content": [{"type": "text", "text": "Checking.", "citations": []}, call]},
        user([result(is_error=False, toolset_name="weather", cache_control=EPHEMERAL)])]))
    assert conv.messages[3] == {"role": "tool", "content": "3 C"} and len(conv.marks) == 2
    code = {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}
    refused("messages.1.content.0.caller", tools=[WEATHER], messages=answered(result(), {**CALL, "caller": code}))
    refused("messages.1.content.0.toolset_name", tools=[WEATHER], messages=answered(result(), {**CALL, "toolset_name": 5}))
    refused("messages.2.content.0.toolset_name", tools=[WEATHER], messages=answered(result(toolset_name=["x"])))
    refused("messages.0.content.0.citations", messages=[user([{"type": "text", "text": "a", "citations": "x"}])])


@pytest.mark.parametrize("choice, field, words", [
    ({"type": "auto", "name": "get_weather"}, "tool_choice.name", EXTRA),
    ({"type": "any", "name": "get_weather"}, "tool_choice.name", EXTRA),
    ({"type": "none", "disable_parallel_tool_use": True}, "tool_choice.disable_parallel_tool_use", EXTRA),
    ({"type": "none", "name": "get_weather"}, "tool_choice.name", EXTRA),
    ({"type": "tool"}, "tool_choice.name", "Field required"),
    ({"type": "tool", "name": None}, "tool_choice.name", "Field required"),
])
def test_tool_choice_takes_its_variants_fields_only(choice, field, words) -> None:
    assert refused(field, tools=[WEATHER], tool_choice=choice) == f"{field}: {words}"
    refused(field, tool_choice=choice)  # checked with or without tools


def test_tool_choice_variants_with_their_own_fields_are_served() -> None:
    for choice in ({"type": "auto", "disable_parallel_tool_use": True}, {"type": "any", "disable_parallel_tool_use": False},
                   {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, {"type": "none"}):
        assert convert(request(tools=[WEATHER], tool_choice=choice)).tools is not None


@pytest.mark.parametrize("name", ["get weather!", "", "a" * 129, "naïve", "get_weather\n", "a.b", "a/b"])
def test_a_tool_name_outside_anthropics_pattern_is_refused(name) -> None:
    assert "^[a-zA-Z0-9_-]{1,128}$" in refused("tools.0.name", tools=[{**WEATHER, "name": name}])


def test_a_tool_name_inside_the_pattern_is_served() -> None:
    for name in ("a" * 128, "get-weather_2", "X"):
        assert convert(request(tools=[{**WEATHER, "name": name}])).functions[0]["name"] == name


@pytest.mark.parametrize("system", ["", []])
def test_an_empty_system_is_no_system(prompter, system) -> None:
    assert convert(count_request(system=system), generate=False) == convert(count_request(), generate=False)
    plain = prompter.chat(convert(request()).messages)
    assert prompter.chat(convert(request(system=system)).messages).input_ids == plain.input_ids
    # the template's default system prompt stays, as when system is omitted
    assert "<|im_start|>system" in prompter.tokenizer.decode(plain.input_ids, skip_special_tokens=False)
    with_tools = convert(request(system=system, tools=[{**WEATHER, "cache_control": EPHEMERAL}]))
    assert with_tools == convert(request(tools=[{**WEATHER, "cache_control": EPHEMERAL}]))
    assert with_tools.marks == (1,)  # no system text after the tools: the breakpoint ends with their message


@pytest.mark.parametrize("fields, field", [
    ({"messages": [user("   ")]}, "messages.0.content"),
    ({"messages": [user([{"type": "text", "text": "\n\t"}])]}, "messages.0.content.0.text"),
    ({"system": [{"type": "text", "text": " "}]}, "system.0.text"),
    ({"tools": [WEATHER], "messages": answered(result(content=[{"type": "text", "text": "\n"}]))},
     "messages.2.content.0.content.0.text"),
])
def test_whitespace_only_text_is_refused_in_anthropics_words(fields, field) -> None:
    assert refused(field, **fields) == f"{field}: text content blocks must contain non-whitespace text"


def test_whitespace_only_assistant_text_stays_accepted() -> None:
    # kvgate's own streamed answer may be a "\n" text block before a tool_use: echoing it back is served
    conv = convert(request(tools=[WEATHER], messages=[
        user("Weather?"), {"role": "assistant", "content": [{"type": "text", "text": "\n"}, CALL]}, user([result()])]))
    assert conv.messages[2]["content"].startswith("<tool_call>")


def test_a_whitespace_only_stop_sequence_is_refused_in_anthropics_words() -> None:
    with pytest.raises(ValidationError) as caught:
        request(stop_sequences=["END", "\n"])
    error = validation_error(RequestValidationError(
        [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]))
    assert error.status == 400 and error.message == "stop_sequences: each stop sequence must contain non-whitespace"
    assert request(stop_sequences=["\nEND", " x "]).stop_sequences == ["\nEND", " x "]


def test_error_bodies_carry_the_request_id() -> None:
    token = REQUEST_ID.set("req_0123456789abcdef01234567")
    try:
        body = error_body(ServingError(400, "invalid_request", "why"))
    finally:
        REQUEST_ID.reset(token)
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "why"},
                    "request_id": "req_0123456789abcdef01234567"}


async def test_the_streams_error_event_carries_the_request_id() -> None:
    from types import SimpleNamespace

    from engines.contract import KvMetrics
    from retention.policy.hints import CacheHints
    from server.gateway.api.completions import Outcome
    from server.gateway.api.prompting import PreparedPrompt

    async def failing() -> AsyncIterator[str]:
        yield "Par"
        raise ServingError(503, "engine_unavailable", "the engine went away")

    job = SimpleNamespace(prompt=PreparedPrompt((1, 2, 3), 0, 0), hints=CacheHints(), model="m",
                          tenant=SimpleNamespace(pool=SimpleNamespace(tokens_per_block=16)))
    token = REQUEST_ID.set("req_" + "ab" * 12)
    try:
        frames = [f async for f in MESSAGES.stream(job, Outcome(kv=KvMetrics(reused_blocks=0)), failing())]
    finally:
        REQUEST_ID.reset(token)
    event = b"".join(frames).decode().strip().split("\n\n")[-1]
    assert event.startswith("event: error\n")
    assert json.loads(event.split("data: ", 1)[1]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the engine went away"},
        "request_id": "req_" + "ab" * 12}


def test_the_tools_open_the_system_message_on_the_messages_path_only() -> None:
    conv = convert(request(system="You are terse.", tools=[WEATHER]))
    block = tools_system_text(conv.functions)
    assert conv.messages[0] == {"role": "system", "content": f"{block}\n\nYou are terse."}
    # the chat-completions and Responses paths keep the system text first
    chat = render_messages([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
                           conv.functions)
    assert chat[0] == {"role": "system", "content": f"You are terse.\n\n{block}"}


def _hinted_windows(prompter: ChatPrompter, body: MessagesRequest, tokens_per_block: int = 16):
    conv = convert(body)
    prompt = prompter.chat(conv.messages, conv.marks)
    hints = cache_hints(conv, prompt)
    plan = RetentionPlan((TokenRange(0, None, 35, 30_000),), 35, 30_000)
    hinted = plan_with_hints(plan, hints, HintPolicy(enabled=True), total=prompt.total, tokens_per_block=tokens_per_block,
                             hashes=[9000 + i for i in range(prompt.total // tokens_per_block)], ledger=HintLedger(),
                             tenant="t", budget_blocks=1000, now=0.0)
    return conv, prompt, hints, hinted


def test_a_tool_breakpoint_covers_exactly_the_tools(prompter) -> None:
    system = [{"type": "text", "text": "You answer geography questions tersely. " * 20, "cache_control": EPHEMERAL}]
    conv, prompt, hints, hinted = _hinted_windows(
        prompter, request(tools=[{**WEATHER, "cache_control": HOUR}], system=system))
    assert conv.marks == (TextMark(0, len(tools_system_text(conv.functions))), 1)
    assert prompt.input_ids == prompter.chat(conv.messages).input_ids  # the mark inside message 0 changes no id
    tools_end = prompt.marks[0]
    decoded = prompter.tokenizer.decode(prompt.input_ids[:tools_end], skip_special_tokens=False)
    assert decoded == "<|im_start|>system\n" + tools_system_text(conv.functions)  # the tools, nothing of the system
    assert [(b.token_end, b.ttl_ms) for b in hints.breakpoints] == [(tools_end, TTL_1H_MS),
                                                                  (prompt.system_end, TTL_5M_MS)]
    # usage: the tools' blocks are written for 1 h, the system text's for 5 min (a block is kept for
    # the breakpoint whose range holds its first token)
    five, hour = cache_creation(hinted, 0, 16)
    assert hour == -(-tools_end // 16) * 16 and five == -(-prompt.system_end // 16) * 16 - hour > 0


def test_the_same_tools_under_another_system_mark_the_same_tokens(prompter) -> None:
    tools = [{**WEATHER, "cache_control": HOUR}]
    first = prompter.chat(*(lambda c: (c.messages, c.marks))(convert(request(tools=tools, system="Be brief."))))
    second = prompter.chat(*(lambda c: (c.messages, c.marks))(convert(request(tools=tools, system="Answer in French."))))
    assert first.marks[0] == second.marks[0] and first.input_ids[:first.marks[0]] == second.input_ids[:second.marks[0]]
