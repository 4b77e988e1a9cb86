"""Mooncake-format request traces (kvcache-ai/Mooncake ``FAST25-release/traces``).

One JSON object per line: ``timestamp`` (ms), ``input_length``, ``output_length``,
``hash_ids`` (one id per ``block_size`` prompt tokens, 512 for Mooncake; equal leading ids
= shareable prefix). kvgate accepts optional fields: ``tenant`` (str), ``system_tokens``
and ``context_tokens`` (segment boundaries for the ``class`` policy), ``block_size``
(tokens per hash id; a live capture writes its pool's ``tokens_per_block`` on every line,
so a reader needs no flag: all lines that carry it must agree, and lines without it use
the caller's block size, 512 by default), and the client's cache hints
(``retention/policy/hints.py``): ``cache_breakpoints`` (a list of ``[token_end, ttl_ms]``, at most
four, strictly increasing ``token_end <= input_length``) and ``prompt_cache_retention``
(``"in_memory"`` | ``"24h"``), and ``prompt_cache_key`` (a string: the client's key for
requests that belong together, ``CacheHints.cache_key``; the cluster simulator routes by it).
Conversation fields (OpenAI Responses; ``retention/policy/conversation.py``): ``response_id``
(a string: the response this request produces), ``previous_response_id`` (the stored response
it continues), ``store`` (bool, default false: the response is stored, so it can be continued)
and ``offers_tools`` (bool, default false: the request offers tools, in any API — held only once
the tenant's stored Responses chains have measured its tool gaps — so it is
likely to end in a tool call whose result comes back soon), and ``output_kind``
(``"tool_call"`` | ``"message"``, optional: what the response turned out to be, known to the
gateway when the request completes; a tool loop's step that answers with a message rather
than a function call ends the run or waits for a human).
Other fields (a capture's observed outcome) are ignored here.

**Events** are lines with an ``op`` field instead of a prompt; one op exists::

    {"timestamp": 120000.0, "op": "delete_response", "response_id": "resp-7", "tenant": "acme"}

(``DELETE /v1/responses/{id}``; ``tenant`` optional as on request lines). :func:`parse_trace`
validates and skips them; :func:`parse_trace_events` returns them beside the requests.

Token synthesis (so the pool's real hashing and token comparison run): the ``j``-th
token of hash id ``h`` is ``(h * 2654435761 + j) mod 2^31``. Two different ids below
2^31 never produce the same block (the multiplier is odd, so ``(a - b) * K`` is not a
multiple of 2^31), and equal ids produce equal blocks, so block equality in the pool is
exactly hash-id equality in the trace. A request's tokens are its ids' blocks
concatenated and cut to ``input_length``.

Pure: parses lines handed in; the CLI does the file reading.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from retention.policy.hints import Breakpoint, CacheHints
from retention.types import RetentionPlanError

_MULT = 2654435761
_MASK = 2**31 - 1


class TraceError(ValueError):
    """A malformed trace line; the message names the line number and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # position in timestamp order
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str | None = None
    system_tokens: int | None = None
    context_tokens: int | None = None
    block_size: int | None = None  # the line's own block_size field, if it had one
    hints: CacheHints | None = None  # the client's cache hints, if the line carried any
    response_id: str | None = None  # the (Responses API) response this request produces
    previous_response_id: str | None = None  # the stored response it continues
    store: bool = False  # its response is stored (may be continued)
    offers_tools: bool = False  # it offers tools (any API)
    output_kind: str | None = None  # "tool_call" | "message": what its response was (known at completion)


@dataclass(frozen=True, slots=True)
class ResponseDeletion:
    """A ``delete_response`` event: the client deleted a stored response at ``timestamp_ms``."""

    timestamp_ms: float
    response_id: str
    tenant: str | None = None


DELETE_RESPONSE = "delete_response"


def _int_field(obj: dict, name: str, line: int, *, minimum: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"line {line}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_trace(lines: Iterable[str], *, block_size: int | None = None) -> list[TraceRequest]:
    """Parse and validate JSONL lines; returns requests sorted by timestamp (stable).

    ``block_size=None``: each line's ``block_size`` field, else 512 (Mooncake). An explicit
    ``block_size`` that a line contradicts is an error, as are lines that disagree. Event
    lines (``op``) are validated and left out (:func:`parse_trace_events` returns them).
    """
    return parse_trace_events(lines, block_size=block_size)[0]


def parse_trace_events(lines: Iterable[str], *, block_size: int | None = None
                       ) -> tuple[list[TraceRequest], list[ResponseDeletion]]:
    """:func:`parse_trace`, and the trace's ``delete_response`` events sorted by timestamp (stable)."""
    if block_size is not None and block_size < 1:
        raise TraceError("block_size must be >= 1")
    seen_block_size: tuple[int, int] | None = None  # (value, first line carrying it)
    raw: list[tuple[float, int, dict]] = []
    deletions: list[ResponseDeletion] = []
    for number, text in enumerate(lines, start=1):
        text = text.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"line {number}: expected a JSON object")
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise TraceError(f"line {number}: timestamp must be a number >= 0 (ms), got {ts!r}")
        if "op" in obj:
            deletions.append(_event(obj, float(ts), number))
            continue
        raw.append((float(ts), number, obj))
    deletions.sort(key=lambda d: d.timestamp_ms)
    raw.sort(key=lambda item: (item[0], item[1]))
    out: list[TraceRequest] = []
    for index, (ts, number, obj) in enumerate(raw):
        input_length = _int_field(obj, "input_length", number, minimum=1)
        output_length = _int_field(obj, "output_length", number, minimum=0)
        line_block = None
        if "block_size" in obj:
            line_block = _int_field(obj, "block_size", number, minimum=1)
            if block_size is not None and line_block != block_size:
                raise TraceError(f"line {number}: block_size {line_block} but the block size asked for is {block_size}")
            if seen_block_size is not None and seen_block_size[0] != line_block:
                raise TraceError(f"line {number}: block_size {line_block} differs from {seen_block_size[0]} "
                                 f"(line {seen_block_size[1]}); one trace has one block size")
            seen_block_size = seen_block_size or (line_block, number)
        size = line_block or block_size or 512
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _MASK for h in ids
        ):
            raise TraceError(f"line {number}: hash_ids must be a list of integers in [0, 2^31)")
        expected = -(-input_length // size)
        if len(ids) != expected:
            raise TraceError(
                f"line {number}: {len(ids)} hash_ids for input_length {input_length} "
                f"(expected {expected} with block size {size})"
            )
        tenant = obj.get("tenant")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise TraceError(f"line {number}: tenant must be a non-empty string")
        system = obj.get("system_tokens")
        context = obj.get("context_tokens")
        if system is not None:
            system = _int_field(obj, "system_tokens", number, minimum=0)
        if context is not None:
            context = _int_field(obj, "context_tokens", number, minimum=0)
        if (system or 0) > (context if context is not None else input_length) or (context or 0) > input_length:
            raise TraceError(f"line {number}: need system_tokens <= context_tokens <= input_length")
        out.append(TraceRequest(index, ts, input_length, output_length, tuple(ids), tenant, system, context,
                                line_block, _hints(obj, number, input_length), *_conversation(obj, number),
                                _output_kind(obj, number)))
    if seen_block_size is not None and any(r.block_size is None for r in out):
        raise TraceError(f"some lines carry block_size {seen_block_size[0]} and others none; "
                         "one trace has one block size")
    return out, deletions


def _optional_id(obj: dict, name: str, line: int) -> str | None:
    value = obj.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise TraceError(f"line {line}: {name} must be a non-empty string")
    return value


def _flag(obj: dict, name: str, line: int) -> bool:
    value = obj.get(name, False)
    if not isinstance(value, bool):
        raise TraceError(f"line {line}: {name} must be a boolean, got {value!r}")
    return value


def _conversation(obj: dict, line: int) -> tuple[str | None, str | None, bool, bool]:
    response, previous = _optional_id(obj, "response_id", line), _optional_id(obj, "previous_response_id", line)
    if response is not None and response == previous:
        raise TraceError(f"line {line}: a response cannot continue itself ({response!r})")
    return response, previous, _flag(obj, "store", line), _flag(obj, "offers_tools", line)


OUTPUT_KINDS = ("tool_call", "message")


def _output_kind(obj: dict, line: int) -> str | None:
    value = obj.get("output_kind")
    if value is not None and value not in OUTPUT_KINDS:
        raise TraceError(f"line {line}: output_kind must be one of {OUTPUT_KINDS}, got {value!r}")
    return value


def _event(obj: dict, ts: float, line: int) -> ResponseDeletion:
    if obj["op"] != DELETE_RESPONSE:
        raise TraceError(f"line {line}: unknown op {obj['op']!r} (known: {DELETE_RESPONSE!r})")
    unknown = set(obj) - {"timestamp", "op", "response_id", "tenant"}
    if unknown:
        raise TraceError(f"line {line}: a {DELETE_RESPONSE} line has unknown fields {sorted(unknown)}")
    response = _optional_id(obj, "response_id", line)
    if response is None:
        raise TraceError(f"line {line}: a {DELETE_RESPONSE} line needs a response_id")
    tenant = obj.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise TraceError(f"line {line}: tenant must be a non-empty string")
    return ResponseDeletion(ts, response, tenant)


def _hints(obj: dict, line: int, input_length: int) -> CacheHints | None:
    points = obj.get("cache_breakpoints")
    retention = obj.get("prompt_cache_retention")
    key = obj.get("prompt_cache_key")
    if points is None and retention is None and key is None:
        return None
    if key is not None and not isinstance(key, str):
        raise TraceError(f"line {line}: prompt_cache_key must be a string")
    if points is not None and (not isinstance(points, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
            for p in points)):
        raise TraceError(f"line {line}: cache_breakpoints must be a list of [token_end, ttl_ms] integer pairs")
    if any(p[0] > input_length for p in points or ()):
        raise TraceError(f"line {line}: a cache breakpoint's token_end is past input_length {input_length}")
    try:
        return CacheHints(tuple(Breakpoint(end, ttl) for end, ttl in points or ()), cache_key=key, retention=retention)
    except RetentionPlanError as exc:
        raise TraceError(f"line {line}: {exc}") from None


def hint_fields(hints: CacheHints | None) -> dict:
    """The trace-line fields for ``hints`` (empty without any): what :func:`parse_trace` reads back."""
    out: dict = {}
    if hints is None:
        return out
    if hints.breakpoints:
        out["cache_breakpoints"] = [[b.token_end, b.ttl_ms] for b in hints.breakpoints]
    if hints.retention is not None:
        out["prompt_cache_retention"] = hints.retention
    return out


def trace_block_size(requests: Iterable[TraceRequest], default: int = 512) -> int:
    """The block size the trace's lines carry (``parse_trace`` checked they agree), else ``default``."""
    for request in requests:
        return request.block_size or default
    return default


def request_tokens(request: TraceRequest, block_size: int = 512) -> np.ndarray:
    """The synthetic prompt (int32) of ``request``; see the module docstring."""
    ids = np.asarray(request.hash_ids, dtype=np.int64)
    # Only the prompt's own positions: a grid of every block's full width would allocate
    # block_size values per hash id (a 2e9 block size: the whole machine's memory).
    j = np.arange(min(request.input_length, len(ids) * block_size), dtype=np.int64)
    return ((ids[j // block_size] * _MULT + j % block_size) & _MASK).astype(np.int32)


def distinct_blocks(requests: Iterable[TraceRequest]) -> int:
    """Distinct hash ids in the trace (= distinct prompt blocks at the trace's block size)."""
    seen: set[int] = set()
    for request in requests:
        seen.update(request.hash_ids)
    return len(seen)
