"""Request bodies of the OpenAI Responses dialect (``POST /v1/responses``).

The top level is strict, as on the other routes: a field kvgate does not declare is a 400
``unsupported_parameter`` naming it. Input items, tools and ``tool_choice`` objects stay
plain JSON here and are checked one by one in ``server.gateway.api.responses_convert``, so
that what cannot be served (built-in tools, images, files, reasoning items) is refused with
a message naming the item and its type rather than a union-mismatch error. Fields OpenAI
defines that kvgate cannot serve (``background: true``, ``conversation``, ``prompt``,
``reasoning`` effort other than ``none``, ``truncation: "auto"``,
``prompt_cache_options.mode: "explicit"``, ``prompt_cache_options.prewarm: true``) are
declared only to be refused by name; the README's field table lists each field as honoured, ignored or refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from server.gateway.api.openai_schemas import MAX_MESSAGES, MAX_TEXT_CHARS, MAX_TOOLS

Item = dict[str, Any]
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value that changes the answer
# Every ``include`` value OpenAI documents (the SDK's ``ResponseIncludable``). On
# ``GET …/input_items`` each is harmless: they add fields to item types kvgate never stores
# (built-in tool calls, images, reasoning) or to output text, so they are accepted there and
# change nothing; any other value is refused by name.
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", OUTPUT_LOGPROBS)
# ``prompt_cache_options.ttl`` (the SDK's replacement of the deprecated ``prompt_cache_retention``)
# read as the retention intent ``prompt_cache_retention`` states: "30m", OpenAI's default
# lifetime, as "in_memory" (the default); "12h", the extended one, as "24h" (the class's longest).
TTL_RETENTION = {"30m": "in_memory", "12h": "24h"}
# OpenAI's bounds on ``metadata``: at most 16 pairs, keys of at most 64 characters, values of at most 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: dict[str, Any] | None = None  # text | json_object | json_schema (checked in responses_convert)
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, ignored: the model has one verbosity


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_obfuscation: bool | None = None  # accepted, ignored: no obfuscation padding is sent


class PromptCacheOptions(BaseModel):
    """OpenAI's ``prompt_cache_options``: ``ttl`` honoured (``TTL_RETENTION``); ``mode``
    ``"implicit"`` (the default: one breakpoint at the prompt's end, as kvgate places it) and
    ``prewarm: false`` accepted, ``"explicit"`` and ``prewarm: true`` refused by name
    (``responses_convert.refuse_unservable``); ``comparison_response_id`` (cache
    diagnostics, sent only where OpenAI enables them) accepted and ignored; any other
    field refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)
    ttl: Literal["30m", "12h"] | None = None
    mode: Literal["implicit", "explicit"] | None = None
    prewarm: bool | None = None
    comparison_response_id: Annotated[str, Field(max_length=64)] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Annotated[str, Field(min_length=1, max_length=256)]
    # None (absent or null): only with previous_response_id (responses_convert.request_items); bounded by _input_bounds
    input: str | list[Any] | None = None
    instructions: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | None = None
    tools: Annotated[list[Item], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=MAX_TOOLS)] | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    metadata: dict[str, str] | None = None  # bounded by _metadata_bounds (a 400 naming ``metadata``)
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # deprecated by OpenAI for the next
    prompt_cache_options: PromptCacheOptions | None = None
    store: bool | None = None  # None: true, as OpenAI's default
    previous_response_id: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False  # null is false (_null_stream), as OpenAI reads it
    stream_options: StreamOptions | None = None
    # accepted, ignored: the API key names the tenant; one service tier
    user: Annotated[str, Field(max_length=256)] | None = None
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    # declared only to be refused by name (responses_convert.refuse_unservable)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    context_management: Any = None

    @property
    def cache_retention(self) -> Literal["in_memory", "24h"] | None:
        """The retention intent: ``prompt_cache_retention``, else ``prompt_cache_options.ttl`` read
        by ``TTL_RETENTION`` (both given and differing is refused: ``refuse_unservable``)."""
        if self.prompt_cache_retention is not None:
            return self.prompt_cache_retention
        ttl = self.prompt_cache_options.ttl if self.prompt_cache_options is not None else None
        return None if ttl is None else TTL_RETENTION[ttl]  # type: ignore[return-value]

    @field_validator("stream", mode="before")
    @classmethod
    def _null_stream(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("input", mode="before")
    @classmethod
    def _input_bounds(cls, value: Any) -> Any:
        """A string of at most ``MAX_TEXT_CHARS`` or a list of at most ``MAX_MESSAGES`` items, checked
        before the type so that every breach is one 400 whose param is ``input`` itself (a union's
        errors would name its member: ``input.constrained-str``). The items are checked one by one
        in ``responses_convert``."""
        if isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
            raise _field_error("input", f"string too long: at most {MAX_TEXT_CHARS} characters, got {len(value)}")
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            raise _field_error("input", f"array too long: at most {MAX_MESSAGES} items, got {len(value)}")
        if value is not None and not isinstance(value, (str, list)):
            raise _field_error("input", "must be a string or a list of input items")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's bounds, checked here so that every breach is a 400 whose param is ``metadata``
        itself (a per-key constraint would name the offending key, a text of any length)."""
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise _field_error("metadata", f"at most {MAX_METADATA_PAIRS} key-value pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY:
                raise _field_error("metadata", f"keys are at most {MAX_METADATA_KEY} characters; "
                                   f"{key[:16]!r}… has {len(key)}")
            if len(text) > MAX_METADATA_VALUE:
                raise _field_error("metadata", f"values are at most {MAX_METADATA_VALUE} characters; the value of "
                                   f"{key!r} has {len(text)}")
        return value


def _field_error(field: str, detail: str) -> PydanticCustomError:
    # the detail goes in as context: braces in a client's key are never read as a template
    return PydanticCustomError(field, "{detail}", {"detail": detail})
