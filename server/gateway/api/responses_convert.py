"""OpenAI Responses request → the core's chat request (messages, tools, guide, cache hints).

The same move as the Anthropic dialect (``messages_convert``): a Responses body becomes
the template-ready message list the chat path builds (``tools.render_messages``: tool
definitions in the system message, Hermes ``<tool_call>`` blocks), plus a
:class:`~server.gateway.api.tools.ToolPlan` and guide from the same functions.

    Responses                                       chat request
    instructions                                 →  the first system message
    input: "text"                                →  one user message
    input left out (previous_response_id only)   →  no new items (the stored chain's alone)
    message item (role, content string or parts) →  a message of that role (parts joined)
      parts input_text | output_text | text      →  their text; refusal → its text
      (an assistant's parts: output_text | refusal)
    function_call item (call_id, name, arguments)→  a tool call on the assistant message
                                                    it follows (else a new, empty one)
    function_call_output item (call_id, output)  →  a ``tool`` message (a run of them in the
                                                    order of the calls they answer)
    tools [{type: function, name, parameters}]   →  functions [{name, description, parameters}]
    tool_choice none|auto|required|{function}    →  ToolPlan none | auto | forced (all) | forced (one)
    text.format json_schema | json_object        →  the JSON-schema guide (chat's response_format);
                                                    with tools the model may call (auto): the format's
                                                    JSON or function calls (union_guide); with a
                                                    tool_choice that forces a call, the call's guide

**Tool calls and outputs pair up** (:func:`check_items`, OpenAI's rules, 400 naming
``input``): every ``function_call_output`` answers a ``function_call`` before it (in the
request or the stored chain), every ``function_call`` of the request is answered once more
input follows it (only the calls that end the request may wait for the next one), and a
continuation answers the calls its stored chain ended with. The
template renders tool results without ids (Hermes: results answer calls in order), so
:func:`to_messages` puts each run of outputs in the order of the calls it answers: an output
sent out of order is still read as its own call's.

**Item ids are unique** across the request and the stored chain it continues (400 naming
``input``): ``GET …/input_items`` pages by them.

**Stored conversations.** Input items are *normalized* (:func:`normalize_items`: each gets an
``id``, message content becomes a list of parts) before they are stored, and a continuation
(``previous_response_id``) converts ``ancestors' input + output items + its own input``
with the same :func:`to_messages`, so it yields exactly the messages — hence the tokens —
of a request that sends the whole history itself. ``instructions`` are not carried over
from earlier responses (OpenAI's rule): each request's own instructions lead its prompt.

**Conversation retention.** A stored response (``store`` true) or a continuation marks its
whole prompt as a conversation prefix: one :class:`~retention.policy.hints.Breakpoint` at the
prompt's end (:func:`conversation_hints`), which the next turn extends.

**Context window.** A prompt over the tenant's ``max_prompt_tokens`` (admission's refusal) or
the model's input limit (the engine's) is OpenAI's 400 ``context_length_exceeded``, param
``input``, naming the prompt's tokens and the limit: :func:`in_responses_words` translates the
request core's refusal, so the limits are checked in one place.

Invariant: everything a request says is honoured, ignored on purpose (the README's field
table), or refused with a :class:`ServingError` 400 whose message names the field
(``input.2.content.0.type``); the id and pairing rules answer with OpenAI's own messages,
which name the item, and param ``input``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, NoReturn

from engines.contract import Guide
from retention.policy.hints import TTL_1H_MS, TTL_24H_MS, Breakpoint, CacheHints
from retention.policy.planner import SegmentRetention
from retention.routing.affinity import conversation_key  # the key the routing simulator replays too
from server.gateway.api.openai_schemas import FUNCTION_NAME, parameters_problem
from server.gateway.api.responses_schemas import OUTPUT_LOGPROBS, TTL_RETENTION, ResponsesRequest
from server.gateway.api.conversion import Conversation, function, invalid
from server.gateway.api.tools import ToolPlan, check_schema, forced_call_guide, render_messages
from server.gateway.api.union_guide import format_or_calls_guide
from server.gateway.errors import ServingError

# Built-in (hosted) tools OpenAI runs itself; kvgate runs none of them.
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                  "file_search", "code_interpreter", "computer", "computer_use", "computer_use_preview",
                  "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom", "tool_search")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ASSISTANT_PARTS = ("output_text", "refusal")  # OpenAI's: what the model wrote, never an input part
_UNSERVABLE_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_NAME_RULE = "must be 1 to 64 characters, each a letter (a-z, A-Z), a digit, an underscore or a dash"
# Items of the built-in tools besides their calls (``*_call``) and their outputs (``*_call_output``)
_BUILT_IN_ITEMS = ("mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "tool_search_output",
                   "additional_tools", "program", "program_output")
_ITEM_KEYS = {  # keys each item type may carry (id/status are echoed back by clients and ignored)
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status", "namespace", "caller"},
    "function_call_output": {"type", "call_id", "output", "id", "status", "name", "namespace", "caller"},
}


def unsupported(field: str, message: str) -> ServingError:
    return ServingError(400, "unsupported_parameter", f"{field}: {message}", param=field)


def refuse_unservable(body: ResponsesRequest) -> None:
    if body.background:
        raise unsupported("background", "background responses are not supported by this gateway; "
                          "send the request and wait for it (or stream it)")
    for name in ("conversation", "prompt", "context_management"):
        if getattr(body, name) is not None:
            raise unsupported(name, "not supported by this gateway")
    options = body.prompt_cache_options
    if options is not None:
        if options.mode == "explicit":
            raise unsupported("prompt_cache_options.mode", "\"explicit\" needs prompt_cache_breakpoint markers, which "
                              "this gateway does not read; send \"implicit\" (the default: the prompt's end)")
        if options.prewarm:
            raise unsupported("prompt_cache_options.prewarm", "prewarming without generating is not supported; "
                              "send the request itself")
        if (options.ttl is not None and body.prompt_cache_retention is not None
                and TTL_RETENTION[options.ttl] != body.prompt_cache_retention):
            raise invalid("prompt_cache_options.ttl", f"{options.ttl!r} asks for {TTL_RETENTION[options.ttl]!r} "
                          f"retention and prompt_cache_retention for {body.prompt_cache_retention!r}: send one "
                          "(prompt_cache_retention is deprecated for prompt_cache_options.ttl)")
    if body.reasoning is not None:
        effort = body.reasoning.get("effort")
        if effort not in (None, "none") or body.reasoning.get("summary") not in (None,):
            raise unsupported("reasoning", "this model does not reason: only effort \"none\" (or no reasoning) "
                              "is served")
    if body.truncation == "auto":
        raise unsupported("truncation", "\"auto\" would drop items from the conversation; only \"disabled\" is "
                          "served (a prompt over the limit is refused)")
    for i, value in enumerate(body.include or ()):
        if value != OUTPUT_LOGPROBS:
            raise unsupported(f"include.{i}", f"{value!r} is not served; only {OUTPUT_LOGPROBS!r} is")


def _name(value: Any) -> str | None:
    """A ``type`` / ``name`` field as a string, else None (a list or object never reaches a dict lookup)."""
    return value if isinstance(value, str) else None


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _text_of(content: Any, field: str, *, assistant: bool = False) -> str:
    """A content string, or its parts' texts joined; an assistant's parts are only its own kinds
    (``output_text``, ``refusal``: OpenAI refuses an ``input_text`` part there)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(field, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        where = f"{field}.{j}"
        if not isinstance(part, dict):
            raise invalid(where, "must be a content part object")
        kind = _name(part.get("type"))
        if kind in _UNSERVABLE_PARTS:
            raise unsupported(f"{where}.type", f"'{kind}' parts are not supported by this gateway "
                              f"({_UNSERVABLE_PARTS[kind]}: the model reads text only)")
        if assistant and kind not in _ASSISTANT_PARTS:
            raise invalid(f"{where}.type", f"an assistant message's parts are output_text or refusal, got {kind!r}")
        if kind == "refusal":
            text = part.get("refusal")
        elif kind in _TEXT_PARTS:
            text = part.get("text")
        else:
            raise invalid(f"{where}.type", f"expected input_text or output_text, got {kind!r}")
        if not isinstance(text, str):
            raise invalid(f"{where}.text", "must be a string")
        texts.append(text)
    return "".join(texts)


def request_items(body: ResponsesRequest) -> list[dict]:
    """The request's own input as stored items (:func:`normalize_items`); none when ``input`` is
    left out, which only a continuation may do (OpenAI's rule): its chain is the conversation, and
    :func:`check_items` still asks it for the outputs of the calls its chain ended with."""
    if body.input is None:
        if body.previous_response_id is None:
            raise invalid("input", "is required (only a request with previous_response_id may leave it out)")
        return []
    return normalize_items(body.input)


def normalize_items(body_input: str | list[Any]) -> list[dict]:
    """The request's input as stored items: each with an ``id``, a message's content as parts.

    Refuses (400, naming the item) what cannot be served or is malformed, so that only
    items :func:`to_messages` converts are ever stored."""
    if isinstance(body_input, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": body_input}]}]
    out: list[dict] = []
    for i, item in enumerate(body_input):
        field = f"input.{i}"
        if not isinstance(item, dict):
            raise invalid(field, "must be an item object")
        kind = _name(item.get("type", "message" if "role" in item else None))
        if kind not in _ITEM_KEYS:
            _refuse_item_type(kind, f"{field}.type")
        extra = set(item) - _ITEM_KEYS[kind]
        if extra:
            raise invalid(field, f"unknown field(s) {sorted(extra)} for a {kind} item")
        ident = item.get("id")
        if ident is not None and (not isinstance(ident, str) or not 0 < len(ident) <= 64):
            raise invalid(f"{field}.id", "must be a string of at most 64 characters")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise invalid(f"{field}.role", f"must be one of {list(_MESSAGE_ROLES)}")
            text = _text_of(item.get("content"), f"{field}.content", assistant=role == "assistant")
            part = "output_text" if role == "assistant" else "input_text"
            stored = {"id": ident or new_id("msg"), "type": "message", "role": role, "status": "completed",
                      "content": [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}]}
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                    raise invalid(f"{field}.{key}", "must be a non-empty string" if key != "arguments" else
                                  "must be a string (the arguments' JSON)")
            stored = {"id": ident or new_id("fc"), "type": "function_call", "call_id": item["call_id"],
                      "name": item["name"], "arguments": item["arguments"], "status": "completed"}
        else:
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise invalid(f"{field}.call_id", "must be a non-empty string")
            output = _text_of(item.get("output"), f"{field}.output")
            stored = {"id": ident or new_id("fco"), "type": "function_call_output", "call_id": item["call_id"],
                      "output": output, "status": "completed"}
        out.append(stored)
    return out


def _refuse_item_type(kind: str | None, field: str) -> NoReturn:
    """A type :func:`normalize_items` does not convert: OpenAI's own types refused by name (400
    ``unsupported_parameter``), anything else an unknown type (400 ``invalid_request``)."""
    if kind == "reasoning":
        raise unsupported(field, "reasoning items are not supported (this model does not reason)")
    if kind == "item_reference":
        raise unsupported(field, "item references are not supported; send the item itself or use previous_response_id")
    if kind in ("compaction", "compaction_trigger"):
        raise unsupported(field, f"'{kind}' items are not supported (context_management is not served)")
    if kind is not None and (kind.endswith(("_call", "_call_output")) or kind in _BUILT_IN_ITEMS):
        raise unsupported(field, f"'{kind}' items belong to built-in tools, which this gateway does not run")
    raise invalid(field, f"unknown item type {kind!r}")


def check_items(history: list[dict], items: list[dict]) -> None:
    """Refuse (400, param ``input``) a request whose normalized ``items`` repeat an item id
    (among themselves or of the stored ``history`` they continue), or whose tool calls and
    outputs do not pair up (the module docstring's rules; OpenAI's messages)."""
    seen = {item.get("id") for item in history}
    for item in items:
        if item["id"] in seen:
            raise _input_error(f"Duplicate item found with id {item['id']!r}.")
        seen.add(item["id"])
    called = {item["call_id"] for item in history if item["type"] == "function_call"}
    for item in items:
        if item["type"] == "function_call":
            called.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in called:
            raise _input_error(f"No tool call found for function call output with call_id {item['call_id']!r}.")
    _check_answered(history + items, len(history))


def _check_answered(every: list[dict], start: int) -> None:
    """Every call ending the stored chain (the calls that close ``every[:start]``) has an
    output in the request, and every call of the request (``every[start:]``) one after it
    unless nothing but calls follows it (it ends the request: its output comes with the next).
    Calls deeper in a stored chain are not looked at again (answered when the chain went on)."""
    first = _trailing_calls(every[:start])  # the chain's closing calls start here
    last = max(start, _trailing_calls(every))  # the request's own closing calls start here
    # An output answers the latest call of its id before it (as to_messages places it: a client
    # may reuse an id across turns, and each turn's call needs its own output).
    latest: dict[str, int] = {}
    answered: set[int] = set()
    for index, item in enumerate(every):
        if item["type"] == "function_call":
            latest[item["call_id"]] = index
        elif item["type"] == "function_call_output" and item["call_id"] in latest:
            answered.add(latest[item["call_id"]])
    for index in range(first, last):
        item = every[index]
        if item["type"] == "function_call" and index not in answered:
            raise _input_error(f"No tool output found for function call {item['call_id']!r}.")


def _trailing_calls(items: list[dict]) -> int:
    """Where the run of ``function_call`` items that ends ``items`` starts (``len(items)`` if none)."""
    index = len(items)
    while index > 0 and items[index - 1]["type"] == "function_call":
        index -= 1
    return index


def _input_error(message: str) -> ServingError:
    return ServingError(400, "invalid_request", message, param="input")


def in_responses_words(error: ServingError) -> ServingError:
    """The request core's refusal of a prompt too long for the tenant (admission, param
    ``max_prompt_tokens``) or for the model (the engine's refusal) as OpenAI answers it
    (400 ``context_length_exceeded``, param ``input``); any other error as it is (admission's
    other refusals already name the tenant limit, e.g. ``max_output_tokens``)."""
    if error.status == 400 and (error.param == "max_prompt_tokens" or error.code == "context_length_exceeded"):
        return ServingError(400, "context_length_exceeded", f"Your input exceeds the context window: "
                            f"{error.message}. Please adjust your input and try again.", param="input")
    return error


def to_messages(items: list[dict]) -> list[dict]:
    """Normalized items → chat messages (``tool_calls`` on assistant messages, ``tool`` messages,
    each run of them in the order of the calls they answer)."""
    out: list[dict] = []
    # call_id -> the place of its latest call among all calls: where its output goes in a run (a
    # client may reuse an id across turns; an output answers the latest call of its id)
    order: dict[str, int] = {}
    run: list[tuple[int, str]] = []  # the current run of outputs: (call place, output)
    placed = 0  # calls seen

    def flush() -> None:
        out.extend({"role": "tool", "content": output} for _, output in sorted(run, key=lambda r: r[0]))
        run.clear()

    for item in items:
        kind = item["type"]
        if kind == "function_call_output":
            # an output without a known call (stored before calls were checked) goes after the run's
            # answered calls, in the order it came
            run.append((order.get(item["call_id"], placed + len(run)), item["output"]))
            continue
        flush()
        if kind == "message":
            out.append({"role": item["role"], "content": "".join(p.get("text", "") for p in item["content"])})
        else:
            order[item["call_id"]] = placed
            placed += 1
            call = {"name": item["name"], "arguments": item["arguments"]}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    flush()
    return out


def convert(body: ResponsesRequest, items: list[dict]) -> Conversation:
    """The chat request for ``body`` over ``items`` (the stored chain's items + this request's,
    which the route has passed through :func:`check_items`; a delete's rebuild of a stored
    prompt converts them again, unchecked, as they were served)."""
    functions = _functions(body.tools or [])
    messages = to_messages(items)
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise invalid("input", "the input is empty")
    plan, guide = _tool_plan(body, functions)
    fmt = _format_guide(body)
    if fmt is not None and guide is None:  # a forced call's guide wins: the output is a call, no text to shape
        if plan is not None and plan.mode == "auto":
            schema_field = "text.format.schema" if body.text.format.get("type") == "json_schema" else "text.format"
            fmt = format_or_calls_guide(json.loads(fmt.text), functions, parallel=plan.parallel, field="text.format",
                                        tool_fields=[f"tools.{i}.parameters" for i in range(len(functions))],
                                        schema_field=schema_field)
        guide = fmt
    if functions or any("tool_calls" in m for m in messages):
        messages = render_messages(messages, functions)
    return Conversation(messages, functions, plan, guide)


def _functions(tools: list[dict]) -> list[dict]:
    functions: list[dict] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        field = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid(field, "must be a tool object")
        kind = _name(tool.get("type"))
        if kind != "function":
            if kind in BUILT_IN_TOOLS or kind is not None and kind.startswith(("web_search", "computer")):
                raise unsupported(f"{field}.type", f"built-in tool '{kind}' is not supported by this gateway; "
                                  "only function tools are")
            raise invalid(f"{field}.type", f"unknown tool type {kind!r}")
        extra = set(tool) - {"type", "name", "description", "parameters", "strict", "defer_loading"}
        if extra:
            raise invalid(field, f"unknown field(s) {sorted(extra)}")
        name = tool.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise invalid(f"{field}.name", _NAME_RULE)
        if name in seen:
            raise invalid(f"{field}.name", f"tool names must be unique; '{name}' repeats")
        seen.add(name)
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise invalid(f"{field}.strict", "must be a boolean")
        head = function(name, tool.get("description"), field)
        parameters = tool.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise invalid(f"{field}.parameters", "must be a JSON schema object")
            problem = parameters_problem(parameters)
            if problem is not None:
                raise invalid(f"{field}.parameters", problem)
            check_schema(parameters, f"{field}.parameters")
            head["parameters"] = parameters
        functions.append(head)
    return functions


def _tool_plan(body: ResponsesRequest, functions: list[dict]) -> tuple[ToolPlan | None, Guide | None]:
    choice = body.tool_choice
    by_name = {f["name"]: f for f in functions}
    if isinstance(choice, dict):
        kind = _name(choice.get("type"))
        if kind != "function":
            if kind in BUILT_IN_TOOLS or kind in ("file_search", "web_search_preview", "computer_use_preview"):
                raise unsupported("tool_choice.type", f"built-in tool '{kind}' is not supported by this gateway")
            raise unsupported("tool_choice.type", f"{kind!r} is not supported; use none, auto, required or "
                              "{\"type\": \"function\", \"name\": ...}")
        name = _name(choice.get("name"))
        if name is None or not FUNCTION_NAME.fullmatch(name):
            raise invalid("tool_choice.name", _NAME_RULE)
        if name not in by_name:
            raise invalid("tool_choice.name", f"must name one of the function tools, got {name!r}")
        return ToolPlan(by_name, "forced", parallel=False), forced_call_guide([by_name[name]])
    if choice not in (None, "none", "auto", "required"):
        raise invalid("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"name\": ...}")
    if not functions:
        if choice == "required":
            raise invalid("tool_choice", "'required' needs tools")
        return None, None
    if choice == "required":
        return ToolPlan(by_name, "forced", parallel=False), forced_call_guide(functions)
    return ToolPlan(by_name, choice or "auto", parallel=body.parallel_tool_calls is not False), None


def _format_guide(body: ResponsesRequest) -> Guide | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return None
    kind = _name(fmt.get("type"))
    if kind == "text":
        if set(fmt) != {"type"}:
            raise invalid("text.format", "a text format has no other fields")
        return None
    if kind == "json_object":
        if set(fmt) != {"type"}:
            raise invalid("text.format", "a json_object format has no other fields")
        return Guide("json_schema", json.dumps({"type": "object"}, separators=(",", ":")))
    if kind != "json_schema":
        raise invalid("text.format.type", "must be text, json_object or json_schema")
    extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
    if extra:
        raise invalid("text.format", f"unknown field(s) {sorted(extra)}")
    name = fmt.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise invalid("text.format.name", "must be a non-empty string of at most 64 characters")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise invalid("text.format.strict", "must be a boolean")
    if fmt.get("description") is not None and not isinstance(fmt["description"], str):
        raise invalid("text.format.description", "must be a string")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise invalid("text.format.schema", "must be a JSON schema object")
    check_schema(schema, "text.format.schema")
    # property order is kept: it is the order the model writes the fields in (as for response_format)
    return Guide("json_schema", json.dumps(schema, separators=(",", ":")))


def conversation_ttl_ms(context: SegmentRetention, retention: str | None) -> int:
    """How long a conversation prefix is asked to live: 24 h when the client asks for
    ``prompt_cache_retention: "24h"``, else the class's context duration when it has one,
    else an hour. A request, not a grant: the planner bounds it by the class."""
    if retention == "24h":
        return TTL_24H_MS
    if context.duration_ms:
        return context.duration_ms
    return TTL_1H_MS


def conversation_hints(body: ResponsesRequest, *, total: int, context: SegmentRetention,
                       conversation: bool, root_id: str | None = None) -> CacheHints:
    """The request's cache hints: ``prompt_cache_retention`` (or ``prompt_cache_options.ttl``,
    ``ResponsesRequest.cache_retention``) as on the chat path and, for a conversation (stored
    or continued), a breakpoint at the prompt's end. The affinity key is
    the client's ``prompt_cache_key`` when it sends one, else the conversation's root
    (``conversation_key``): the client's own grouping wins."""
    retention = body.cache_retention  # prompt_cache_retention or prompt_cache_options.ttl
    points = (Breakpoint(total, conversation_ttl_ms(context, retention)),) if conversation and total > 0 else ()
    key = body.prompt_cache_key if body.prompt_cache_key is not None else conversation_key(root_id)
    return CacheHints(breakpoints=points, cache_key=key, retention=retention)
