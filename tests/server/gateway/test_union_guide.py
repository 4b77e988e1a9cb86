"""The format-or-calls guide: an output format with tools the model may call, as one EBNF grammar,
compiled and matched by the reference engine's own xgrammar path (``engines/reference/grammar.py``)
over SmolLM2's vocabulary; what the request core then reads from either shape; the dialects'
conversions; and the limits (size, schemas with no portable form) refused by field."""

from __future__ import annotations

import json
import re

import pytest

from engines.contract import Guide
from engines.reference.grammar import GrammarCache
from engines.tokenizer import load_gguf_tokenizer
from server.gateway.api import union_guide
from server.gateway.api.tools import ToolPlan, parse_tool_calls
from server.gateway.api.union_guide import format_or_calls_guide
from server.gateway.errors import ServingError

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                          "required": ["city"]}}
NOW = {"name": "now"}  # no parameters: an empty arguments object
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer", "minimum": 0}},
          "required": ["answer", "score"]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL_NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def guide(schema=ANSWER, functions=(WEATHER, NOW), parallel=True) -> Guide:
    return format_or_calls_guide(schema, list(functions), parallel=parallel, field="response_format",
                                 tool_fields=[f"tools.{i}.function.parameters" for i in range(len(functions))])


@pytest.fixture(scope="module")
def grammars():
    tokenizer = load_gguf_tokenizer()
    return GrammarCache(tokenizer, tokenizer.vocab_size), min(tokenizer.stop_token_ids)


def accepts(grammars, g: Guide, text: str) -> bool:
    """Whether the engine's matcher takes ``text`` whole and then the end of the output."""
    cache, end = grammars
    matcher = cache.matcher(cache.compile(g), end)
    return matcher.accept_string(text) and matcher.accept_token(end) and matcher.is_terminated()


def test_the_format_json_or_call_blocks_and_nothing_else(grammars) -> None:
    g = guide()
    assert g.kind == "ebnf_grammar"
    for text in ('{"answer": "Oslo is rainy", "score": 3}', CALL, CALL_NOW,
                 CALL + "\n" + CALL_NOW,  # parallel calls, joined as the template renders them
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'):
        assert accepts(grammars, g, text), text
    for text in ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # an unknown function
                 '{"answer": "Oslo", "score": "high"}',  # the format's schema broken
                 '{"answer": "Oslo", "score": -1}', '{"answer": "Oslo"}',
                 '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n</tool_call>',  # arguments off
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "k"}}\n</tool_call>',
                 '<tool_call>\n{"name": "now", "arguments": {"x": 1}}\n</tool_call>',
                 "Let me check. " + CALL, CALL + "\nDone.", '{"answer": "a", "score": 1}\n' + CALL,  # no mixing
                 "Oslo is rainy.", ""):
        assert not accepts(grammars, g, text), text


def test_parallel_calls_off_allow_exactly_one_block(grammars) -> None:
    g = guide(parallel=False)
    assert accepts(grammars, g, CALL) and accepts(grammars, g, '{"answer": "x", "score": 0}')
    assert not accepts(grammars, g, CALL + "\n" + CALL_NOW)


def test_json_object_is_any_object(grammars) -> None:
    g = guide({"type": "object"}, (WEATHER,))
    for text in ('{"anything": [1, 2.5, null, true, {"x": "y"}]}', "{}", CALL):
        assert accepts(grammars, g, text), text
    for text in ("[1]", '"text"', "3", CALL_NOW):  # NOW is not a tool of this request
        assert not accepts(grammars, g, text), text


def test_the_request_core_reads_either_shape() -> None:
    """What the output router and ``parse_tool_calls`` (tool_choice auto) make of the two shapes."""
    plan = ToolPlan({"get_weather": WEATHER, "now": NOW}, "auto")
    content, calls = parse_tool_calls(CALL + "\n" + CALL_NOW, plan)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("now", {})]
    answer = '{"answer": "has <tool_call> in it", "score": 1}'  # inside a JSON string: never a call
    assert parse_tool_calls(answer, plan) == (answer, [])
    assert parse_tool_calls(CALL + "\n" + CALL_NOW, ToolPlan(plan.functions, "auto", parallel=False))[1][0].name \
        == "get_weather"


def test_rules_are_namespaced_and_written_in_the_oldest_engines_syntax() -> None:
    """Two schemas' rules never collide (each has its own ``root`` and ``basic_*``), and the text keeps
    to what TensorRT-LLM's xgrammar 0.1.25 parses: no ``{m, -1}`` repetition, no ``Regex(...)``."""
    recursive = {"$defs": {"root": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/root"},
                                                                                         {"type": "null"}]}},
                                    "required": ["next"]}},
                 "type": "object", "properties": {"list": {"type": "array", "items": {"$ref": "#/$defs/root"}}},
                 "required": ["list"]}
    text = guide(recursive).text
    assert text.startswith("root ::= format_root | tool_calls\n")
    names = re.findall(r"^([A-Za-z_][A-Za-z0-9_.\-]*) ::=", text, re.MULTILINE)
    assert len(names) == len(set(names))  # every rule defined once
    assert all(n in ("root", "tool_calls", "tool_call") or n.startswith(("format_", "call_")) for n in names)
    assert ", -1}" not in text and "Regex(" not in text
    assert 'tool_calls ::= tool_call ("\\n" tool_call)*\n' in text  # parallel calls: blocks joined by "\n"
    assert guide(recursive).text == text  # the same request, the same text (engines cache by it)


def test_the_dialects_build_it_from_their_own_fields() -> None:
    from server.gateway.api.messages_convert import convert as messages
    from server.gateway.api.messages_schemas import MessagesRequest
    from server.gateway.api.responses_convert import convert as responses, normalize_items
    from server.gateway.api.responses_schemas import ResponsesRequest
    from server.gateway.api.openai_schemas import ChatCompletionRequest
    from server.gateway.routes import _structure

    weather_tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["parameters"]}
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": WEATHER}], "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": ANSWER}}})
    plan, chat_guide = _structure(chat)
    assert plan.mode == "auto" and not plan.parallel
    assert chat_guide == guide(functions=(WEATHER,), parallel=False)
    reply = responses(ResponsesRequest.model_validate({
        "model": "m", "input": "Hi", "tools": [weather_tool],
        "text": {"format": {"type": "json_schema", "name": "A", "schema": ANSWER, "strict": True}}}),
        normalize_items("Hi"))
    assert reply.tools.mode == "auto" and reply.guide == guide(functions=({"name": "get_weather",
                                                                           "parameters": WEATHER["parameters"]},))
    message = messages(MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "output_config": {"format": {"type": "json_schema", "schema": ANSWER}}}))
    assert message.guide.kind == "ebnf_grammar" and "(\"\\n\" tool_call)*" not in message.guide.text  # one call


def test_limits_are_refused_by_the_field_at_fault(monkeypatch) -> None:
    with_pattern = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
    with pytest.raises(ServingError) as fmt:
        guide(with_pattern)
    assert fmt.value.status == 400 and fmt.value.param == "response_format" and "pattern" in str(fmt.value)
    coded = {"name": "lookup", "parameters": with_pattern}
    with pytest.raises(ServingError) as tool:
        guide(functions=(WEATHER, coded))
    assert tool.value.param == "tools.1.function.parameters"
    with pytest.raises(ServingError) as broken:
        guide({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}})
    assert broken.value.param == "response_format"
    monkeypatch.setattr(union_guide, "MAX_GUIDE_BYTES", 1024)
    with pytest.raises(ServingError) as large:
        guide()
    assert large.value.param == "response_format" and "1024" in str(large.value)


def test_a_schema_refused_in_the_combined_guide_is_named_as_each_dialect_names_it() -> None:
    from server.gateway.api.messages_convert import convert as messages
    from server.gateway.api.messages_schemas import MessagesRequest
    from server.gateway.api.responses_convert import convert as responses, normalize_items
    from server.gateway.api.responses_schemas import ResponsesRequest

    coded = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
    weather_tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["parameters"]}
    with pytest.raises(ServingError) as reply:
        responses(ResponsesRequest.model_validate({
            "model": "m", "input": "Hi", "tools": [weather_tool],
            "text": {"format": {"type": "json_schema", "name": "A", "schema": coded}}}), normalize_items("Hi"))
    assert reply.value.param == "text.format.schema"  # as the format's other schema checks name it
    with pytest.raises(ServingError) as message:
        messages(MessagesRequest.model_validate({
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
            "output_config": {"format": {"type": "json_schema", "schema": coded}}}))
    assert message.value.param == "output_config.format.schema"


async def test_a_gateway_without_xgrammar_refuses_a_format_with_tools_by_name(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # an import of it now fails, as on a gateway without it
    with pytest.raises(ServingError) as refused:
        await union_guide.ready("text.format")
    assert refused.value.status == 400 and refused.value.param == "text.format" and "xgrammar" in str(refused.value)
