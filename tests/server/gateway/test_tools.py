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
    tool_text_ends,
    tools_system_text,
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


def test_a_close_tag_inside_an_argument_string_does_not_end_the_call() -> None:
    """The block's JSON is read as one value: a ``</tool_call>`` inside a string is text."""
    inner = '{"name": "get_weather", "arguments": {"city": "see </tool_call> here"}}'
    text = f"<tool_call>\n{inner}\n</tool_call>\n<tool_call>\n{inner}\n</tool_call>"
    content, calls = parse_tool_calls(text, PLAN)
    assert content == "" and [json.loads(c.arguments) for c in calls] == [{"city": "see </tool_call> here"}] * 2
    cut = f"<tool_call>\n{inner}"  # cut just after its JSON (the output limit): still the call
    assert [c.name for c in parse_tool_calls(cut, PLAN)[1]] == ["get_weather"]
    garbage = '<tool_call>\n{"name": "get_weather", "arguments": {}} and more</tool_call>'
    assert parse_tool_calls(garbage, PLAN) == (garbage, [])  # a value then text: no call, as before


def test_a_call_whose_arguments_are_no_unicode_text_is_no_call() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800"}}\n</tool_call>'
    assert parse_tool_calls(text, PLAN) == (text, [])  # a lone surrogate: no text a client could read


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


def _finish(tokenizer, text: str, *, limit_at_end: bool, mode: str = "auto", stop: tuple[str, ...] = ()):
    """Run the core's generation loop over ``text`` as one engine stream (a token a chunk), the output
    limit exactly its length (``limit_at_end``) or far above it; the outcome it leaves."""
    import asyncio
    from types import SimpleNamespace

    from server.gateway.api.completions import Outcome, _generate

    ids = tokenizer.encode(text)
    plan = ToolPlan({"get_weather": WEATHER}, mode)
    job = SimpleNamespace(parses_tools=True, logprobs=None, tokenizer=tokenizer, stop=stop, tools=plan,
                          max_new_tokens=len(ids) if limit_at_end else len(ids) + 100)

    async def chunks():  # type: ignore[no-untyped-def]
        for n, token in enumerate(ids, 1):
            yield SimpleNamespace(token_ids=(token,), generated=n, kv=None, log_probs=None)

    async def run() -> Outcome:
        outcome = Outcome()
        async for _ in _generate(job, SimpleNamespace(streaming=True), chunks(), outcome, 0.0):  # type: ignore[arg-type]
            pass
        return outcome

    return asyncio.run(run())


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_a_call_cut_by_the_output_limit_keeps_finish_reason_length(tokenizer) -> None:
    """The limit cut the second call: "length" (OpenAI's finish reason for cut output), the whole call listed."""
    for cut in (CALL + '\n<tool_call>\n{"name": "get_weather", "argu', CALL + "\n<tool_"):
        outcome = _finish(tokenizer, cut, limit_at_end=True)
        assert outcome.finish_reason == "length", cut
        assert [(c.name, json.loads(c.arguments)) for c in outcome.tool_calls] == [("get_weather", {"city": "Oslo"})]
        assert outcome.text == ""  # the cut block is neither content nor a call


def test_calls_that_end_exactly_at_the_limit_or_before_it_are_tool_calls(tokenizer) -> None:
    assert _finish(tokenizer, CALL, limit_at_end=True).finish_reason == "tool_calls"  # whole, then the limit
    assert _finish(tokenizer, CALL + "\n" + CALL + "\n", limit_at_end=True).finish_reason == "tool_calls"
    # the model itself ended inside a block, well within the limit: not cut by it
    assert _finish(tokenizer, CALL + "\n<tool_call>\n{", limit_at_end=False).finish_reason == "tool_calls"
    # a forced call that parses is whole, whatever the limit
    forced = _finish(tokenizer, '{"name": "get_weather", "arguments": {"city": "Oslo"}}', limit_at_end=True,
                     mode="forced")
    assert forced.finish_reason == "tool_calls" and len(forced.tool_calls) == 1


def test_stop_strings_apply_to_the_content_only_never_to_a_call(tokenizer) -> None:
    """A stop string inside a call (forced or ``auto``) neither cuts the call nor leaks its markup; in
    the content before a call it ends the answer, the call never made."""
    forced = _finish(tokenizer, '{"name": "get_weather", "arguments": {"city": "Oslo"}}', limit_at_end=False,
                     mode="forced", stop=("Oslo", "name"))
    assert forced.finish_reason == "tool_calls" and forced.stop_sequence is None
    assert [json.loads(c.arguments) for c in forced.tool_calls] == [{"city": "Oslo"}] and forced.text == ""
    auto = _finish(tokenizer, "Checking.\n" + CALL, limit_at_end=False, stop=("Oslo", "</tool_call>"))
    assert auto.finish_reason == "tool_calls" and auto.stop_sequence is None and auto.text == "Checking.\n"
    assert [json.loads(c.arguments) for c in auto.tool_calls] == [{"city": "Oslo"}]
    before = _finish(tokenizer, "Checking Oslo.\n" + CALL, limit_at_end=False, stop=("Oslo",))
    assert (before.finish_reason, before.stop_sequence, before.text, before.tool_calls) == ("stop", "Oslo", "Checking ",
                                                                                            [])
    # held text that is no call after all is content: cut at the stop string in it
    broken = _finish(tokenizer, "Sure <tool_call> Oslo is sunny", limit_at_end=False, stop=("sunny",))
    assert (broken.finish_reason, broken.stop_sequence, broken.text) == ("stop", "sunny", "Sure <tool_call> Oslo is ")
    # no call at all: stop strings as without tools
    plain = _finish(tokenizer, "It is sunny in Oslo today.", limit_at_end=False, stop=("Oslo",))
    assert (plain.finish_reason, plain.stop_sequence, plain.text) == ("stop", "Oslo", "It is sunny in ")


def test_tool_text_ends_after_each_tools_line() -> None:
    other = {**WEATHER, "name": "get_time"}
    text = tools_system_text([WEATHER, other])
    first, last = tool_text_ends([WEATHER, other])
    assert text[:first].endswith('"required": ["city"]}}}') and "get_time" not in text[:first]
    assert text[first] == "\n" and last == len(text)
    assert tool_text_ends([WEATHER]) == [len(tools_system_text([WEATHER]))]
