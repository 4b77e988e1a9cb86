"""Request bodies of the OpenAI-compatible routes (pydantic, strict about what we cannot honour).

Every OpenAI chat/completions field is honoured, accepted-and-ignored (documented in the
README's table), or refused with a 400 naming it: ``n`` is accepted only at 1; fields
kvgate does not declare (``audio``, ``modalities``, ``prediction``, ``functions``, ...)
are refused as ``unsupported_parameter``, so a typo never silently changes behaviour.
The vLLM-style extensions (``top_k``, ``min_tokens``, ``ignore_eos``,
``repetition_penalty``, ``stream_options.continuous_usage_stats``) are honoured. Types are strict (no ``"yes"``/``1`` for ``stream``, no
``true`` for ``max_tokens``, no numeric strings): a client bug surfaces as a 400, not as
a request that means something else. JSON integers are still accepted for floats.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from retention.policy.hints import CacheHints

MAX_MESSAGES = 1024
MAX_TEXT_CHARS = 1_000_000
MAX_STOP_STRINGS = 4


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's function names (fullmatch; the Responses API too)
FunctionName = Annotated[str, Field(pattern=f"^{FUNCTION_NAME.pattern}$")]


def parameters_problem(parameters: dict[str, Any]) -> str | None:
    """Why ``parameters`` cannot be a function's parameters, else None. OpenAI's rule: a JSON
    schema of ``"type": "object"`` (the arguments are a JSON object); ``{}`` is a function
    without parameters, as OpenAI reads it."""
    if parameters and parameters.get("type") != "object":
        return f'must be a JSON schema of "type": "object", got "type": {json.dumps(parameters.get("type"))}'
    return None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: Annotated[str, Field(max_length=128)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | list[TextPart] | None = None
    name: Annotated[str, Field(max_length=64)] | None = None
    tool_call_id: Annotated[str, Field(max_length=128)] | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    refusal: str | None = None  # echoed back by clients in assistant messages; ignored

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: usage in every chunk (with include_usage)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments always follow the schema when the call is forced

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = None if value is None else parameters_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema (guided decoding)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format type json_schema needs json_schema")
        return self


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Annotated[str, Field(min_length=1, max_length=256)]
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[str, Field(min_length=1, max_length=256)] | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = 1
    user: Annotated[str, Field(max_length=256)] | None = None  # accepted, ignored: the API key names the tenant
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=300)] | None = None
    # vLLM-compatible extensions
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None  # -1 or 0: no cut
    min_tokens: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    ignore_eos: bool | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    # accepted and ignored (README: "OpenAI request fields")
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` keys are token ids written as strings (OpenAI's shape)."""
        if not self.logit_bias:
            return ()
        pairs = []
        for key, value in self.logit_bias.items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            pairs.append((int(key), float(value)))
        return tuple(pairs)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    # client cache intent (retention/policy/hint_plan.py): honoured within the tenant's retention class
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # carried on the hints (CacheHints.cache_key); nothing keys on it yet, so it never crosses tenants
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    # accepted and ignored (README: "OpenAI request fields")
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None
    safety_identifier: Annotated[str, Field(max_length=256)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = {t.function.name for t in self.tools or ()}
        if len(names) != len(self.tools or ()):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_choice in ("required",) or isinstance(self.tool_choice, NamedToolChoice):
            if not names:
                raise ValueError("tool_choice requires tools")
            # with a JSON response_format too, the forced call's guide applies: the output is a call,
            # so the format has no text to shape (OpenAI takes both; openai-agents sends both)
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def cache_hints(self) -> CacheHints:
        """The request's cache intent, dialect-neutral (``CompletionJob.hints``)."""
        return CacheHints(cache_key=self.prompt_cache_key, retention=self.prompt_cache_retention)


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | Annotated[list[Annotated[str, Field(max_length=MAX_TEXT_CHARS)]], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # completions: how many alternatives
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
