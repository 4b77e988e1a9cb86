"""What every dialect converts its request to before the one request core: the chat request.

A dialect module (Anthropic Messages, OpenAI Responses) parses its own body and returns a
:class:`Conversation`: template-ready messages, the function tools in OpenAI's shape, the
tool plan and guide the OpenAI path would build, and, where the dialect marks cache
breakpoints, how many messages each breakpoint's prefix spans and its TTL. Bad input is a
400 naming the field (:func:`invalid`), rendered in the dialect's own error shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.contract import Guide
from server.gateway.api.prompting import Mark
from server.gateway.api.tools import ToolPlan
from server.gateway.errors import ServingError


@dataclass(frozen=True, slots=True)
class Conversation:
    """The chat request a dialect's body converts to."""

    messages: list[dict]  # template-ready {role, content}
    functions: list[dict]  # OpenAI-shaped function definitions, in request order
    tools: ToolPlan | None
    guide: Guide | None
    # per cache breakpoint, in request order: how many messages its prefix spans, or a point inside a message
    marks: tuple[Mark, ...] = ()
    ttls: tuple[int, ...] = ()  # per cache breakpoint: TTL in ms


def invalid(field: str, message: str) -> ServingError:
    """A 400 ``invalid_request`` naming ``field``."""
    return ServingError(400, "invalid_request", f"{field}: {message}", param=field)


def function(name: str, description: Any, field: str) -> dict[str, Any]:
    """An OpenAI-shaped function definition's head: ``name``, and ``description`` when given (a
    string, else :func:`invalid` naming ``field.description``); the caller adds the parameters."""
    head: dict[str, Any] = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise invalid(f"{field}.description", "must be a string")
        head["description"] = description
    return head

