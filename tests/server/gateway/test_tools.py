"""Tool rendering, call parsing, the streaming splitter, and retention segments with tools."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engines.tokenizer import load_gguf_tokenizer
from server.gateway.api.logprobs import TokenTexts
from server.gateway.api.prompting import ChatPrompter
from server.gateway.api.tools import (
    CallSplitter,
    ToolPlan,
    forced_call_guide,
    parse_forced,
    parse_tool_calls,
    render_messages,
)

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PLAN = ToolPlan({"get_weather": WEATHER}, "auto")


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer()


def test_tools_go_into_the_system_segment_and_tool_results_into_context(tokenizer) -> None:
    prompter = ChatPrompter(tokenizer)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]},
                {"role": "tool", "content": '{"temp_c": 3}'}]
    rendered = render_messages(messages, [WEATHER])
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in rendered[2]["content"]
    prompt = prompter.chat(rendered)
    text = tokenizer.decode(prompt.input_ids, skip_special_tokens=False)
    system = tokenizer.decode(prompt.input_ids[: prompt.system_end], skip_special_tokens=False)
    context = tokenizer.decode(prompt.input_ids[prompt.system_end: prompt.context_end], skip_special_tokens=False)
    turn = tokenizer.decode(prompt.input_ids[prompt.context_end:], skip_special_tokens=False)
    assert "<tools>" in system and "Weather in Oslo?" in context and '"temp_c": 3' in context
    assert turn == "<|im_start|>assistant\n" and system + context + turn == text
    # the same tools give the same system tokens whatever the conversation (cache hits)
    other = prompter.chat(render_messages([{"role": "user", "content": "Hi"}], [WEATHER]))
    assert other.input_ids[: other.system_end] == prompt.input_ids[: prompt.system_end]


def test_auto_output_is_split_into_content_and_calls() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, [call] = parse_tool_calls(text, PLAN)
    assert content == "Let me check." and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert parse_tool_calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', PLAN)[1] == []
    assert parse_tool_calls("no calls here", PLAN) == ("no calls here", [])
    two = text + '\n<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    assert len(parse_tool_calls(two, PLAN)[1]) == 2
    assert len(parse_tool_calls(two, ToolPlan(PLAN.functions, "auto", parallel=False))[1]) == 1


def test_a_call_with_a_number_json_has_not_is_no_call() -> None:
    for value in ("NaN", "Infinity", "-Infinity", "1e999"):
        text = f'Sure.\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Oslo", "t": {value}}}}}\n</tool_call>'
        assert parse_tool_calls(text, PLAN) == (text, [])  # the text stays content, as the model wrote it
        assert parse_forced(f'{{"name": "get_weather", "arguments": {{"city": {value}}}}}', PLAN) == []


def test_a_returned_tool_turn_renders_as_generated_with_or_without_its_newline() -> None:
    """The model writes "text\n<tool_call>…": a client sending the text back as streamed (newline kept) or
    as parsed (stripped) gets the same prompt, so the turn's cached blocks are reused next turn."""
    call = [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    generated = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for text in ("Let me check.", "Let me check.\n", "Let me check.\n\n"):
        rendered = render_messages([{"role": "assistant", "content": text, "tool_calls": call}], [])
        assert rendered[0]["content"] == generated, repr(text)
    bare = render_messages([{"role": "assistant", "content": "\n", "tool_calls": call}], [])
    assert bare[0]["content"].startswith("<tool_call>")


def test_splitter_streams_content_and_holds_the_call() -> None:
    splitter = CallSplitter()
    pieces = ["Sure", ", let me <", "tool", "_call>\n{\"name\"", ": 1}"]
    streamed = "".join(splitter.push(p) for p in pieces)
    assert streamed == "Sure, let me " and splitter.held.startswith("<tool_call>") and splitter.calling
    plain = CallSplitter()
    assert "".join(plain.push(p) for p in ["a <", "b"]) + plain.flush() == "a <b"


def test_forced_guide_schema_accepts_only_calls_with_valid_arguments() -> None:
    schema = json.loads(forced_call_guide([WEATHER]).text)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    for bad in ({"name": "other", "arguments": {"city": "x"}}, {"name": "get_weather", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    [call] = parse_forced('{"name": "get_weather", "arguments": {"city": "Oslo"}}', PLAN)
    assert call.id.startswith("call_") and parse_forced('{"name": "get_weather", "argu', PLAN) == []


def test_token_texts_give_exact_bytes(tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("naïve café — ok")
    assert b"".join(texts.get(t)[1] for t in ids) == "naïve café — ok".encode()
    assert texts.get(tokenizer.eos_token_id)[0] == "<|im_end|>"
