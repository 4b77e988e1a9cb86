"""OpenAI function calling on a chat template without tool support.

SmolLM2's template (and any template that only renders ``role`` + ``content``) has no
place for tool definitions, so kvgate renders them itself, in the Hermes format many
open models are trained on (Qwen2.5, Hermes 2/3) — this is the documented format:

* the tool definitions go into the **system** message (appended to the request's first
  system/developer message, or as a system message of their own), so they are part of
  the system retention segment and cached with it. The Messages path puts them *before*
  that message's text instead (``tools_first``): Anthropic's cache prefix order is tools →
  system → messages, so a tool breakpoint's prefix is the tools alone; the chat-completions
  and Responses prompts keep the system text first::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

* an assistant message's ``tool_calls`` are rendered back as ``<tool_call>`` blocks in its
  content; ``tool`` messages keep their role (ChatML renders ``<|im_start|>tool``).
* ``tool_choice``: ``none`` — the tools are still shown (as OpenAI does) but the output is
  never parsed for calls; ``auto`` — ``<tool_call>`` blocks in the output become
  ``message.tool_calls`` (with an output format as well, the output is constrained to either the
  format's JSON or call blocks: :mod:`~server.gateway.api.union_guide`); ``required`` / a named
  function — the output is **constrained** by a JSON-schema guide to exactly one
  ``{"name": ..., "arguments": {...}}`` object whose arguments follow the function's
  ``parameters`` schema, so the call is always valid.

Invariant: :func:`parse_tool_calls` only returns calls to functions the request defined,
with ``arguments`` a JSON object serialized as a string (OpenAI's shape).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engines.contract import MAX_GUIDE_BYTES, MAX_GUIDE_DEPTH, Guide, json_depth
from server.gateway import strict_json
from server.gateway.api.stops import StopMatcher
from server.gateway.errors import ServingError

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call>"
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text

    def to_openai(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What the gateway does with the output of a request that has tools."""

    functions: dict[str, dict]  # name -> the function definition (OpenAI shape)
    mode: str  # "none" | "auto" | "forced"
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def tools_system_text(functions: Sequence[Mapping[str, Any]]) -> str:
    lines = [json.dumps({"type": "function", "function": dict(f)}, ensure_ascii=False) for f in functions]
    return _PREAMBLE + "\n".join(lines) + _POSTAMBLE


def tool_text_ends(functions: Sequence[Mapping[str, Any]]) -> list[int]:
    """Per function, where a cache breakpoint on it ends in :func:`tools_system_text`: after its own
    line (the functions before it and itself, nothing after), the last one after the whole text
    (its closing instructions too)."""
    ends, at = [], len(_PREAMBLE)
    for f in functions[:-1]:
        at += len(json.dumps({"type": "function", "function": dict(f)}, ensure_ascii=False))
        ends.append(at)
        at += 1  # the "\n" that joins the lines
    return [*ends, len(tools_system_text(functions))] if functions else []


def render_messages(messages: Sequence[Mapping[str, Any]], functions: Sequence[Mapping[str, Any]], *,
                    tools_first: bool = False) -> list[dict]:
    """Template-ready ``{role, content}`` messages with the tools in the system message: after its
    text, or (``tools_first``) before it, so that the message's content starts with exactly
    :func:`tools_system_text` (the Messages path's tool breakpoints rely on it)."""
    out: list[dict] = []
    for message in messages:
        content = message.get("content") or ""
        calls = message.get("tool_calls") or ()
        if calls:
            blocks = [f"{CALL_OPEN}\n{json.dumps({'name': c['name'], 'arguments': _as_object(c['arguments'])}, ensure_ascii=False)}\n{CALL_CLOSE}"
                      for c in calls]
            # One newline before the calls, as the model writes them, whether or not the client sends back
            # the text with the newline it generated (a streamed text keeps it; a parsed one is stripped):
            # the turn then renders as generated, so its cached blocks are reused on the next turn.
            content = (content.rstrip("\n") + "\n" if content.strip("\n") else "") + "\n".join(blocks)
        out.append({"role": message["role"], "content": content})
    if functions:
        block = tools_system_text(functions)
        if out and out[0]["role"] in ("system", "developer"):
            text = out[0]["content"]
            joined = (f"{block}\n\n{text}" if tools_first else f"{text}\n\n{block}") if text else block
            out[0] = {"role": out[0]["role"], "content": joined}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def call_schema(function: Mapping[str, Any]) -> dict:
    """The JSON schema of one call object of ``function``: ``{"name": its name, "arguments": {...}}``,
    the arguments following its ``parameters`` (none: an empty object), "name" first."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"], "additionalProperties": False,
    }


def forced_call_guide(functions: Sequence[Mapping[str, Any]]) -> Guide:
    """A JSON-schema guide: one call object for one of ``functions`` (anyOf when several)."""
    variants = [call_schema(f) for f in functions]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return Guide("json_schema", json.dumps(schema, separators=(",", ":")))  # "name" first, then "arguments"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_forced(text: str, plan: ToolPlan) -> list[ToolCall]:
    """The single call a forced guide produced (empty if the output was cut short)."""
    try:
        value = _loads(text)
    except ValueError:
        return []
    call = _call_from(value, plan)
    return [call] if call is not None else []


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str, list[ToolCall]]:
    """Split ``auto`` output into (content before the first call, calls)."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    content = text[:start].rstrip()
    calls: list[ToolCall] = []
    rest = text[start:]
    while rest.startswith(CALL_OPEN):
        call, end = _block(rest, plan)
        if call is not None:
            calls.append(call)
        if end < 0:
            break
        rest = rest[end + len(CALL_CLOSE):].lstrip()
    if not calls:  # nothing usable: the text stays content, as the model wrote it
        return text, []
    return content, calls if plan.parallel else calls[:1]


def _block(rest: str, plan: ToolPlan) -> tuple[ToolCall | None, int]:
    """The call of the block ``rest`` starts with (``<tool_call>``…), and where its ``</tool_call>``
    starts (-1: none). The block's JSON is read as one value first, so a ``</tool_call>`` inside
    one of its strings is text, not the block's end; what is not one value and then the close tag
    (or the end of the text: a call cut just after its JSON) is no call, up to the first close tag."""
    at = len(rest) - len(rest[len(CALL_OPEN):].lstrip())
    try:
        value, after = strict_json.standard_prefix(rest, at)
    except ValueError:
        value, after = None, -1
    if after >= 0:
        close = len(rest) - len(rest[after:].lstrip())
        if rest.startswith(CALL_CLOSE, close):
            return _call_from(value, plan), close
        if close == len(rest):
            return _call_from(value, plan), -1
    return None, rest.find(CALL_CLOSE)


def _call_from(value: Any, plan: ToolPlan) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in plan.functions:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape (\ud800): no Unicode text, so no call a client could read
        return None
    return ToolCall(new_call_id(), value["name"], text)


def _loads(text: str) -> Any:
    """Standard JSON only (``strict_json.standard``: no NaN, Infinity or overflowing number): a call the
    model wrote with one is no call (its text stays content) rather than arguments no JSON answer carries."""
    return strict_json.standard(text)


class CallSplitter:
    """Streaming ``auto`` mode: passes content through until ``<tool_call>`` may start, then holds.

    ``push`` returns the text safe to stream as content; everything from the first
    ``<tool_call>`` on is kept in ``held`` for :func:`parse_tool_calls` at the end.
    """

    def __init__(self) -> None:
        self._pending = ""
        self.held = ""
        self.calling = False

    def push(self, text: str) -> str:
        if self.calling:
            self.held += text
            return ""
        self._pending += text
        at = self._pending.find(CALL_OPEN)
        if at >= 0:
            self.calling = True
            out, self.held, self._pending = self._pending[:at], self._pending[at:], ""
            return out
        # keep back a suffix that could be the start of "<tool_call>"
        keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self._pending)), 0, -1)
                     if CALL_OPEN.startswith(self._pending[-k:])), 0)
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class OutputRouter:
    """The engine's text of a request with tools (or log probabilities) → the content the client reads,
    and the text held for tool calls; the request's stop strings apply to the content only.

    Invariants: a stop string never cuts a tool call. A forced call's output (``mode`` "forced", a
    JSON-schema guide's form) is all held and never matched; in ``auto`` mode the content is the text
    before the first ``<tool_call>`` (:func:`parse_tool_calls` reads no content after it), so stop
    strings are matched up to there and not from there on: a stop string before a call ends the
    answer (the call never happens), one inside or after a call block does not. Held text that does
    not parse as a call becomes content at the end (:meth:`as_content`): cut at the first stop string
    in it, as if it had been matched as it came. ``mode`` None: no tools, stop strings on all the text.
    """

    __slots__ = ("_matcher", "_splitter", "_forced", "_held")

    def __init__(self, stops: tuple[str, ...], mode: str | None) -> None:
        self._matcher = StopMatcher(stops) if stops else None
        self._forced = mode == "forced"
        self._splitter = CallSplitter() if mode == "auto" else None
        self._held: list[str] = []  # forced: every piece (joined at the end)

    @property
    def holding(self) -> bool:
        """Whether text now goes to a tool call, not to the client (a stream then waits for the call's end)."""
        return self._forced or (self._splitter is not None and self._splitter.calling)

    @property
    def stopped(self) -> bool:
        return self._matcher is not None and self._matcher.stopped

    @property
    def matched(self) -> str | None:
        return self._matcher.matched if self._matcher is not None else None

    @property
    def held(self) -> str:
        """The text kept for tool calls ("" when a stop string in the content ended the answer first)."""
        if self.stopped:
            return ""
        if self._forced:
            return "".join(self._held)
        return self._splitter.held if self._splitter is not None else ""

    def push(self, text: str) -> str:
        """The content ``text`` adds (possibly "", text held back until it cannot start a stop string or a call)."""
        if self._forced:
            self._held.append(text)
            return ""
        splitter, matcher = self._splitter, self._matcher
        if splitter is not None:
            if splitter.calling:
                splitter.push(text)  # held for the calls, never matched
                return ""
            text = splitter.push(text)
        if matcher is None:
            return text
        out = matcher.push(text)  # "" once stopped
        if splitter is not None and splitter.calling and not matcher.stopped:
            out += matcher.flush()  # the content ended where the call began: nothing more can complete a stop string
        return out

    def flush(self) -> str:
        """The content still held back when the generation ends (not the calls' text)."""
        splitter, matcher = self._splitter, self._matcher
        if self._forced or (splitter is not None and splitter.calling) or (matcher is not None and matcher.stopped):
            return ""
        text = splitter.flush() if splitter is not None else ""
        if matcher is None:
            return text
        out = matcher.push(text)
        return out if matcher.stopped else out + matcher.flush()

    def as_content(self, held: str) -> str:
        """Held ``auto`` text that is no call after all, as content: up to the first stop string in it
        (which then ends the answer, :attr:`matched` naming it)."""
        matcher = self._matcher
        if matcher is None or matcher.stopped:
            return held
        out = matcher.push(held)
        return out if matcher.stopped else out + matcher.flush()


def check_schema(schema: dict | None, param: str) -> None:
    """A schema the engine will compile into a grammar: bounded nesting and size (else 400 naming ``param``)."""
    if schema is None:
        return
    if json_depth(schema) > MAX_GUIDE_DEPTH:
        raise ServingError(400, "invalid_request", f"{param}: the JSON schema nests deeper than {MAX_GUIDE_DEPTH} levels",
                           param=param)
    if len(json.dumps(schema)) > MAX_GUIDE_BYTES // 2:
        raise ServingError(400, "invalid_request", f"{param}: the JSON schema is larger than {MAX_GUIDE_BYTES // 2} bytes",
                           param=param)
