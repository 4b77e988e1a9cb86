"""Anthropic Messages request → the core's chat request (messages, tools, guide, cache hints).

The same conversion vLLM does in ``vllm/entrypoints/anthropic/`` (an Anthropic request
becomes its chat request), so every engine feature reaches this dialect through the one
core: the result is the template-ready message list the OpenAI chat path would build
(``server.gateway.api.tools.render_messages``: tool definitions in the system message,
Hermes ``<tool_call>`` blocks), plus a :class:`~server.gateway.api.tools.ToolPlan` and
guide from the same functions the OpenAI path uses. One difference: the tool definitions
*open* the system message, before its text (``tools_first``), in Anthropic's cache prefix
order tools → system → messages.

    Anthropic                                   chat request
    system (string | text blocks)            →  one system message: the tools' text, "\\n\\n", then the
                                                system text (blocks joined by "\\n"); "" and [] are no
                                                system (the template's default one, as when omitted)
    tools [{name, description, input_schema}]→  functions [{name, description, parameters}]
    user turn: tool_result blocks            →  one ``tool`` message each, first, in the order of the
                                                calls they answer (the template pairs by position)
    user turn: text blocks                   →  then one user message: its messages' texts (each its blocks
                                                joined by "\\n") joined by "\\n", in request order
    assistant turn: text + tool_use blocks   →  one assistant message: the turn's text blocks joined as written
                                                (as within one message), ``tool_calls`` all its calls, in order
    tool_choice auto|any|tool|none           →  ToolPlan auto | forced (all) | forced (one) | none
    tool strict (boolean)                    →  any|tool: the guide follows the schema (as always);
                                                auto: accepted, best effort (the call is parsed from
                                                free text, its input not checked against the schema;
                                                with output_config.format it follows the schema)
    output_config.format (json_schema)       →  the JSON-schema guide (OpenAI's response_format); with
                                                tool_choice auto: the format's JSON or tool_use calls
                                                (union_guide)
    cache_control (top level)                →  a breakpoint after the last message

**Cache breakpoints.** ``cache_control`` on a block marks the prefix up to and including
that block, in the order tools → system → messages. kvgate resolves it at message
granularity: the breakpoint ends where the chat message holding the block ends (system
blocks: the end of the system message). A block inside a message is thus rounded *up* to
its message's end; exact per-block offsets would need a cut inside a message's text, which
changes its tokenization. The one exception is a tool's breakpoint: the tools open the system
message, one line each, and a breakpoint on a tool ends after that tool's line
(:func:`~server.gateway.api.tools.tool_text_ends`; the last tool's after the whole tools text),
inside the system message (a :class:`~server.gateway.api.prompting.TextMark`: no cut; the
tokens that text alone tokenizes to, rounded *down* to a token that ends inside it), so it
covers the tools up to that one and nothing after it, as on Anthropic's API (a breakpoint on
tool A of [A, B] caches A only; "tools 1h + system 5m" keeps the tools for 1 h and the system
text for 5 min). A mark that reaches the end of the message (the last tool, no system text)
ends with the message. The token offsets come from
``ChatPrompter.chat(..., marks=)``; :func:`cache_hints` turns them into
:class:`~retention.policy.hints.CacheHints` (breakpoints that land on the same offset merge, keeping
the longest TTL). Rules checked here, as Anthropic states them: at most four blocks with
``cache_control``; ``ttl`` is ``"5m"`` (default) or ``"1h"``; a longer TTL must not follow a
shorter one in that order (``1h`` after ``5m`` is refused). Blocks inside a ``tool_result``'s
content are checked and counted the same way, in request order, and end with the result's
``tool`` message; results are reordered by call (below), so such a breakpoint may end before
an earlier one: it is then inside that one's prefix, which keeps it (:func:`cache_hints`).

**Tool calls pair by id, per turn**, as Anthropic pairs them; the chat template has no ids
(Hermes: results answer calls in order), so the ids are checked here and then dropped.
Anthropic combines consecutive ``user`` (or ``assistant``) messages into one turn, so the
pairing is over turns, not messages. kvgate's rules (with Anthropic's error messages where it
has one): every ``tool_use`` has a string ``id``, unique in the request; every ``tool_result``
names a ``tool_use`` of the assistant turn right before its user turn, at most once; the calls
of an assistant turn are all answered in the next (user) turn, unless it is the last turn
(counting takes that; generating refuses a final assistant message as a prefill). A refusal
names the message holding the offending block (an unanswered call: the assistant message
holding the first one). Nothing more is checked: a turn's text may come before its results,
and a ``tool_use`` naming a tool that is not in ``tools`` stays accepted in history.

**Rendering is per turn too**: a turn is one chat message of its role, as Anthropic serves it. A
user turn's results come first (one ``tool`` message each, in the order of the calls they answer,
across the turn's messages), then one user message with the text of all its messages; an
assistant turn is one assistant message with all its messages' text and calls. A breakpoint on
any text or ``tool_use`` block of a turn thus ends with that turn's message (a result's with its
``tool`` message).

**Fields.** Each object kvgate reads takes the fields the anthropic SDK's param type
defines for it (``TextBlockParam``, ``ToolUseBlockParam``, ``ToolResultBlockParam``,
``ToolParam``, ``CacheControlEphemeralParam``, the four ``ToolChoice*Param``), so echoed
assistant content passes (``caller`` direct, ``toolset_name`` and ``citations`` ignored);
any other field is refused with Anthropic's "Extra inputs are not permitted" naming it
(``messages.0.content.0.cache_contrl``), so a typo never silently drops a breakpoint or a
flag. Tool names match Anthropic's ``^[a-zA-Z0-9_-]{1,128}$``.

**Text** blocks must be non-empty wherever a client writes them (system, messages,
tool_result content; Anthropic: "text content blocks must be non-empty"), and, except in
assistant turns, hold non-whitespace ("text content blocks must contain non-whitespace
text"): an assistant turn's text may be whitespace only, since kvgate's own streamed answer
may begin with the newline the model wrote before a tool call, and it is echoed back. The
converter's own empty texts (an assistant turn of tool calls only, a tool_result without
content) stay.
The one empty message Anthropic allows, a final assistant message with ``content`` ``""`` or
``[]``, is the turn left open for the model: counting counts the conversation without it
(whose generation prompt opens that turn, as a create request without it would be prompted);
generating refuses it as any final assistant message (prefill).

Invariant: everything a request says is honoured, ignored on purpose (documented in the
README's field table), or refused with a :class:`ServingError` 400 whose message names the
field (``messages.2.content.0.type``). A client value is type-checked before it is looked up
in a dict or set (:func:`_str`), so a JSON list or object where a string belongs is a 400
too, never a 500.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from itertools import groupby
from typing import Any

from engines.contract import Guide
from retention.policy.hints import MAX_BREAKPOINTS, TTL_1H_MS, TTL_5M_MS, Breakpoint, CacheHints
from server.gateway.api.messages_schemas import MessageParam, MessagesInput, ToolChoice
from server.gateway.api.prompting import PreparedPrompt, TextMark
from server.gateway.api.conversion import Conversation, function, invalid
from server.gateway.api.tools import ToolPlan, check_schema, forced_call_guide, render_messages, tool_text_ends
from server.gateway.api.union_guide import format_or_calls_guide
from server.gateway.errors import ServingError

_TTLS = {"5m": TTL_5M_MS, "1h": TTL_1H_MS}
# Content block types Anthropic defines that kvgate cannot serve (a text-only model, no server tools).
_UNSERVABLE_BLOCKS = {
    "image": "images", "document": "documents", "search_result": "search results",
    "thinking": "thinking blocks", "redacted_thinking": "thinking blocks",
    "server_tool_use": "server tools", "web_search_tool_result": "server tools",
    "web_fetch_tool_result": "server tools", "code_execution_tool_result": "server tools",
    "mcp_tool_use": "MCP tools", "mcp_tool_result": "MCP tools", "container_upload": "containers",
}
_EMPTY = "text content blocks must be non-empty"  # Anthropic's words
_BLANK = "text content blocks must contain non-whitespace text"  # Anthropic's words
_EXTRA = "Extra inputs are not permitted"  # Anthropic's words for a field its schema does not define
# The fields of each object kvgate reads, as the anthropic SDK's *Param types define them (2.15):
# each honoured, ignored on purpose or refused by value; any other is refused (_EXTRA), so a typo
# (``cache_contrl``, ``iserror``) is a 400, never a silently dropped breakpoint or flag.
_TOOL_FIELDS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict",
                          "input_examples", "eager_input_streaming", "defer_loading", "allowed_callers"})
_TEXT_FIELDS = frozenset({"type", "text", "cache_control", "citations"})  # TextBlockParam
_TOOL_USE_FIELDS = frozenset({"type", "id", "name", "input", "cache_control", "caller", "toolset_name"})
_TOOL_RESULT_FIELDS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"})
_CACHE_CONTROL_FIELDS = frozenset({"type", "ttl"})  # CacheControlEphemeralParam
_CHOICE_FIELDS = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"},
                  "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")  # fullmatch: Anthropic's ^[a-zA-Z0-9_-]{1,128}$
# ThinkingConfig*Param (anthropic 2.15): each variant's fields
_THINKING_FIELDS = {"enabled": frozenset({"type", "budget_tokens", "display"}), "disabled": frozenset({"type"}),
                    "adaptive": frozenset({"type", "display"}), "between_tools": frozenset({"type"})}
_REFUSED_FIELDS = ("mcp_servers", "container", "context_management", "diagnostics", "compaction", "billing_policy")


def _str(value: Any) -> str | None:
    """``value`` if it is a string, else None: what a dict or set lookup may take from a client."""
    return value if isinstance(value, str) else None


def _no_extra(obj: Mapping[str, Any], allowed: frozenset[str], field: str) -> None:
    """Refuses the first key of ``obj`` (in the order sent) outside ``allowed``, naming ``field.key``."""
    for key in obj:
        if key not in allowed:
            raise invalid(f"{field}.{key}", _EXTRA)


def refuse_unservable(body: MessagesInput) -> None:
    if body.thinking is not None:
        _thinking(body.thinking)
    for name in _REFUSED_FIELDS:
        if getattr(body, name) is not None:
            raise invalid(name, "not supported by this gateway")


def _thinking(thinking: Mapping[str, Any]) -> None:
    """``thinking``: each variant takes its SDK type's fields (``_THINKING_FIELDS``), checked by name and
    type; "disabled" and "adaptive" (the model decides whether to think; this one never does) are
    served as they are, the others refused (no extended thinking here)."""
    kind = thinking.get("type")
    if kind is None:
        raise invalid("thinking.type", "Field required")
    allowed = _THINKING_FIELDS.get(_str(kind) or "")
    if allowed is None:
        raise invalid("thinking.type", "must be one of " + ", ".join(f"'{k}'" for k in _THINKING_FIELDS))
    _no_extra(thinking, allowed, "thinking")
    display = thinking.get("display")
    if display is not None and display not in ("summarized", "omitted"):
        raise invalid("thinking.display", "must be 'summarized' or 'omitted'")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if budget is None:
            raise invalid("thinking.budget_tokens", "Field required")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise invalid("thinking.budget_tokens", "must be an integer")
    if kind not in ("disabled", "adaptive"):
        raise invalid("thinking", "extended thinking is not supported by this gateway")


def _ttl_ms(ttl: Any, field: str) -> int:
    """A ``cache_control.ttl`` in ms (absent: 5 minutes); anything but "5m" / "1h", string or not, is a 400."""
    if ttl is None:
        return TTL_5M_MS
    known = _TTLS.get(_str(ttl) or "")
    if known is None:
        raise invalid(field, "must be \"5m\" or \"1h\"")
    return known


class _Breakpoints:
    """Collects ``cache_control`` marks in request order and checks Anthropic's rules."""

    def __init__(self) -> None:
        self.marks: list[int | TextMark] = []
        self.ttls: list[int] = []

    def take(self, block: Mapping[str, Any], field: str, mark: int | TextMark) -> None:
        """Checks ``block``'s ``cache_control`` (if any) and records a breakpoint after ``mark`` messages.
        Must be called in request order (tools → system → messages, blocks in order): the limit and
        the TTL rule are Anthropic's over that order."""
        control = block.get("cache_control")
        if control is None:
            return
        where = f"{field}.cache_control" if field else "cache_control"
        if not isinstance(control, dict) or control.get("type") != "ephemeral":
            raise invalid(where, "must be {\"type\": \"ephemeral\"} with an optional \"ttl\"")
        _no_extra(control, _CACHE_CONTROL_FIELDS, where)
        ttl_ms = _ttl_ms(control.get("ttl"), f"{where}.ttl")
        if len(self.marks) == MAX_BREAKPOINTS:
            raise invalid(where, f"a maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided")
        if self.ttls and ttl_ms > min(self.ttls):
            raise invalid(f"{where}.ttl", "a 1h cache_control must not come after a 5m one "
                          "(longer TTLs first, in the order tools, system, messages)")
        self.marks.append(mark)
        self.ttls.append(ttl_ms)


def convert(body: MessagesInput, *, generate: bool = True) -> Conversation:
    """The chat request for ``body``, or a 400 :class:`ServingError` naming what cannot be served.

    ``generate=False`` (``count_tokens``): a final assistant message is kept as a history turn
    (the caller renders it without opening a generation prompt), except an empty one (``""`` or
    ``[]``), which is left out: the conversation before it is counted, its generation prompt
    opening that turn (when the messages before it are assistant ones too, they are the final
    turn, one message counted closed). Generating refuses a final assistant message, empty or
    not (prefill)."""
    refuse_unservable(body)
    points = _Breakpoints()
    functions = _functions(body.tools or [], points)
    tool_marks = len(points.marks)
    system = _system(body.system, points)
    if tool_marks:
        # The tools open the system message (render_messages(tools_first=True)): a tool's breakpoint
        # ends after that tool's line in their text, inside that message (before the tools after it
        # and the system text); the last tool's after the whole tools text, which, without system
        # text, is where the message ends.
        ends = tool_text_ends(functions)
        last = len(functions) - 1
        points.marks[:tool_marks] = [1 if i == last and system is None else TextMark(0, ends[i])
                                     for i in points.marks[:tool_marks]]
    out: list[dict] = []
    if system is not None or functions:
        out.append({"role": "system", "content": system or ""})  # render_messages puts the tools before it
    messages = body.messages
    if messages[-1].role == "assistant" and not messages[-1].content:
        messages = messages[:-1]  # Anthropic's optional empty final assistant message: the turn left open
    _turns(messages, out, points)
    # Top-level cache_control: Anthropic puts it on the last cacheable block, i.e. after everything else.
    points.take({"cache_control": body.cache_control} if body.cache_control is not None else {}, "", len(out))
    if generate and body.messages[-1].role == "assistant":
        raise invalid(f"messages.{len(body.messages) - 1}", "a final assistant message (prefill) is not supported; "
                      "end with a user message")
    plan, guide = _tool_plan(body, functions)
    guide = _output_guide(body, guide, plan if generate else None)  # counting tokens refuses nothing it could count
    if functions or any("tool_calls" in m for m in out):
        out = render_messages(out, functions, tools_first=True)
    return Conversation(out, functions, plan, guide, tuple(points.marks), tuple(points.ttls))


def cache_hints(conversation: Conversation, prompt: PreparedPrompt) -> CacheHints:
    """The request's breakpoints as token offsets of ``prompt`` (built with ``marks=conversation.marks``)."""
    points: list[Breakpoint] = []
    for end, ttl in zip(prompt.marks, conversation.ttls, strict=True):
        if end <= 0:
            continue  # no prefix to keep (a template that renders nothing before it)
        if points and end <= points[-1].token_end:
            if end == points[-1].token_end and ttl > points[-1].ttl_ms:
                points[-1] = Breakpoint(end, ttl)
            continue  # same message end as the previous breakpoint (or inside its prefix)
        points.append(Breakpoint(end, ttl))
    return CacheHints(breakpoints=tuple(points))


def _functions(tools: Sequence[Any], points: _Breakpoints) -> list[dict]:
    functions: list[dict] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        field = f"tools.{i}"
        defined = _function(tool, field)
        if defined["name"] in seen:
            raise invalid(f"{field}.name", f"tool names must be unique; '{defined['name']}' repeats")
        seen.add(defined["name"])
        functions.append(defined)
        points.take(tool, field, i)  # the tool's index: its TextMark in message 0 once all tools are known (convert)
    return functions


def _function(tool: Any, field: str) -> dict:
    """A custom tool as the OpenAI-shaped function the prompt shows (name, description, parameters)."""
    if not isinstance(tool, dict):
        raise invalid(field, "must be an object")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise invalid(f"{field}.type", f"server tool {kind!r} is not supported; only custom tools "
                      "(name, description, input_schema) are")
    _no_extra(tool, _TOOL_FIELDS, field)
    name = tool.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise invalid(f"{field}.name", "String should match pattern '^[a-zA-Z0-9_-]{1,128}$'")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise invalid(f"{field}.input_schema", "must be a JSON schema object")
    if schema.get("type") != "object":
        raise invalid(f"{field}.input_schema.type", "must be \"object\" (a tool's input is an object)")
    _check_tool_options(tool, field)
    return {**function(name, tool.get("description"), field), "parameters": schema}


def _check_tool_options(tool: dict, field: str) -> None:
    """The tool fields that leave the prompt alone: type-checked, and the values kvgate cannot keep
    refused. ``strict`` (a boolean) is accepted with every tool choice, one policy with the OpenAI
    routes: with ``any`` / ``tool`` the call's guide follows the schema whether or not it is set;
    with ``auto`` it is best effort (the call is parsed from free text, its input not checked against
    the schema); with ``none`` no call is parsed."""
    for flag in ("strict", "eager_input_streaming", "defer_loading"):
        value = tool.get(flag)
        if value is not None and not isinstance(value, bool):
            raise invalid(f"{field}.{flag}", "must be a boolean")
    if tool.get("defer_loading"):
        raise invalid(f"{field}.defer_loading", "true is not supported: a deferred tool is loaded by tool search, "
                      "which this gateway does not run")
    examples = tool.get("input_examples")
    if examples is not None:
        if not isinstance(examples, list):
            raise invalid(f"{field}.input_examples", "must be a list of objects")
        for k, example in enumerate(examples):
            if not isinstance(example, dict):
                raise invalid(f"{field}.input_examples.{k}", "must be an object")
    callers = tool.get("allowed_callers")
    if callers is not None and (not isinstance(callers, list) or any(caller != "direct" for caller in callers)):
        raise invalid(f"{field}.allowed_callers", "only [\"direct\"] is supported: this gateway runs no code "
                      "execution tool")


def _system(system: str | list[dict] | None, points: _Breakpoints) -> str | None:
    """The system text, or None for no system (absent, ``""`` or ``[]``: the template's default
    system prompt stays, as when ``system`` is omitted)."""
    if not system:
        return None
    if isinstance(system, str):
        return system
    texts = []
    for i, block in enumerate(system):
        texts.append(_text(block, f"system.{i}"))
        points.take(block, f"system.{i}", 1)
    return "\n".join(texts)


def _text(block: Any, field: str, *, blank: bool = False) -> str:
    """A client's text block's text: a non-empty string with non-whitespace in it (``blank``: may be
    whitespace only, as in an assistant turn, where kvgate's own streamed answer may begin with the
    newline the model wrote before a tool call); only TextBlockParam's fields."""
    if not isinstance(block, dict):
        raise invalid(field, "must be a content block object")
    kind = block.get("type")
    if kind != "text":
        raise invalid(f"{field}.type", _not_text(kind))
    _no_extra(block, _TEXT_FIELDS, field)
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{field}.text", "must be a string")
    if not text:
        raise invalid(f"{field}.text", _EMPTY)
    if not blank and text.isspace():
        raise invalid(f"{field}.text", _BLANK)
    citations = block.get("citations")
    if citations is not None and not isinstance(citations, list):  # accepted, ignored: kvgate serves no documents
        raise invalid(f"{field}.citations", "must be a list")
    return text


def _not_text(kind: Any) -> str:
    what = _UNSERVABLE_BLOCKS.get(_str(kind) or "")
    if what is None:
        return f"expected a text block, got {kind!r}"
    return f"'{kind}' blocks are not supported by this gateway ({what}: the model reads text only)"


def _turns(messages: Sequence[MessageParam], out: list[dict], points: _Breakpoints) -> None:
    """Appends the chat messages of ``messages``, checking that tool calls and results pair by id.
    Consecutive messages of a role are one turn, as Anthropic combines them: pairing is per turn,
    and so is rendering: one chat message per turn and role (a user turn's ``tool`` messages
    before its one user message)."""
    ids: set[str] = set()  # every tool_use id so far: unique in the request
    calls: dict[str, str] = {}  # the previous assistant turn's tool_use ids, in call order -> their message's field
    for role, group in groupby(enumerate(messages), key=lambda item: item[1].role):
        turn = [(f"messages.{i}", message) for i, message in group]
        if role == "assistant":
            calls = _assistant(turn, out, points, ids)
            continue
        answered = _user_turn(turn, out, points, {call_id: k for k, call_id in enumerate(calls)})
        missing = [call_id for call_id in calls if call_id not in answered]
        if missing:
            raise _unanswered(calls[missing[0]], missing)
        calls = {}


def _blocks(message: MessageParam, field: str) -> list:
    if isinstance(message.content, str):
        if not message.content:
            raise invalid(f"{field}.content", _EMPTY)
        if message.role == "user" and message.content.isspace():
            raise invalid(f"{field}.content", _BLANK)
        return [{"type": "text", "text": message.content}]
    if not message.content:
        raise invalid(f"{field}.content", "must not be empty")
    return message.content


def _unanswered(field: str, ids: list[str]) -> ServingError:
    """Anthropic's refusal of the assistant turn whose message at ``field`` holds the first of ``ids``:
    the next turn leaves ``ids`` unanswered."""
    return invalid(field, f"tool_use ids were found without tool_result blocks immediately after: {', '.join(ids)}. "
                   "Each tool_use block must have a corresponding tool_result block in the next message.")


def _user_turn(turn: Sequence[tuple[str, MessageParam]], out: list[dict], points: _Breakpoints,
               calls: Mapping[str, int]) -> set[str]:
    """Appends a user turn (consecutive user messages, with their fields) as chat messages: the turn's
    tool results first, one ``tool`` message each in the order of the ``calls`` they answer, whichever
    of its messages holds them (the template pairs results with calls by position), then one user
    message: each message's text blocks joined by "\\n", the messages' texts joined by "\\n" in
    request order (messages of results only add nothing; none if no message has text). A text
    block's breakpoint ends with that user message, a result's with its ``tool`` message.
    ``calls``: the previous assistant turn's tool_use ids -> their place among its calls. Returns
    the ids answered."""
    results: dict[str, str] = {}  # tool_use_id -> the result's text
    texts: list[str] = []  # per message: its text blocks joined ("" if it has none)
    marked: list[tuple[dict, str, str | None]] = []  # (block, field, answered id | None: the turn's user message)
    for field, message in turn:
        mine: list[str] = []
        for j, block in enumerate(_blocks(message, field)):
            where = f"{field}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result":
                text, nested = _tool_result(block, where)
                call_id = _answer(block.get("tool_use_id"), where, calls, results)
                results[call_id] = text
                marked.extend((part, part_field, call_id) for part, part_field in nested)
                marked.append((block, where, call_id))
            elif kind == "tool_use":
                raise invalid(f"{where}.type", "tool_use blocks belong in assistant messages")
            else:
                mine.append(_text(block, where))
                marked.append((block, where, None))
        texts.append("\n".join(mine))
    order = sorted(results, key=calls.__getitem__)
    # messages up to and including the one holding a result (by id) or the turn's text (None)
    ends: dict[str | None, int] = {call_id: len(out) + k + 1 for k, call_id in enumerate(order)}
    out.extend({"role": "tool", "content": results[call_id]} for call_id in order)
    text = "\n".join(filter(None, texts))  # client text is never empty (_text): "" is results only
    if text:
        out.append({"role": "user", "content": text})
        ends[None] = len(out)
    for block, where, key in marked:  # request order, as the breakpoint rules count
        points.take(block, where, ends[key])
    return set(results)


def _answer(call_id: Any, field: str, calls: Mapping[str, int], answered: Mapping[str, str]) -> str:
    """The tool_use id a tool_result at ``field`` names: one of ``calls`` (the previous assistant
    turn's), not yet ``answered`` in this turn."""
    if not isinstance(call_id, str):
        raise invalid(f"{field}.tool_use_id", "must be a string")
    if not calls:
        raise invalid(field, "tool_result block(s) provided when previous message does not contain any tool_use blocks")
    if call_id not in calls:
        raise invalid(field, f"unexpected tool_use_id found in tool_result blocks: {call_id}. "
                      "Each tool_result block must have a corresponding tool_use block in the previous message.")
    if call_id in answered:
        raise invalid(f"{field}.tool_use_id", f"'{call_id}' is answered twice; a tool_use block takes one tool_result")
    return call_id


def _tool_result(block: dict, field: str) -> tuple[str, list[tuple[dict, str]]]:
    """The result's text, and its content blocks with their fields (for their ``cache_control``);
    only ToolResultBlockParam's fields (``toolset_name``: accepted, ignored)."""
    _no_extra(block, _TOOL_RESULT_FIELDS, field)
    _toolset_name(block, field)
    content = block.get("content", "")
    nested: list[tuple[dict, str]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            parts.append(_text(part, f"{field}.content.{k}"))
            nested.append((part, f"{field}.content.{k}"))
        text = "\n".join(parts)
    else:
        raise invalid(f"{field}.content", "must be a string or a list of text blocks")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid(f"{field}.is_error", "must be a boolean")
    if is_error:
        text = "Error: " + text  # the template has no place for the flag; the model reads it in the text
    return text, nested


def _assistant(turn: Sequence[tuple[str, MessageParam]], out: list[dict], points: _Breakpoints,
               ids: set[str]) -> dict[str, str]:
    """Appends an assistant turn (consecutive assistant messages, with their fields) as one assistant
    message: its ``content`` the text blocks of all its messages joined as written, in request order
    (Anthropic combines the turn's blocks: two messages ``[a]``, ``[b]`` read as one ``[a, b]``); its ``tool_calls`` (when
    there are any) all the turn's ``tool_use`` blocks, in request order. Every block's breakpoint
    ends with that message. Returns the turn's tool_use ids, in order -> the field of the message
    holding each."""
    texts: list[str] = []  # per message: its text blocks joined ("" if it has none)
    calls: dict[str, str] = {}
    rendered: list[dict] = []
    end = len(out) + 1  # the one message this turn appends
    for field, message in turn:
        mine: list[str] = []
        marked: list[tuple[dict, str]] = []
        for j, block in enumerate(_blocks(message, field)):
            where = f"{field}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_use":
                rendered.append(_tool_use(block, where, ids))
                calls[block["id"]] = field
            elif kind == "tool_result":
                raise invalid(f"{where}.type", "tool_result blocks belong in user messages")
            else:
                mine.append(_text(block, where, blank=True))
            marked.append((block, where))
        texts.append("".join(mine))
        for block, where in marked:  # per message, after its blocks are checked, as the rules count
            points.take(block, where, end)
    message: dict = {"role": "assistant", "content": "".join(texts)}
    if rendered:
        message["tool_calls"] = rendered
    out.append(message)
    return calls


def _tool_use(block: dict, field: str, ids: set[str]) -> dict:
    """The chat call of a ``tool_use`` block; its ``id`` joins ``ids`` (unique in the request). Only
    ToolUseBlockParam's fields, so echoed assistant content passes: ``caller`` must be direct (no code
    execution runs here), ``toolset_name`` is accepted and ignored."""
    _no_extra(block, _TOOL_USE_FIELDS, field)
    caller = block.get("caller")
    if caller is not None and caller != {"type": "direct"}:
        raise invalid(f"{field}.caller", "only {\"type\": \"direct\"} is supported: this gateway runs no code "
                      "execution tool")
    _toolset_name(block, field)
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{field}.id", "must be a non-empty string")
    if call_id in ids:
        raise invalid(f"{field}.id", f"tool_use ids must be unique; '{call_id}' repeats")
    if not isinstance(name, str) or not name:
        raise invalid(f"{field}.name", "must be a non-empty string")
    if not isinstance(arguments, dict):
        raise invalid(f"{field}.input", "must be an object")
    ids.add(call_id)
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


def _toolset_name(block: dict, field: str) -> None:
    value = block.get("toolset_name")
    if value is not None and not isinstance(value, str):
        raise invalid(f"{field}.toolset_name", "must be a string")


def _check_tool_choice(choice: ToolChoice) -> None:
    """Each variant's fields, as the SDK's ToolChoice*Param define them: ``auto`` / ``any``
    take ``disable_parallel_tool_use``; ``tool`` ``name`` (required) and
    ``disable_parallel_tool_use``; ``none`` nothing else. A field sent as ``null`` counts as sent."""
    allowed = _CHOICE_FIELDS[choice.type]
    for key in ("name", "disable_parallel_tool_use"):  # the declared order: one answer for a body with both
        if key in choice.model_fields_set and key not in allowed:
            raise invalid(f"tool_choice.{key}", _EXTRA)
    if choice.type == "tool" and choice.name is None:
        raise invalid("tool_choice.name", "Field required")


def _tool_plan(body: MessagesInput, functions: list[dict]) -> tuple[ToolPlan | None, Guide | None]:
    choice = body.tool_choice
    if choice is not None:
        _check_tool_choice(choice)
    if not functions:
        if choice is not None and choice.type in ("any", "tool"):
            raise invalid("tool_choice", f"'{choice.type}' needs tools")
        return None, None
    for i, defined in enumerate(functions):  # the OpenAI path's bounds on a schema the engine compiles
        check_schema(defined["parameters"], f"tools.{i}.input_schema")
    by_name = {f["name"]: f for f in functions}
    kind = choice.type if choice is not None else "auto"
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    if kind == "tool":
        if choice.name not in by_name:
            raise invalid("tool_choice.name", f"must name one of the tools, got {choice.name if choice else None!r}")
        return ToolPlan(by_name, "forced", parallel=False), forced_call_guide([by_name[choice.name]])
    if kind == "any":
        return ToolPlan(by_name, "forced", parallel=False), forced_call_guide(functions)
    return ToolPlan(by_name, kind, parallel=parallel), None


def _output_guide(body: MessagesInput, guide: Guide | None, tools: ToolPlan | None) -> Guide | None:
    """``output_config.format``'s JSON-schema guide (OpenAI's response_format), else ``guide``; with
    tools the model may call (auto), the guide allows the format's JSON or ``tool_use`` calls
    (:mod:`~server.gateway.api.union_guide`)."""
    output = body.output_config
    if output is None or output.format is None:
        return guide
    check_schema(output.format.schema_, "output_config.format.schema")
    if guide is not None:
        raise invalid("output_config.format", "cannot be combined with a tool_choice that forces a tool call")
    if tools is not None and tools.mode == "auto":
        functions = list(tools.functions.values())
        return format_or_calls_guide(output.format.schema_, functions, parallel=tools.parallel,
                                     field="output_config.format", schema_field="output_config.format.schema",
                                     tool_fields=[f"tools.{i}.input_schema" for i in range(len(functions))])
    # property order is kept: it is the order the model writes the fields in (as for response_format)
    return Guide("json_schema", json.dumps(output.format.schema_, separators=(",", ":")))
