"""Request bodies of the Anthropic Messages dialect (``/v1/messages``, ``/v1/messages/count_tokens``).

The top level is strict, as on the OpenAI routes: a field kvgate does not declare is a 400
naming it, so a typo never silently changes behaviour. Content blocks, tools and system
blocks stay plain JSON objects here and are checked one by one in
``server.gateway.api.messages_convert``, so that what cannot be served (images, documents,
server tools, thinking blocks) is refused with a message naming the block and its type
rather than with a union-mismatch error. Fields Anthropic defines that kvgate cannot serve
(``thinking`` of type ``enabled``, ``mcp_servers``, ``container``, ``context_management``,
``diagnostics``, ``compaction``, ``billing_policy``) are declared only to be refused by name;
the README's field table lists each field as honoured, ignored or refused.

``count_tokens`` takes what the SDK's count-tokens params define (:class:`MessagesInput`):
the conversation, and the fields that are valid on create too and leave the prompt as it is
(``output_config``: a guide adds no prompt token here; ``speed``, ``user_profile_id``,
``workspace_id``: ignored on both routes). Sampling, ``max_tokens``, ``stream`` and
``metadata`` stay create-only, as on Anthropic's API.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from server.gateway.api.openai_schemas import MAX_TEXT_CHARS, MAX_TOOLS

MAX_STOP_SEQUENCES = 4  # as on the OpenAI routes (the stop matcher holds back the longest one)
# Anthropic's own limit (the SDK's MessageCreateParams.messages: "a limit of 100,000 messages"); the
# HTTP body limit bounds the rest. kvgate's own caps (README's Messages field table): MAX_BLOCKS content
# blocks per message and system blocks, MAX_TOOLS tools, MAX_TEXT_CHARS characters per string.
MAX_MESSAGES = 100_000
MAX_BLOCKS = 1024

Block = dict[str, Any]


def _field_error(detail: str) -> PydanticCustomError:
    # the detail goes in as context: braces in a client's text are never read as a template
    return PydanticCustomError("invalid_value", "{detail}", {"detail": detail})


def _text_or_blocks(value: Any, what: str) -> Any:
    """A string of at most ``MAX_TEXT_CHARS`` or a list of at most ``MAX_BLOCKS`` items, checked before
    the type, so that a breach names the field itself (a union's errors would name its member:
    ``messages.0.content.constrained-str``). The items are checked one by one in ``messages_convert``."""
    if isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            raise _field_error(f"String should have at most {MAX_TEXT_CHARS} characters, got {len(value)}")
    elif isinstance(value, list):
        if len(value) > MAX_BLOCKS:
            raise _field_error(f"a maximum of {MAX_BLOCKS} {what} may be provided, got {len(value)}")
    elif value is not None:
        raise _field_error(f"must be a string or a list of {what}")
    return value


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str | list[Any]  # blocks: checked in messages_convert (a non-object is refused there)

    @field_validator("content", mode="before")
    @classmethod
    def _content_bounds(cls, value: Any) -> Any:
        return _text_or_blocks(value, "content blocks")


class ToolChoice(BaseModel):
    """The union of the SDK's four ToolChoice*Param variants; which fields each variant takes
    (``none``: only ``type``; ``tool``: ``name`` required) is checked per variant in
    ``messages_convert``, with Anthropic's "Extra inputs are not permitted" naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(max_length=128)] | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: OutputFormat | None = None  # honoured: the same JSON-schema guide as OpenAI's response_format
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted, ignored: no thinking


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    user_id: Annotated[str, Field(max_length=256)] | None = None  # accepted, not used: the API key names the tenant


class MessagesInput(BaseModel):
    """What both routes read: the conversation that becomes the prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: Annotated[str, Field(min_length=1, max_length=256)]
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[Any] | None = None  # blocks: checked in messages_convert
    tools: Annotated[list[Block], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: dict[str, Any] | None = None  # automatic caching: a breakpoint on the last block
    output_config: OutputConfig | None = None
    # accepted, ignored: one speed; the API key names the tenant
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: Annotated[str, Field(max_length=256)] | None = None
    workspace_id: Annotated[str, Field(max_length=256)] | None = None
    # Declared only to be refused by name (messages_convert.refuse_unservable).
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None
    context_management: Any = None
    diagnostics: Any = None
    compaction: Any = None  # beta: a summary the server writes in place of the conversation
    billing_policy: Any = None  # beta: the API key names the tenant that is billed

    @field_validator("system", mode="before")
    @classmethod
    def _system_bounds(cls, value: Any) -> Any:
        return _text_or_blocks(value, "system blocks")


class MessagesRequest(MessagesInput):
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)]  # required, as Anthropic requires it
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # Anthropic's range
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]],
                              Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    # accepted, ignored: one tier, one region
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: Annotated[str, Field(max_length=64)] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops_have_text(cls, stops: list[str] | None) -> list[str] | None:
        if stops and any(stop.isspace() for stop in stops):  # Anthropic's words
            raise PydanticCustomError("value_error", "each stop sequence must contain non-whitespace")
        return stops


class CountTokensRequest(MessagesInput):
    """``/v1/messages/count_tokens``: the conversation and the fields that leave its prompt as it is."""
