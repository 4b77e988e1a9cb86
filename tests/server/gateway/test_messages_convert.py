"""The Anthropic dialect's conversion, breakpoints and usage split, on the real tokenizer and template."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engines.contract import KvMetrics
from engines.tokenizer import load_gguf_tokenizer
from retention.policy.hint_plan import HintPolicy
from retention.policy.hint_quota import HintedPlan, HintLedger, cache_creation, plan_with_hints
from retention.policy.hints import TTL_1H_MS, TTL_5M_MS, Breakpoint, CacheHints
from retention.types import RetentionPlan, TokenRange
from server.gateway.api.completions import Outcome
from server.gateway.api.messages_convert import cache_hints, convert
from server.gateway.api.messages_render import MESSAGES, stop_reason, usage
from server.gateway.api.prompting import ChatPrompter, PreparedPrompt, TextMark
from server.gateway.api.tools import CALL_OPEN, ToolCall, tools_system_text
from server.gateway.errors import ServingError
from tests.server.gateway.messages_bodies import EPHEMERAL, WEATHER, count_request, request, user



@pytest.fixture(scope="module")
def prompter() -> ChatPrompter:
    return ChatPrompter(load_gguf_tokenizer())


def refused(field: str, **fields) -> str:
    with pytest.raises(ServingError) as caught:
        convert(request(**fields))
    assert caught.value.status == 400 and caught.value.param == field, caught.value.message
    return caught.value.message


def calls(*ids: str, name: str = "get_weather") -> dict:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": name, "input": {"city": i}}
                                             for i in ids]}


def result(call_id: str, content="ok", **extra) -> dict:
    return {"type": "tool_result", "tool_use_id": call_id, "content": content, **extra}


def test_a_conversation_with_tools_becomes_the_chat_paths_messages(prompter) -> None:
    conv = convert(request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}], tools=[WEATHER],
        messages=[{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": {"city": "Oslo"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 C"},
                                               {"type": "text", "text": "Warm enough?"}]}]))
    roles = [m["role"] for m in conv.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    # the tools first, then the system text: Anthropic's cache prefix order (tools → system → messages)
    assert conv.messages[0]["content"].startswith("# Tools") and conv.messages[0]["content"].endswith(
        "</tool_call>\n\nBe brief.\nUse tools.")
    assert f'{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}' in conv.messages[2]["content"]
    assert conv.messages[3]["content"] == "3 C" and conv.messages[4]["content"] == "Warm enough?"
    assert conv.tools is not None and conv.tools.mode == "auto" and conv.tools.parallel and conv.guide is None
    assert conv.functions == [{"name": "get_weather", "description": "Weather in a city",
                               "parameters": WEATHER["input_schema"]}]
    assert prompter.chat(conv.messages).total > 0


def test_tool_choice_maps_to_the_same_tool_plans_as_the_openai_path() -> None:
    forced = convert(request(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}))
    assert forced.tools.mode == "forced" and json.loads(forced.guide.text)["properties"]["name"] == {"const": "get_weather"}
    anyone = convert(request(tools=[WEATHER, {**WEATHER, "name": "other"}], tool_choice={"type": "any"}))
    assert anyone.tools.mode == "forced" and "anyOf" in json.loads(anyone.guide.text)
    single = convert(request(tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True}))
    assert single.tools.mode == "auto" and not single.tools.parallel
    assert convert(request(tools=[WEATHER], tool_choice={"type": "none"})).tools.mode == "none"


@pytest.mark.parametrize("fields, field", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]}, "messages.0.content.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages.1"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}, {"role": "user", "content": "r"}]},
     "messages.1.content.0.input"),
    ({"system": [{"type": "text", "text": "s", "cache_control": "yes"}]}, "system.0.cache_control"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "x"}]}, "tools.0.input_schema"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"system": [{"type": "text", "text": "a", "cache_control": {"type": "persistent"}}]}, "system.0.cache_control"),
    ({"system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
     "system.0.cache_control.ttl"),
])
def test_what_cannot_be_served_is_refused_by_name(fields, field) -> None:
    assert refused(field, **fields).startswith(field + ":")


def test_at_most_four_breakpoints_and_no_1h_after_5m() -> None:
    blocks = [{"type": "text", "text": f"s{i}", "cache_control": EPHEMERAL} for i in range(5)]
    assert "maximum of 4" in refused("system.4.cache_control", system=blocks)
    assert len(convert(request(system=blocks[:4])).marks) == 4
    mixed = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "5m"}},
             {"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    refused("system.1.cache_control.ttl", system=mixed)
    ok = convert(request(system=mixed[::-1]))
    assert ok.ttls == (TTL_1H_MS, TTL_5M_MS)


def test_breakpoints_end_where_their_message_ends(prompter) -> None:
    body = request(
        tools=[{**WEATHER, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        system=[{"type": "text", "text": "You are terse.", "cache_control": EPHEMERAL}],
        messages=[{"role": "user", "content": "Long document " * 30},
                  {"role": "assistant", "content": "Read it."},
                  {"role": "user", "content": [{"type": "text", "text": "First question?", "cache_control": EPHEMERAL},
                                               {"type": "text", "text": "Second part."}]}])
    conv = convert(body)
    # the tools' breakpoint ends with their text, which opens the system message; the system block's with it
    assert conv.marks == (TextMark(0, len(tools_system_text(conv.functions))), 1, 4)
    prompt = prompter.chat(conv.messages, conv.marks)
    plain = prompter.chat(conv.messages)
    assert prompt.input_ids == plain.input_ids  # cuts at message ends (and a mark inside one) leave the ids alone
    assert (prompt.system_end, prompt.context_end) == (plain.system_end, plain.context_end)
    hints = cache_hints(conv, prompt)
    assert hints.breakpoints == (Breakpoint(prompt.marks[0], TTL_1H_MS), Breakpoint(prompt.system_end, TTL_5M_MS),
                                 Breakpoint(prompt.marks[2], TTL_5M_MS))
    tokenizer = prompter.tokenizer
    tools = tokenizer.decode(prompt.input_ids[:prompt.marks[0]], skip_special_tokens=False)
    assert tools.startswith("<|im_start|>system\n# Tools") and tools.endswith("</tool_call>")  # the tools alone
    assert tokenizer.decode(prompt.input_ids[prompt.marks[0]:prompt.system_end],
                            skip_special_tokens=False) == "\n\nYou are terse.<|im_end|>\n"
    head = tokenizer.decode(prompt.input_ids[:prompt.marks[2]], skip_special_tokens=False)
    rest = tokenizer.decode(prompt.input_ids[prompt.marks[2]:], skip_special_tokens=False)
    assert head.endswith("Second part.<|im_end|>\n")  # rounded up to the end of the block's message
    assert rest.startswith("<|im_start|>assistant")


def _hinted(hints: CacheHints, total: int, *, policy: HintPolicy = HintPolicy(enabled=True), budget: int = 1000):
    """The hints as the gateway applies them (``Outcome.hinted``) to a ``total``-token prompt of 16-token blocks."""
    plan = RetentionPlan((TokenRange(0, None, 35, 30_000),), 35, 30_000)
    return plan_with_hints(plan, hints, policy, total=total, tokens_per_block=16,
                           hashes=[7000 + i for i in range(total // 16)], ledger=HintLedger(), tenant="t",
                           budget_blocks=budget, now=0.0)


def test_usage_splits_the_prompt_into_read_created_and_the_rest() -> None:
    hints = CacheHints((Breakpoint(40, TTL_1H_MS), Breakpoint(100, TTL_5M_MS)))
    applied = _hinted(hints, 130)
    # A block is kept for the range holding its first token: blocks 0-2 (tokens 0-47) 1 h,
    # blocks 3-6 (48-111) 5 min; the tokens past block 6 are not kept under a hint.
    assert applied.windows_ms == (TTL_1H_MS,) * 3 + (TTL_5M_MS,) * 4
    assert cache_creation(applied, 0, 16) == (64, 48)
    assert cache_creation(applied, 32, 16) == (64, 16)
    assert cache_creation(applied, 64, 16) == (48, 0)
    assert cache_creation(applied, 112, 16) == (0, 0)
    # Blocks an earlier hint still pins, which this request only kept (keep_pins), are not its writes.
    kept_only = HintedPlan(applied.plan, kept_hashes=(7000, 7001), kept_durations_ms=(60_000, 60_000))
    assert cache_creation(kept_only, 0, 16) == (0, 0)
    job = SimpleNamespace(prompt=PreparedPrompt(tuple(range(130)), 10, 20), hints=hints,
                          tenant=SimpleNamespace(pool=SimpleNamespace(tokens_per_block=16)), model="m")
    outcome = Outcome(completion_tokens=5, kv=KvMetrics(reused_blocks=2), hinted=applied)
    got = usage(job, outcome)
    assert got == {"input_tokens": 18, "cache_creation_input_tokens": 80, "cache_read_input_tokens": 32,
                   "output_tokens": 5, "cache_creation": {"ephemeral_5m_input_tokens": 64, "ephemeral_1h_input_tokens": 16}}
    assert got["input_tokens"] + got["cache_creation_input_tokens"] + got["cache_read_input_tokens"] == 130


def test_usage_reports_creation_only_for_the_hints_the_gateway_applied() -> None:
    hints = CacheHints((Breakpoint(40, TTL_1H_MS), Breakpoint(100, TTL_5M_MS)))
    job = SimpleNamespace(prompt=PreparedPrompt(tuple(range(130)), 10, 20), hints=hints,
                          tenant=SimpleNamespace(pool=SimpleNamespace(tokens_per_block=16)), model="m")

    def created(hinted) -> tuple[int, int, int]:
        got = usage(job, Outcome(kv=KvMetrics(reused_blocks=0), hinted=hinted))
        return (got["cache_creation_input_tokens"], got["cache_creation"]["ephemeral_5m_input_tokens"],
                got["cache_creation"]["ephemeral_1h_input_tokens"])

    assert created(None) == (0, 0, 0)  # the class does not honour hints: nothing kept under one
    assert created(_hinted(hints, 130, policy=HintPolicy())) == (0, 0, 0)  # hints off in the class
    assert created(_hinted(hints, 130, budget=0)) == (0, 0, 0)  # no room in the hint budget
    assert created(_hinted(hints, 130, budget=2)) == (32, 0, 32)  # the budget cut it after two blocks
    # The class caps a 1 h hint at 10 min: kept for less than an hour, it is not a 1 h write.
    capped = _hinted(hints, 130, policy=HintPolicy(enabled=True, max_ttl_ms=600_000))
    assert created(capped) == (112, 112, 0)


def test_stop_reasons_and_the_message_object() -> None:
    assert stop_reason(Outcome(finish_reason="length")) == "max_tokens"
    assert stop_reason(Outcome(finish_reason="stop")) == "end_turn"
    assert stop_reason(Outcome(finish_reason="stop", stop_sequence="\n\n")) == "stop_sequence"
    call = ToolCall("call_abc", "get_weather", '{"city": "Oslo"}')
    outcome = Outcome(pieces=["Sure."], finish_reason="tool_calls", tool_calls=[call], completion_tokens=9)
    job = SimpleNamespace(prompt=PreparedPrompt((1, 2, 3), 0, 0), hints=CacheHints(),
                          tenant=SimpleNamespace(pool=SimpleNamespace(tokens_per_block=16)), model="m")
    body = MESSAGES.body(job, outcome)
    assert body["id"].startswith("msg_") and body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["content"] == [{"type": "text", "text": "Sure."},
                               {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Oslo"}}]


def test_the_2026_fields_top_level_cache_control_output_config_thinking() -> None:
    # top-level cache_control: a breakpoint after the last message, counted among the four, ordered last
    auto = convert(request(cache_control={"type": "ephemeral", "ttl": "1h"}))
    assert auto.marks == (len(auto.messages),) and auto.ttls == (TTL_1H_MS,)
    system = [{"type": "text", "text": "s", "cache_control": EPHEMERAL}]
    refused("cache_control.ttl", system=system, cache_control={"type": "ephemeral", "ttl": "1h"})
    refused("cache_control", system=system * 4, cache_control=EPHEMERAL)
    # output_config.format: the same JSON-schema guide as response_format; not with a forced tool
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    shaped = convert(request(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"}))
    assert shaped.guide.kind == "json_schema" and json.loads(shaped.guide.text) == schema and shaped.tools is None
    refused("output_config.format", tools=[WEATHER], tool_choice={"type": "any"},
            output_config={"format": {"type": "json_schema", "schema": schema}})
    # with tools the model may call: the format's JSON or tool_use calls, one grammar (union_guide)
    either = convert(request(tools=[WEATHER], output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert either.guide.kind == "ebnf_grammar" and either.tools.mode == "auto"
    shown = convert(request(tools=[WEATHER], tool_choice={"type": "none"},
                            output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert shown.guide.kind == "json_schema"  # tools shown, never called: the format holds
    # thinking: adaptive lets the model decide (this one never thinks); an explicit budget is refused
    assert convert(request(thinking={"type": "adaptive"})).guide is None
    refused("diagnostics", diagnostics={"previous_message_id": "msg_1"})


def test_errors_map_to_anthropics_types_and_statuses() -> None:
    from server.gateway.api.messages_render import error_response

    for status, (expected, kind) in {400: (400, "invalid_request_error"), 401: (401, "authentication_error"),
                                     403: (403, "permission_error"), 404: (404, "not_found_error"),
                                     413: (413, "request_too_large"), 429: (429, "rate_limit_error"),
                                     503: (529, "overloaded_error"), 504: (504, "timeout_error")}.items():
        response = error_response(ServingError(status, "code", "why", headers={"Retry-After": "1"}))
        assert response.status_code == expected and response.headers["retry-after"] == "1"
        assert json.loads(response.body) == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_the_stop_matcher_names_the_stop_string_that_cut_the_text() -> None:
    from server.gateway.api.stops import StopMatcher

    matcher = StopMatcher(("b", "cd"))
    assert matcher.push("xxc") == "xx" and matcher.matched is None  # "c" held: it may start "cd"
    assert matcher.push("db") == "" and matcher.stopped and matcher.matched == "cd"  # the earliest match wins


BAD = ["5m"]  # a JSON list where a string is expected: once a 500 (unhashable in a dict or set lookup)


@pytest.mark.parametrize("fields, field", [
    ({"messages": [user([{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": BAD}}])]},
     "messages.0.content.0.cache_control.ttl"),
    ({"cache_control": {"type": "ephemeral", "ttl": {"a": 1}}}, "cache_control.ttl"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": 5}}]},
     "system.0.cache_control.ttl"),
    ({"tools": [{**WEATHER, "cache_control": {"type": "ephemeral", "ttl": BAD}}]}, "tools.0.cache_control.ttl"),
    ({"system": [{"type": {"a": 1}, "text": "s"}]}, "system.0.type"),
    ({"messages": [user([{"type": BAD, "text": "x"}])]}, "messages.0.content.0.type"),
    ({"messages": [user("a"), {"role": "assistant", "content": [{"type": BAD}]}, user("b")]},
     "messages.1.content.0.type"),
    ({"tools": [WEATHER], "messages": [user("a"), calls("t"), user([result("t", [{"type": BAD}])])]},
     "messages.2.content.0.content.0.type"),
    ({"tools": [WEATHER], "messages": [user("a"), calls("t"), user([result("t", [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": BAD}}])])]},
     "messages.2.content.0.content.0.cache_control.ttl"),
    ({"tools": [WEATHER], "messages": [user("a"), calls("t"), user([result(BAD)])]},
     "messages.2.content.0.tool_use_id"),
    ({"tools": [{**WEATHER, "type": BAD}]}, "tools.0.type"),
])
def test_a_list_or_object_where_a_string_is_expected_is_a_400_naming_the_field(fields, field) -> None:
    assert refused(field, **fields).startswith(field + ":")
    with pytest.raises(ServingError) as counted:  # count_tokens converts the same body
        convert(count_request(**fields))
    assert counted.value.status == 400 and counted.value.param == field


def test_tool_results_answer_their_calls_by_id_in_the_order_of_the_calls() -> None:
    conv = convert(request(tools=[WEATHER], messages=[
        user("Oslo and Paris?"), calls("toolu_A", "toolu_B"),
        user([{"type": "text", "text": "Here:"}, result("toolu_B", "Paris: sun"), result("toolu_A", "Oslo: rain")])]))
    # Hermes pairs results with calls by position: A's result first, whatever order the client sent them in;
    # the message's text follows the results it comes with
    assert [(m["role"], m["content"]) for m in conv.messages[3:]] == [
        ("tool", "Oslo: rain"), ("tool", "Paris: sun"), ("user", "Here:")]


def test_consecutive_messages_of_a_role_are_one_turn_whose_results_answer_its_calls(prompter) -> None:
    def tail(messages: list[dict]) -> list[tuple[str, str]]:
        conv = convert(request(tools=[WEATHER], messages=[user("Oslo and Paris?"), *messages]))
        assert prompter.chat(conv.messages).total > 0
        return [(m["role"], m["content"]) for m in conv.messages[2:]]

    # Anthropic combines consecutive user (or assistant) messages into one turn; pairing is per turn
    split_results = tail([calls("A", "B"), user([result("A", "rain")]), user([result("B", "sun")])])
    assert [role for role, _ in split_results] == ["assistant", "tool", "tool"]
    assert split_results[1:] == [("tool", "rain"), ("tool", "sun")]
    text_after_calls = tail([calls("A"), {"role": "assistant", "content": "Checking."}, user([result("A", "rain")])])
    assert [role for role, _ in text_after_calls] == ["assistant", "tool"]  # one assistant message: the turn
    assert text_after_calls[0][1].startswith(f"Checking.\n{CALL_OPEN}") and text_after_calls[1] == ("tool", "rain")
    # a turn's results come first and in the order of the turn's calls (Hermes pairs by position),
    # across its messages; then one user message with its messages' text, in order
    reordered = tail([calls("A"), calls("B"), user([result("B", "sun"), {"type": "text", "text": "Here:"}]),
                      user([{"type": "text", "text": "And?"}, result("A", "rain")])])
    assert [role for role, _ in reordered] == ["assistant", "tool", "tool", "user"]
    assert reordered[1:] == [("tool", "rain"), ("tool", "sun"), ("user", "Here:\nAnd?")]
    # a result's breakpoint ends with its tool message, after the reordering
    conv = convert(request(tools=[WEATHER], messages=[user("a"), calls("A", "B"), user([result("B", "b")]),
                                                      user([{**result("A", "a"), "cache_control": EPHEMERAL}])]))
    assert conv.messages[3] == {"role": "tool", "content": "a"} and conv.marks == (4,)


def text(value: str, **extra) -> dict:
    return {"type": "text", "text": value, **extra}


def test_consecutive_user_messages_render_as_one_user_message(prompter) -> None:
    # Anthropic combines consecutive user messages into one turn: one user message, texts joined by "\n"
    conv = convert(request(messages=[user("Hello."), user([text("Line one."), text("Line two.")])]))
    assert conv.messages == [{"role": "user", "content": "Hello.\nLine one.\nLine two."}]
    single = convert(request(messages=[user("Hello.\nLine one.\nLine two.")]))
    assert conv == single and prompter.chat(conv.messages).input_ids == prompter.chat(single.messages).input_ids
    # a message of results only adds no text; the turn's results come first, then its one user message
    conv = convert(request(tools=[WEATHER], messages=[
        user("Oslo and Paris?"), calls("A", "B"), user("Before."), user([result("B", "sun"), result("A", "rain")]),
        user("After.")]))
    assert conv.messages[3:] == [{"role": "tool", "content": "rain"}, {"role": "tool", "content": "sun"},
                                 {"role": "user", "content": "Before.\nAfter."}]
    # a turn of results only appends no user message
    conv = convert(request(tools=[WEATHER], messages=[user("q"), calls("A", "B"), user([result("A", "rain")]),
                                                      user([result("B", "sun")])]))
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "tool"]


def test_consecutive_assistant_messages_render_as_one_assistant_message(prompter) -> None:
    def use(call_id: str, city: str) -> dict:
        return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": city}}

    merged = convert(request(tools=[WEATHER], messages=[
        user("Oslo and Paris?"), {"role": "assistant", "content": [text("Checking Oslo."), use("A", "Oslo")]},
        {"role": "assistant", "content": [use("B", "Paris"), text("And Paris.")]},
        user([result("A", "rain"), result("B", "sun")])]))
    assert [m["role"] for m in merged.messages] == ["system", "user", "assistant", "tool", "tool"]
    call = f'{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "%s"}}}}\n</tool_call>'
    # the turn's blocks combined as one message's: text blocks joined as written, as within a message
    assert merged.messages[2]["content"] == "Checking Oslo.And Paris.\n" + call % "Oslo" + "\n" + call % "Paris"
    # the same chat request as one assistant message holding that text and both calls
    single = convert(request(tools=[WEATHER], messages=[
        user("Oslo and Paris?"), {"role": "assistant", "content": [
            text("Checking Oslo."), use("A", "Oslo"), use("B", "Paris"), text("And Paris.")]},
        user([result("A", "rain"), result("B", "sun")])]))
    assert merged == single
    assert prompter.chat(merged.messages).input_ids == prompter.chat(single.messages).input_ids
    # text only (no tools, nothing rendered): the chat message itself, with no tool_calls
    conv = convert(request(messages=[user("q"), {"role": "assistant", "content": "a"},
                                     {"role": "assistant", "content": [text("b"), text("c")]}, user("d")]))
    assert conv.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "abc"},
                             {"role": "user", "content": "d"}]


def test_the_chat_message_of_an_assistant_turn_keeps_the_single_message_shape() -> None:
    from server.gateway.api.messages_convert import _Breakpoints, _turns

    body = request(messages=[user("q"), calls("A"), {"role": "assistant", "content": "Checking."}, calls("B"),
                             user([result("A"), result("B")])])
    out: list[dict] = []
    _turns(body.messages, out, _Breakpoints())
    assert out[1] == {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"name": "get_weather", "arguments": '{"city": "A"}'}, {"name": "get_weather", "arguments": '{"city": "B"}'}]}
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool"]


def test_single_message_turns_render_one_chat_message_each() -> None:
    conv = convert(request(messages=[user([text("a"), text("b")]),
                                     {"role": "assistant", "content": [text("c"), text("d", cache_control=EPHEMERAL)]},
                                     user("e")]))
    # a message's text blocks: "\n" in a user message, as written in an assistant one (as before)
    assert conv.messages == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "cd"},
                             {"role": "user", "content": "e"}]
    assert conv.marks == (2,) and conv.ttls == (TTL_5M_MS,)


def test_a_breakpoint_in_a_merged_turn_ends_with_the_turns_message(prompter) -> None:
    history = [user("Long document " * 30), {"role": "assistant", "content": "Read it."}]
    body = request(system=[text("You are terse.")], messages=[
        *history, user("First question?"), user([text("Second part.", cache_control=EPHEMERAL)])])
    conv = convert(body)
    assert conv.messages[3] == {"role": "user", "content": "First question?\nSecond part."} and conv.marks == (4,)
    prompt = prompter.chat(conv.messages, conv.marks)
    assert cache_hints(conv, prompt).breakpoints == (Breakpoint(prompt.marks[0], TTL_5M_MS),)
    head = prompter.tokenizer.decode(prompt.input_ids[:prompt.marks[0]], skip_special_tokens=False)
    rest = prompter.tokenizer.decode(prompt.input_ids[prompt.marks[0]:], skip_special_tokens=False)
    assert head.endswith("First question?\nSecond part.<|im_end|>\n") and rest.startswith("<|im_start|>assistant")
    # on the first of the two it ends there too (rounded up to the turn's message), as in one message
    first = convert(request(system=[text("You are terse.")], messages=[
        *history, user([text("First question?", cache_control=EPHEMERAL)]), user("Second part.")]))
    assert first == convert(request(system=[text("You are terse.")], messages=[
        *history, user([text("First question?", cache_control=EPHEMERAL), text("Second part.")])]))
    assert first.messages == conv.messages and first.marks == (4,)
    # an assistant turn's blocks end with its one message
    assistant = convert(request(messages=[user("q"), {"role": "assistant", "content": [text("a", cache_control=EPHEMERAL)]},
                                          {"role": "assistant", "content": "b"}, user("c")]))
    assert assistant.messages[1] == {"role": "assistant", "content": "ab"} and assistant.marks == (2,)
    # a result keeps its tool message; the turn's text its user message; counted in request order
    mixed = convert(request(tools=[WEATHER], messages=[
        user("a"), calls("A"), user([text("x", cache_control={"type": "ephemeral", "ttl": "1h"})]),
        user([{**result("A", "rain"), "cache_control": EPHEMERAL}])]))
    assert mixed.messages[3:] == [{"role": "tool", "content": "rain"}, {"role": "user", "content": "x"}]
    assert mixed.marks == (5, 4) and mixed.ttls == (TTL_1H_MS, TTL_5M_MS)
    prompt = prompter.chat(mixed.messages, mixed.marks)
    # the result's breakpoint is inside the text's prefix, which keeps it
    assert cache_hints(mixed, prompt).breakpoints == (Breakpoint(prompt.marks[0], TTL_1H_MS),)


@pytest.mark.parametrize("messages, field, words", [
    ([user("a"), {"role": "assistant", "content": [{"type": "tool_use", "name": "get_weather", "input": {}}]},
      user([result("t")])], "messages.1.content.0.id", "must be a non-empty string"),
    ([user("a"), calls("t", "t"), user([result("t")])], "messages.1.content.1.id", "unique"),
    ([user("a"), calls("t"), user([result("t")]), calls("t"), user([result("t")])], "messages.3.content.0.id",
     "unique"),
    ([user([result("toolu_x")])], "messages.0.content.0", "previous message does not contain any tool_use blocks"),
    ([user("a"), {"role": "assistant", "content": "no calls"}, user([result("t")])], "messages.2.content.0",
     "previous message does not contain any tool_use blocks"),
    ([user("a"), calls("t1"), user([result("t2")])], "messages.2.content.0",
     "unexpected tool_use_id found in tool_result blocks: t2."),
    ([user("a"), calls("t1", "t2"), user([result("t2")])], "messages.1",
     "tool_use ids were found without tool_result blocks immediately after: t1."),
    ([user("a"), calls("t1"), user("go on")], "messages.1", "without tool_result blocks immediately after: t1."),
    ([user("a"), calls("t1"), {"role": "assistant", "content": "b"}, user("c")], "messages.1",
     "without tool_result blocks immediately after: t1."),
    ([user("a"), calls("t1"), user([result("t1"), result("t1")])], "messages.2.content.1.tool_use_id", "twice"),
    # consecutive messages of a role are one turn (Anthropic combines them): its results answer once
    ([user("a"), calls("t1"), user([result("t1")]), user([result("t1")])], "messages.3.content.0.tool_use_id",
     "twice"),
    ([user("a"), calls("t1"), calls("t2"), user([result("t1")])], "messages.2",
     "without tool_result blocks immediately after: t2."),
    ([user("a"), calls("t1"), user([result("t1")]), user([result("t2")])], "messages.3.content.0",
     "unexpected tool_use_id found in tool_result blocks: t2."),
    ([user("a"), calls("t1"), user([result("t1")]), {"role": "assistant", "content": "b"}, user([result("t1")])],
     "messages.4.content.0", "previous message does not contain any tool_use blocks"),
    ([user("a"), calls("t1"), user([result("t1")]), calls("t2"), user("b"), user("c")], "messages.3",
     "without tool_result blocks immediately after: t2."),
])
def test_tool_calls_and_results_that_do_not_pair_are_refused(messages, field, words) -> None:
    assert words in refused(field, tools=[WEATHER], messages=messages)


def test_a_tool_use_naming_an_undefined_tool_stays_accepted_in_history() -> None:
    conv = convert(request(messages=[user("a"), calls("t", name="retired_tool"), user([result("t", "done")])]))
    assert "retired_tool" in conv.messages[1]["content"] and conv.messages[2] == {"role": "tool", "content": "done"}


def test_count_tokens_takes_the_sdks_count_fields_and_refuses_what_cannot_be_served() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = count_request(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "high"},
                         speed="fast", user_profile_id="u", workspace_id="w", thinking={"type": "adaptive"},
                         tools=[WEATHER], tool_choice={"type": "auto"}, cache_control=EPHEMERAL)
    conv = convert(body, generate=False)
    assert conv.guide.kind == "json_schema" and conv.marks == (len(conv.messages),)
    for name, value in (("compaction", {"type": "summarize"}), ("billing_policy", {"type": "billing_policy"})):
        with pytest.raises(ServingError) as caught:
            convert(count_request(**{name: value}), generate=False)
        assert caught.value.param == name and "not supported" in caught.value.message
        refused(name, **{name: value})


def test_count_tokens_counts_a_conversation_ending_with_an_assistant_turn(prompter) -> None:
    from server.gateway.messages_routes import history_tokens

    messages = [user("Weather in Oslo?"), calls("t1")]
    refused("messages.1", tools=[WEATHER], messages=messages)  # generation still refuses a prefill
    conv = convert(count_request(tools=[WEATHER], messages=messages), generate=False)
    assert conv.messages[-1]["role"] == "assistant" and CALL_OPEN in conv.messages[-1]["content"]
    ids = history_tokens(prompter, conv.messages)
    text = prompter.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("</tool_call><|im_end|>\n")  # closed as a history turn, no generation prompt after it
    opened = prompter.chat(convert(request(tools=[WEATHER], messages=[*messages, user([result("t1")])])).messages)
    assert len(ids) < opened.total
    # the last turn's calls may stay unanswered, over all of its messages
    two = convert(count_request(tools=[WEATHER], messages=[*messages, calls("t2")]), generate=False)
    assert [m["role"] for m in two.messages[-2:]] == ["user", "assistant"]  # the final turn: one closed message
    assert two.messages[-1]["content"].count(CALL_OPEN) == 2
    assert history_tokens(prompter, two.messages) == history_tokens(prompter, convert(count_request(
        tools=[WEATHER], messages=[messages[0], {"role": "assistant", "content": [
            *calls("t1")["content"], *calls("t2")["content"]]}]), generate=False).messages)


@pytest.mark.parametrize("empty", ["", []])
def test_count_tokens_takes_an_empty_final_assistant_message_as_the_open_turn(empty) -> None:
    # Anthropic: "all messages must have non-empty content except for the optional final assistant message"
    for history in ([user("Hi")], [user("Weather in Oslo?"), calls("t1")],
                    [user("Weather in Oslo?"), calls("t1"), user([result("t1", "rain")])]):
        body = {"tools": [WEATHER], "cache_control": EPHEMERAL}
        conv = convert(count_request(**body, messages=[*history, {"role": "assistant", "content": empty}]),
                       generate=False)
        # counted as the conversation before it: its generation prompt opens that (empty) assistant turn
        assert conv == convert(count_request(**body, messages=history), generate=False)
    assert "prefill" in refused("messages.1", messages=[user("Hi"), {"role": "assistant", "content": empty}])
    # only the final message may be empty
    refused("messages.1.content", messages=[user("Hi"), {"role": "assistant", "content": empty}, user("Go on")])


def test_nested_tool_result_blocks_are_checked_and_counted_like_top_level_ones() -> None:
    def nested(control) -> dict:
        return user([result("t", [{"type": "text", "text": "rain", "cache_control": control}])])

    history = [user("a"), calls("t")]
    field = "messages.2.content.0.content.0.cache_control"
    refused(field, tools=[WEATHER], messages=[*history, nested({"type": "bogus"})])
    four = [{"type": "text", "text": f"s{i}", "cache_control": EPHEMERAL} for i in range(4)]
    assert "maximum of 4" in refused(field, tools=[WEATHER], system=four, messages=[*history, nested(EPHEMERAL)])
    refused(field + ".ttl", tools=[WEATHER], system=four[:1],
            messages=[*history, nested({"type": "ephemeral", "ttl": "1h"})])
    refused("messages.2.content.0.content.0.type", tools=[WEATHER], messages=[*history, user([result("t", [
        {"type": "bogus", "text": "x"}])])])
    # the breakpoint ends where the tool message holding the block ends, after reordering by call
    conv = convert(request(tools=[WEATHER], messages=[user("a"), calls("A", "B"), user([
        result("B", [{"type": "text", "text": "b", "cache_control": EPHEMERAL}]), result("A", "a")])]))
    assert conv.messages[4] == {"role": "tool", "content": "b"} and conv.marks == (5,)


@pytest.mark.parametrize("fields, field", [
    ({"messages": [user("")]}, "messages.0.content"),
    ({"messages": [user([{"type": "text", "text": ""}])]}, "messages.0.content.0.text"),
    ({"messages": [user([{"type": "text", "text": "a"}, {"type": "text", "text": ""}])]}, "messages.0.content.1.text"),
    ({"messages": [user("a"), {"role": "assistant", "content": [{"type": "text", "text": ""}]}, user("b")]},
     "messages.1.content.0.text"),
    ({"messages": [user("a"), {"role": "assistant", "content": ""}, user("b")]}, "messages.1.content"),
    ({"system": [{"type": "text", "text": ""}]}, "system.0.text"),
    ({"tools": [WEATHER], "messages": [user("a"), calls("t"), user([result("t", [{"type": "text", "text": ""}])])]},
     "messages.2.content.0.content.0.text"),
])
def test_empty_text_is_refused_as_anthropic_refuses_it(fields, field) -> None:
    assert refused(field, **fields).endswith("text content blocks must be non-empty")


def test_empty_text_the_converter_makes_itself_stays_accepted() -> None:
    conv = convert(request(tools=[WEATHER], messages=[user("a"), calls("t"), user([result("t")]),
                                                      {"role": "assistant", "content": "b"}, user("c")]))
    assert conv.messages[2]["content"].startswith(CALL_OPEN)  # a tool_use-only turn: no text before the call
    assert convert(request(tools=[WEATHER], messages=[
        user("a"), calls("t"), user([{"type": "tool_result", "tool_use_id": "t"}])])).messages[3]["content"] == ""


@pytest.mark.parametrize("tool, choice, field", [
    ({**WEATHER, "strict": "yes"}, {"type": "any"}, "tools.0.strict"),
    ({**WEATHER, "strict": 1}, None, "tools.0.strict"),
    ({**WEATHER, "strict": "true"}, {"type": "auto"}, "tools.0.strict"),
    ({**WEATHER, "input_schema": {"type": "string"}}, None, "tools.0.input_schema.type"),
    ({**WEATHER, "input_schema": {"properties": {}}}, None, "tools.0.input_schema.type"),
    ({**WEATHER, "defer_loading": True}, None, "tools.0.defer_loading"),
    ({**WEATHER, "allowed_callers": ["code_execution_20250825"]}, None, "tools.0.allowed_callers"),
    ({**WEATHER, "input_examples": [5]}, None, "tools.0.input_examples.0"),
    ({**WEATHER, "eager_input_streaming": "on"}, None, "tools.0.eager_input_streaming"),
    ({**WEATHER, "parameters": {}}, None, "tools.0.parameters"),
])
def test_tool_fields_are_honoured_ignored_on_purpose_or_refused_by_name(tool, choice, field) -> None:
    fields = {"tools": [tool]} if choice is None else {"tools": [tool], "tool_choice": choice}
    assert refused(field, **fields).startswith(field + ":")


def test_strict_is_accepted_with_every_tool_choice_and_guided_where_the_call_is_forced() -> None:
    strict = {**WEATHER, "strict": True, "input_examples": [{"city": "Oslo"}], "eager_input_streaming": True,
              "defer_loading": False, "allowed_callers": ["direct"]}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "none"}, {"type": "auto"}, None):
        conv = convert(request(tools=[strict], **({} if choice is None else {"tool_choice": choice})))
        assert conv.functions == [{"name": "get_weather", "description": "Weather in a city",
                                   "parameters": WEATHER["input_schema"]}]  # nothing of the extra fields in the prompt
        # any / tool: the forced call follows the schema; auto (langchain-anthropic's bind_tools(strict=True)):
        # best effort, the call parsed from free text as on the OpenAI routes; none: no call
        forced = choice is not None and choice["type"] in ("any", "tool")
        assert (conv.guide is not None) == forced
        assert conv.tools.mode == ("forced" if forced else (choice or {"type": "auto"})["type"])
    assert convert(request(tools=[{**WEATHER, "strict": False}])).tools.mode == "auto"
