"""Reading the gateway's OpenAI SSE streams over raw HTTP (no SDK between us and the bytes)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tests.server.gateway.stack import MODEL


@dataclass
class StreamResult:
    status: int
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    usage: dict | None = None
    done: bool = False
    error: dict | None = None  # an in-stream error event, or the JSON error body of a non-200
    frames: int = 0
    malformed: int = 0

    @property
    def complete(self) -> bool:
        """One finish reason, usage, ``[DONE]``, no error: nothing was cut short."""
        return self.status == 200 and self.done and len(self.finish_reasons) == 1 and self.error is None \
            and self.usage is not None


def chat_body(messages: list[dict], *, max_tokens: int, stream: bool = True, **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


class SseParser:
    """Feed raw lines; accumulates a :class:`StreamResult`."""

    def __init__(self, result: StreamResult) -> None:
        self.result = result

    def line(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        data = line[6:]
        r = self.result
        r.frames += 1
        if data == "[DONE]":
            r.done = True
            return
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            r.malformed += 1
            return
        if "error" in payload:
            r.error = payload["error"]
            return
        if payload.get("usage"):
            r.usage = payload["usage"]
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            r.text += delta.get("content") or choice.get("text") or ""
            if choice.get("finish_reason"):
                r.finish_reasons.append(choice["finish_reason"])
