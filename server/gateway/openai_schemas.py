"""Request bodies of the OpenAI-compatible routes (pydantic, strict about what we cannot honour).

Parameters OpenAI defines but kvgate does not implement are accepted only at their
neutral value (``n=1``, penalties 0, ``logprobs`` false, no tools) and refused with a
400 naming the parameter otherwise; unknown fields are refused, so a typo never
silently changes behaviour. Types are strict (no ``"yes"``/``1`` for ``stream``, no
``true`` for ``max_tokens``, no numeric strings): a client bug surfaces as a 400, not as
a request that means something else. JSON integers are still accepted for floats.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_MESSAGES = 1024
MAX_TEXT_CHARS = 1_000_000
MAX_STOP_STRINGS = 4


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | list[TextPart] | None = None
    name: Annotated[str, Field(max_length=64)] | None = None
    tool_call_id: Annotated[str, Field(max_length=128)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Annotated[str, Field(min_length=1, max_length=256)]
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[str, Field(min_length=1, max_length=256)] | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    user: Annotated[str, Field(max_length=256)] | None = None
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    logprobs: Literal[False] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    top_logprobs: Literal[0] | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none"] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "text":
            raise ValueError("only response_format {\"type\": \"text\"} is supported")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | Annotated[list[Annotated[str, Field(max_length=MAX_TEXT_CHARS)]], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = 16
    echo: Literal[False] = False
    suffix: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list):
            self.prompt = self.prompt[0]
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
