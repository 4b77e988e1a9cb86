"""Anthropic Messages request → the core's chat request (messages, tools, guide, cache hints).

The same conversion vLLM does in ``vllm/entrypoints/anthropic/`` (an Anthropic request
becomes its chat request), so every engine feature reaches this dialect through the one
core: the result is the template-ready message list the OpenAI chat path would build
(``server.gateway.api.tools.render_messages``: tool definitions in the system message,
Hermes ``<tool_call>`` blocks), plus a :class:`~server.gateway.api.tools.ToolPlan` and
guide from the same functions the OpenAI path uses.

    Anthropic                                   chat request
    system (string | text blocks)            →  one system message (blocks joined by "\\n")
    tools [{name, description, input_schema}]→  functions [{name, description, parameters}]
    user: text blocks                        →  user message (consecutive blocks joined)
    user: tool_result blocks                 →  one ``tool`` message each, in order
    assistant: text + tool_use blocks        →  assistant message with ``tool_calls``
    tool_choice auto|any|tool|none           →  ToolPlan auto | forced (all) | forced (one) | none
    output_config.format (json_schema)       →  the JSON-schema guide (OpenAI's response_format)
    cache_control (top level)                →  a breakpoint after the last message

**Cache breakpoints.** ``cache_control`` on a block marks the prefix up to and including
that block, in the order tools → system → messages. kvgate resolves it at message
granularity: the breakpoint ends where the chat message holding the block ends (tools and
system blocks: the end of the system message, which holds both). A block inside a message
is thus rounded *up* to its message's end; exact per-block offsets would need a cut
inside a message's text, which changes its tokenization. The token offsets come from
``ChatPrompter.chat(..., marks=)``; :func:`cache_hints` turns them into
:class:`~retention.policy.hints.CacheHints` (breakpoints that land on the same offset merge, keeping
the longest TTL). Rules checked here, as Anthropic states them: at most four blocks with
``cache_control``; ``ttl`` is ``"5m"`` (default) or ``"1h"``; a longer TTL must not follow a
shorter one in that order (``1h`` after ``5m`` is refused).

Invariant: everything a request says is honoured, ignored on purpose (documented in the
README's field table), or refused with a :class:`ServingError` 400 whose message names the
field (``messages.2.content.0.type``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engines.contract import Guide
from retention.policy.hints import MAX_BREAKPOINTS, TTL_1H_MS, TTL_5M_MS, Breakpoint, CacheHints
from server.gateway.api.messages_schemas import MessagesInput
from server.gateway.api.prompting import PreparedPrompt
from server.gateway.api.conversion import Conversation, invalid
from server.gateway.api.tools import ToolPlan, check_schema, forced_call_guide, render_messages

_TTLS = {None: TTL_5M_MS, "5m": TTL_5M_MS, "1h": TTL_1H_MS}
# Content block types Anthropic defines that kvgate cannot serve (a text-only model, no server tools).
_UNSERVABLE_BLOCKS = {
    "image": "images", "document": "documents", "search_result": "search results",
    "thinking": "thinking blocks", "redacted_thinking": "thinking blocks",
    "server_tool_use": "server tools", "web_search_tool_result": "server tools",
    "web_fetch_tool_result": "server tools", "code_execution_tool_result": "server tools",
    "mcp_tool_use": "MCP tools", "mcp_tool_result": "MCP tools", "container_upload": "containers",
}


def refuse_unservable(body: MessagesInput) -> None:
    # "adaptive" lets the model decide whether to think; this model never does, so it is served as is.
    if body.thinking is not None and body.thinking.get("type") not in ("disabled", "adaptive"):
        raise invalid("thinking", "extended thinking is not supported by this gateway")
    for name in ("mcp_servers", "container", "context_management", "diagnostics"):
        if getattr(body, name) is not None:
            raise invalid(name, "not supported by this gateway")


class _Breakpoints:
    """Collects ``cache_control`` marks in request order and checks Anthropic's rules."""

    def __init__(self) -> None:
        self.marks: list[int] = []
        self.ttls: list[int] = []

    def take(self, block: dict, field: str, mark: int) -> None:
        control = block.get("cache_control")
        if control is None:
            return
        where = f"{field}.cache_control" if field else "cache_control"
        if not isinstance(control, dict) or control.get("type") != "ephemeral":
            raise invalid(where, "must be {\"type\": \"ephemeral\"} with an optional \"ttl\"")
        if set(control) - {"type", "ttl"}:
            raise invalid(where, f"unknown field(s) {sorted(set(control) - {'type', 'ttl'})}")
        ttl = control.get("ttl")
        if ttl not in _TTLS:
            raise invalid(f"{where}.ttl", "must be \"5m\" or \"1h\"")
        if len(self.marks) == MAX_BREAKPOINTS:
            raise invalid(where, f"a maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided")
        ttl_ms = _TTLS[ttl]
        if self.ttls and ttl_ms > min(self.ttls):
            raise invalid(f"{where}.ttl", "a 1h cache_control must not come after a 5m one "
                          "(longer TTLs first, in the order tools, system, messages)")
        self.marks.append(mark)
        self.ttls.append(ttl_ms)


def convert(body: MessagesInput) -> Conversation:
    """The chat request for ``body``, or a 400 :class:`ServingError` naming what cannot be served."""
    refuse_unservable(body)
    points = _Breakpoints()
    functions = _functions(body.tools or [], points)
    system = _system(body.system, points)
    out: list[dict] = []
    if system is not None or functions:
        out.append({"role": "system", "content": system or ""})  # render_messages appends the tools to it
    for i, message in enumerate(body.messages):
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        if not blocks:
            raise invalid(f"messages.{i}.content", "must not be empty")
        if message.role == "assistant":
            _assistant(blocks, f"messages.{i}", out, points)
        else:
            _user(blocks, f"messages.{i}", out, points)
    # Top-level cache_control: Anthropic puts it on the last cacheable block, i.e. after everything else.
    points.take({"cache_control": body.cache_control} if body.cache_control is not None else {}, "", len(out))
    if body.messages[-1].role == "assistant":
        raise invalid(f"messages.{len(body.messages) - 1}", "a final assistant message (prefill) is not supported; "
                      "end with a user message")
    plan, guide = _tool_plan(body, functions)
    output = getattr(body, "output_config", None)  # count_tokens bodies have none
    if output is not None and output.format is not None:
        check_schema(output.format.schema_, "output_config.format.schema")
        if guide is not None:
            raise invalid("output_config.format", "cannot be combined with a tool_choice that forces a tool call")
        # property order is kept: it is the order the model writes the fields in (as for response_format)
        guide = Guide("json_schema", json.dumps(output.format.schema_, separators=(",", ":")))
    if functions or any("tool_calls" in m for m in out):
        out = render_messages(out, functions)
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
            continue  # same message end as the previous breakpoint
        points.append(Breakpoint(end, ttl))
    return CacheHints(breakpoints=tuple(points))


def _functions(tools: Sequence[dict], points: _Breakpoints) -> list[dict]:
    functions: list[dict] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        field = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid(field, "must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise invalid(f"{field}.type", f"server tool '{kind}' is not supported; only custom tools "
                          "(name, description, input_schema) are")
        name = tool.get("name")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise invalid(f"{field}.name", "must be a non-empty string of at most 128 characters")
        if name in seen:
            raise invalid(f"{field}.name", f"tool names must be unique; '{name}' repeats")
        seen.add(name)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"{field}.input_schema", "must be a JSON schema object")
        function: dict[str, Any] = {"name": name}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise invalid(f"{field}.description", "must be a string")
            function["description"] = description
        function["parameters"] = schema
        functions.append(function)
        points.take(tool, field, 1)  # the tools live in the system message (message 0)
    return functions


def _system(system: str | list[dict] | None, points: _Breakpoints) -> str | None:
    if system is None or isinstance(system, str):
        return system
    texts = []
    for i, block in enumerate(system):
        texts.append(_text(block, f"system.{i}"))
        points.take(block, f"system.{i}", 1)
    return "\n".join(texts)


def _text(block: Any, field: str) -> str:
    if not isinstance(block, dict):
        raise invalid(field, "must be a content block object")
    kind = block.get("type")
    if kind != "text":
        raise invalid(f"{field}.type", _unservable(kind) if kind in _UNSERVABLE_BLOCKS else f"expected a text block, got {kind!r}")
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{field}.text", "must be a string")
    return text


def _unservable(kind: str) -> str:
    return f"'{kind}' blocks are not supported by this gateway ({_UNSERVABLE_BLOCKS[kind]}: the model reads text only)"


def _user(blocks: list, field: str, out: list[dict], points: _Breakpoints) -> None:
    texts: list[str] = []
    pending: list[tuple[dict, str]] = []  # text blocks with their field, until their message exists

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            for block, where in pending:
                points.take(block, where, len(out))
            texts.clear()
            pending.clear()

    for j, block in enumerate(blocks):
        where = f"{field}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            flush()
            out.append({"role": "tool", "content": _tool_result(block, where)})
            points.take(block, where, len(out))
        elif kind in ("tool_use",):
            raise invalid(f"{where}.type", "tool_use blocks belong in assistant messages")
        else:
            texts.append(_text(block, where))
            pending.append((block, where))
    flush()


def _tool_result(block: dict, field: str) -> str:
    if not isinstance(block.get("tool_use_id"), str):
        raise invalid(f"{field}.tool_use_id", "must be a string")
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_text(part, f"{field}.content.{k}") for k, part in enumerate(content))
    else:
        raise invalid(f"{field}.content", "must be a string or a list of text blocks")
    if block.get("is_error") is True:
        text = "Error: " + text  # the template has no place for the flag; the model reads it in the text
    return text


def _assistant(blocks: list, field: str, out: list[dict], points: _Breakpoints) -> None:
    texts: list[str] = []
    calls: list[dict] = []
    marked: list[tuple[dict, str]] = []
    for j, block in enumerate(blocks):
        where = f"{field}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            name, arguments = block.get("name"), block.get("input")
            if not isinstance(name, str) or not name:
                raise invalid(f"{where}.name", "must be a non-empty string")
            if not isinstance(arguments, dict):
                raise invalid(f"{where}.input", "must be an object")
            calls.append({"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)})
        elif kind == "tool_result":
            raise invalid(f"{where}.type", "tool_result blocks belong in user messages")
        else:
            texts.append(_text(block, where))
        marked.append((block, where))
    message: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    out.append(message)
    for block, where in marked:
        points.take(block, where, len(out))


def _tool_plan(body: MessagesInput, functions: list[dict]) -> tuple[ToolPlan | None, Guide | None]:
    choice = body.tool_choice
    if not functions:
        if choice is not None and choice.type in ("any", "tool"):
            raise invalid("tool_choice", f"'{choice.type}' needs tools")
        return None, None
    for i, function in enumerate(functions):  # the OpenAI path's bounds on a schema the engine compiles
        check_schema(function["parameters"], f"tools.{i}.input_schema")
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
