"""Anthropic Messages request bodies for the dialect's unit tests (the converter, its refusals)."""

from __future__ import annotations

from server.gateway.api.messages_schemas import CountTokensRequest, MessagesRequest

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
EPHEMERAL = {"type": "ephemeral"}


def request(**fields) -> MessagesRequest:
    """A create body: one user turn, ``max_tokens`` 16, then ``fields``."""
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return MessagesRequest.model_validate(body)


def count_request(**fields) -> CountTokensRequest:
    """A count_tokens body: one user turn, then ``fields``."""
    return CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields})


def user(content) -> dict:
    return {"role": "user", "content": content}
