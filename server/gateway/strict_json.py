"""Request bodies of the serving API parsed as standard JSON whose text is Unicode.

Python's ``json`` also takes ``NaN``, ``Infinity`` and ``-Infinity``, which JSON has not, and
reads a number too large for a float (``1e999``) as infinity: a body holding one is refused as
not JSON (a tool call's arguments carrying one could never be answered as JSON). Bytes are
decoded as strict UTF-8 first: ``json.loads`` would let raw surrogate bytes through.

JSON may spell a UTF-16 surrogate as an escape (``"\\ud800"``); a pair is one character
(``"\\ud83d\\ude00"`` is 😀), but a lone one is no character at all. Python's ``json`` takes
it anyway, into a ``str`` that cannot be encoded: the tokenizer then refuses it with a
``TypeError``, and echoing it back (``metadata``, ``user``) or storing it fails when the answer
is encoded, after the engine has run. So a body holding one is refused at parsing, like any
other body that is not JSON text (400 ``invalid_json``), by both the hot routes' fast path
and FastAPI's routes (:class:`StrictJsonRoute`).

Cost: one regex scan of the raw body for a surrogate escape (a C loop; bodies from clients that
send UTF-8 never match); only a body that has one is encoded once more to find a lone one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
LONE_SURROGATE = "a string holds a lone UTF-16 surrogate escape, which is not a Unicode character"


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


def _finite(text: str) -> float:
    value = float(text)
    if value in (_INF, -_INF):
        raise json.JSONDecodeError(f"{text} is too large for a number", text, 0)
    return value


_INF = float("inf")
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)  # built once: the hot path's


def standard(text: str) -> Any:
    """Parse standard JSON text: no ``NaN`` / ``Infinity``, no number that overflows a float
    (``json.JSONDecodeError`` otherwise, a ``ValueError``)."""
    return _DECODER.decode(text)


def standard_prefix(text: str, start: int) -> tuple[Any, int]:
    """:func:`standard` of the one JSON value starting at ``text[start]`` (no whitespace before it):
    ``(value, index just past it)``; what follows is not read."""
    return _DECODER.raw_decode(text, start)


def loads(raw: bytes | str) -> Any:
    """:func:`standard` of ``raw`` (bytes as strict UTF-8), also refusing a string holding a lone
    surrogate; every refusal is a ``json.JSONDecodeError``."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise json.JSONDecodeError(f"not UTF-8 at byte {exc.start}", "", 0) from None
    else:
        text = raw
    data = standard(text)
    blob = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    first = _SURROGATE_ESCAPE.search(blob)
    if first is not None:
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise json.JSONDecodeError(LONE_SURROGATE, blob.decode("utf-8", "replace"), first.start()) from None
    return data


class _StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJsonRoute(APIRoute):
    """An ``APIRoute`` whose JSON body is parsed by :func:`loads` (FastAPI turns its error into
    a ``json_invalid`` validation error, rendered as the dialect's 400)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJsonRequest(request.scope, request.receive))

        return strict
