"""An output format *or* tool calls: the one guide for a format with tools the model may call.

A request with an output format (chat ``response_format``, Responses ``text.format``, Messages
``output_config.format``) and tools under ``tool_choice`` auto — what openai-agents sends for an
Agent with both ``output_type`` and ``tools`` — is guided by an EBNF grammar (``Guide("ebnf_grammar",
text)``) whose output is **either**

* the format's JSON: one value of its schema (``json_object``: any object), written as the
  format's own JSON-schema guide writes it (no free whitespace; ``", "`` and ``": "``), **or**
* one or more tool-call blocks exactly as :func:`~server.gateway.api.tools.parse_tool_calls`
  reads them, joined by ``"\\n"`` (exactly one block when parallel calls are off)::

      <tool_call>
      {"name": "<a function the request defines>", "arguments": {<its parameters schema>}}
      </tool_call>

  each block's object being :func:`~server.gateway.api.tools.call_schema` of one function (the
  forced-call guide's object), so an unknown function or arguments off their schema cannot be
  written.

Nothing comes before, between or after. The request core reads such output unchanged: text that
is call blocks becomes tool calls (finish reason ``tool_calls``), anything else is the format's
JSON as the answer (a JSON answer holding ``<tool_call>`` inside a string never parses as a call:
its quotes are escaped).

The grammar is built here, in the gateway, with xgrammar's Python API (``Grammar.from_json_schema``
for the format's schema and for the calls' ``anyOf``; xgrammar is imported on the first such
request, off the event loop: :func:`ready`), and its text written for the oldest
xgrammar an engine compiles it with: TensorRT-LLM release/1.2 pins ``xgrammar==0.1.25`` and
compiles an ``ebnf_grammar`` guide with ``compile_grammar`` (``tensorrt_llm/_torch/pyexecutor/
grammar_matcher.py``; the C++ executor: ``xgrammar::Grammar::FromEBNF`` in
``cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp``), while the gateway's xgrammar prints newer
syntax. So the printed rules pass :func:`_portable`, which keeps to the syntax 0.1.25 parses:

* unbounded repetition ``x{m, -1}`` (0.2's printer) is written ``x*``, ``x+`` or ``x{m,}``;
* a ``Regex(...)`` rule (0.2's form of a schema ``pattern``, ``patternProperties`` or
  ``propertyNames``) and a positive character class with a non-ASCII character (0.1.25 matches
  no character of a non-ASCII range) have no portable form: the request is refused (400
  naming the schema's field) rather than guided differently per engine.

Invariants: the guide's text is at most ``MAX_GUIDE_BYTES`` (else a 400 naming the format's
field); the same format, functions and parallel setting give the same text (built once, cached),
so an engine's compiled-grammar cache hits; every rule name is namespaced (``format_*``,
``call_*``, the three rules of its own), so the two schemas' rules never collide.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import anyio

from engines.contract import MAX_GUIDE_BYTES, Guide
from server.gateway.api.conversion import invalid
from server.gateway.api.tools import CALL_CLOSE, CALL_OPEN, call_schema

def _xgrammar() -> Any:
    # Imported on first use: xgrammar imports torch and transformers (seconds, hundreds of MB),
    # which a gateway that never sees a format with tools should not pay. Python's import system
    # keeps the module (sys.modules) and serializes a first import racing in two threads.
    return importlib.import_module("xgrammar")


async def ready(field: str) -> None:
    """Import xgrammar off the event loop before a guide is built on it (``field``: the format's,
    named in the 400 when this gateway has no xgrammar). Always through a thread: a module is in
    ``sys.modules`` from the moment its first import starts, so a request racing that import would
    otherwise wait for it on the loop (seconds); once imported, the thread finds it at once."""
    try:
        await anyio.to_thread.run_sync(_xgrammar)
    except ImportError:
        raise invalid(field, "with tools the model may call, an output format needs a grammar compiler "
                      "(xgrammar), which this gateway does not have: send tool_choice \"none\", or leave the "
                      "format out") from None


class _Refused(Exception):
    """A schema the combined guide cannot carry; ``part`` is "format" or a function's index."""

    def __init__(self, part: str | int, message: str) -> None:
        super().__init__(message)
        self.part = part


def format_or_calls_guide(schema: Mapping[str, Any], functions: Sequence[Mapping[str, Any]], *, parallel: bool,
                          field: str, tool_fields: Sequence[str], schema_field: str | None = None) -> Guide:
    """The EBNF guide for "the format's JSON (``schema``) or call blocks of ``functions``".

    ``field`` names the format in errors (``response_format``, ``text.format``,
    ``output_config.format``), ``schema_field`` its schema where the dialect names it apart
    (``text.format.schema``; default ``field``), ``tool_fields`` each function's parameters schema."""
    try:
        text = _ebnf(json.dumps(schema, ensure_ascii=False),
                     json.dumps([call_schema(f) for f in functions], ensure_ascii=False), parallel)
    except _Refused as exc:
        raise invalid((schema_field or field) if exc.part == "format" else tool_fields[int(exc.part)], str(exc)) from None
    size = len(text.encode())
    if size > MAX_GUIDE_BYTES:
        raise invalid(field, f"with the tools the model may call, the output's grammar (the format's JSON or "
                      f"tool calls) is {size} bytes, over the limit of {MAX_GUIDE_BYTES}: send a smaller schema "
                      "or fewer tools")
    return Guide("ebnf_grammar", text)


@lru_cache(maxsize=64)
def _ebnf(schema: str, calls: str, parallel: bool) -> str:
    fmt = _portable(_schema_ebnf(json.loads(schema), "format"), "format_", "format")
    call = _call_rules(json.loads(calls))
    repeat = ' ("\\n" tool_call)*' if parallel else ""
    head = (f"root ::= format_root | tool_calls\n"
            f"tool_calls ::= tool_call{repeat}\n"
            f"tool_call ::= {_literal(CALL_OPEN + chr(10))} call_root {_literal(chr(10) + CALL_CLOSE)}\n")
    return head + fmt + call


def _call_rules(variants: list[dict]) -> str:
    """The rules of one call object (``call_root``): any of ``variants``, one per function."""
    try:
        return _portable(_schema_ebnf(variants[0] if len(variants) == 1 else {"anyOf": variants}, 0), "call_", 0)
    except _Refused:
        for i, variant in enumerate(variants):  # name the function whose schema is refused
            _portable(_schema_ebnf(variant, i), "call_", i)
        raise


def _schema_ebnf(schema: Any, part: str | int) -> str:
    xgr = _xgrammar()
    try:  # as the engines compile a json_schema guide (engines/reference/grammar.py)
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema, ensure_ascii=False), any_whitespace=False,
                                               strict_mode=True)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses with the converter's message
        raise _Refused(part, f"the JSON schema cannot be compiled: {exc}") from None
    return str(grammar)


# How a refusal of a schema that compiles alone starts: why it is refused here.
_COMBINED = ("with tools the model may call (tool_choice auto), the output format and the tools' schemas are "
             "one grammar, which must compile on every engine:")


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


# The printed grammar, token by token: a string literal, a character class, a rule name, a
# repetition range, "::=", or one character of punctuation / whitespace.
_TOKEN = re.compile(r'''
    (?P<literal>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<range>\{\s*(?P<low>\d+)\s*(?:,\s*(?P<high>-?\d+)\s*)?\})
  | (?P<define>::=)
  | (?P<other>[()|*+?=\s])
''', re.VERBOSE | re.DOTALL)
_NON_ASCII = re.compile(r"\\x[89a-fA-F][0-9a-fA-F]|\\u|\\U|[^\x00-\x7f]")


def _portable(text: str, prefix: str, part: str | int) -> str:
    """``text`` (rules printed by the gateway's xgrammar) with every rule name prefixed and in the
    syntax xgrammar 0.1.25 parses (the module's list); :class:`_Refused` naming ``part`` where
    there is none."""
    out: list[str] = []
    at = 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            raise _Refused(part, f"{_COMBINED} this schema's grammar has no form every engine compiles "
                           f"(at {text[at:at + 20]!r})")
        at = match.end()
        token = match.group(0)
        if match.group("name") is not None:
            if text.startswith("(", at):  # a builtin like Regex(...): no 0.1.25 form
                what = "a regular expression (pattern, patternProperties or propertyNames)" if token == "Regex" else token
                raise _Refused(part, f"{_COMBINED} the schema uses {what}, which has no JSON-safe form in "
                               "TensorRT-LLM's xgrammar (0.1.25): leave it out, or send the format without tools "
                               "(or with tool_choice \"none\")")
            out.append(prefix + token)
        elif match.group("range") is not None:
            low, high = int(match.group("low")), match.group("high")
            if high is None or int(high) >= 0:
                out.append(f"{{{low}, {int(high) if high is not None else low}}}")
            else:  # unbounded
                out.append("*" if low == 0 else "+" if low == 1 else f"{{{low},}}")
        elif match.group("cls") is not None and not token.startswith("[^") and _NON_ASCII.search(token):
            raise _Refused(part, f"{_COMBINED} the schema needs a set of non-ASCII characters, which "
                           "TensorRT-LLM's xgrammar (0.1.25) does not match reliably")
        else:
            out.append(token)
    body = "".join(out)
    return body if body.endswith("\n") else body + "\n"

