"""An engine's failure in the client's API words (the request core's one mapping, every dialect).

A refusal is read back from the engine's message by ``engines/refusals.py`` (the only place that
knows the wording): a prompt over the input limit is OpenAI's ``context_length_exceeded`` naming
the prompt's field, an output limit or a guide the engine refuses is ``invalid_request`` naming
the client's field; anything else the engine refuses stays ``engine_rejected``. A stall or a
first-token timeout is 504 ``engine_timeout``, a call the gateway's forced shutdown ended 503
``shutting_down`` (as a request refused during the drain), engines that were all busy (their
request queue full, ``EngineOverloaded``) 503 ``engine_overloaded`` (OpenAI's 503 "The engine
is currently overloaded, please try again later"; 429 stays the tenant's own limits), any other
failure 503 ``engine_unavailable``, all with ``Retry-After``. Only a known refusal is an
``EngineRejected`` (``engines/refusals.is_refusal``): every other error an engine answers with is
its own failure, retried on another replica before landing here.
"""

from __future__ import annotations

from typing import Any, Protocol

from engines.refusals import context_refusal, guide_refusal, output_refusal
from server.gateway.errors import ServingError
from server.gateway.replicas.abort import GatewayShuttingDown
from server.gateway.replicas.engine_client import EngineOverloaded, EngineRejected, EngineTimeout
from server.gateway.replicas.stall import EngineStalled


class FailedJob(Protocol):
    """What the mapping reads of a request (``completions.CompletionJob`` has it all)."""

    kind: str  # "chat" | "text": where the prompt came from
    output_param: str  # the field that set the output limit
    format_param: str  # the field that set the guide
    guide: Any  # the guided-decoding guide, or None
    tools: Any  # the tool choice (its ``mode``), or None


__all__ = ["FailedJob", "engine_error"]

_PROMPT_FIELD = {"chat": "messages", "text": "prompt"}  # where a job's prompt came from


def engine_error(exc: Exception, job: FailedJob) -> ServingError:
    """An engine failure in the API's words; a prompt over the model's input limit is OpenAI's
    ``context_length_exceeded``, naming the prompt's field (``messages`` / ``prompt``)."""
    if isinstance(exc, EngineRejected):
        refused = context_refusal(str(exc))
        if refused is not None:
            return ServingError(400, "context_length_exceeded", f"the prompt has {refused[0]} tokens and this "
                                f"model accepts at most {refused[1]}", param=_PROMPT_FIELD.get(job.kind))
        output = output_refusal(str(exc))
        if output is not None:  # asked, or the tenant's default when the request named no limit
            return ServingError(400, "invalid_request", f"{job.output_param}: this model answers at most "
                                f"{output[0]} tokens per request; {output[1]} were asked (without "
                                f"{job.output_param}, the tenant's output limit)", param=job.output_param)
        guide = guide_refusal(str(exc)) if job.guide is not None else None
        if guide is not None:  # the client's schema, not the engine's fault: name the field it came from
            field = "tools" if job.tools is not None and job.tools.mode == "forced" else job.format_param
            return ServingError(400, "invalid_request", f"{field}: the JSON schema cannot be compiled for guided "
                                f"decoding: {guide}", param=field)
        return ServingError(400, "engine_rejected", f"the engine refused the request: {exc}")
    if isinstance(exc, GatewayShuttingDown):  # a drain that ran out of time (replicas/abort.py)
        return ServingError(503, "shutting_down", "this gateway is shutting down; retry on another replica",
                            headers={"Retry-After": "1", "Connection": "close"})
    if isinstance(exc, EngineStalled):
        return ServingError(504, "engine_timeout", f"the model's engine stopped answering mid-answer (nothing for "
                            f"{exc.waited:g} s); retry shortly", headers={"Retry-After": "1"})
    if isinstance(exc, EngineTimeout):
        return ServingError(504, "engine_timeout", "no replica of the model's engine started answering in time; "
                            "retry shortly", headers={"Retry-After": "1"})
    if isinstance(exc, EngineOverloaded):
        return ServingError(503, "engine_overloaded", "the model's engine is overloaded (its request queue is "
                            "full); retry shortly", headers={"Retry-After": "1"})
    return ServingError(503, "engine_unavailable", "the model's engine is unavailable; retry shortly",
                        headers={"Retry-After": "1"})
