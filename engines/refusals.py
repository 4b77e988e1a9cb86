"""The words every engine refuses a request with, and their readers on the gateway's side.

A refusal crosses the engine boundary as a message (Triton's error string), so the gateway
learns *what* was refused only from its wording. Each refusal therefore has one producer and
one reader here, side by side: an engine words it with the producer, the gateway reads it back
with the reader, and a test of the pair keeps them in step (a reworded producer can never
silently turn a client's 400 into an opaque ``engine_rejected``).

Invariant: ``reader(f"... {producer(...)} ...")`` returns the producer's arguments (for the
guide: its reason with xgrammar's clock and source-file prefix dropped), whatever the
engine or Triton prepends; a message no producer made reads as None.

The same channel carries the engine's own failures (an executor error, a full queue, an
engine that stopped), which are no fault of the request. So a message is a refusal only when
:func:`is_refusal` says so: one of the refusals above, or a contract validation error, which
every engine sends marked by :func:`contract_refused` (``engines/contract.py``,
``ContractError.refusal``). Any other message is the engine's failure; of those,
:func:`overloaded` reads TensorRT-LLM's full queue (retry elsewhere, the engine is healthy).
"""

from __future__ import annotations

import re

_TOO_LONG = re.compile(r"input_ids has (\d+) tokens; this model accepts at most (\d+)")
# TensorRT-LLM's own refusal, raised when the executor validates a request (LlmRequest::validate,
# cpp/tensorrt_llm/batch_manager/llmRequest.cpp: "Prompt length (%d) exceeds maximum input length (%d).
# Set log level to info ..."): its limit can be below the spec's when the executor derives it
# (trtGptModel.h: without chunked context, min(max_seq_len - 1, max_num_tokens)).
_TRTLLM_TOO_LONG = re.compile(r"Prompt length \((\d+)\) exceeds maximum input length \((\d+)\)")
_OUTPUT = re.compile(r"request_output_len must be within \[1, (\d+)\], got (-?\d+)")
# xgrammar's message may start with its clock ("[12:00:01.123] ") and its C++ source position
# ("/path/grammar_parser.cc:42: "): neither means anything to the client whose schema it is.
_GUIDE = re.compile(r"guided_decoding_guide \(\w+\) does not compile: (?:\[[\d:.]+\] )?(?:\S+:\d+: )?(.*)", re.S)


# The contract's refusal marker: stable, part of the engine-model contract (engines/contract.py).
CONTRACT_REFUSAL = "refused by the kvgate_llm contract: "
# TensorRT-LLM's executor when its request queue is full (cpp/tensorrt_llm/executor/executorImpl.cpp,
# Executor::Impl::enqueueRequests: TLLM_THROW("Maximum queue size of %d has been reached, please try
# again later", maxQueueSize)); TLLM_THROW may add its source position and a stack trace after it.
_QUEUE_FULL = re.compile(r"Maximum queue size of (\d+) has been reached")


def contract_refused(reason: object) -> str:
    """A contract validation error as an engine sends it (the marker, then the reason)."""
    return f"{CONTRACT_REFUSAL}{reason}"


def is_refusal(message: str) -> bool:
    """Whether ``message`` is the engine refusing the request (the request's fault: 400, never
    retried) rather than failing itself: a marked contract error or one of the refusals here."""
    return (CONTRACT_REFUSAL in message or context_refusal(message) is not None
            or output_refusal(message) is not None or guide_refusal(message) is not None)


def overloaded(message: str) -> int | None:
    """The queue size if ``message`` carries TensorRT-LLM's full-queue error, else None."""
    found = _QUEUE_FULL.search(message)
    return None if found is None else int(found[1])


def too_long(tokens: int, limit: int) -> str:
    """The refusal of a prompt over the model's input limit."""
    return f"input_ids has {tokens} tokens; this model accepts at most {limit}"


def context_refusal(message: str) -> tuple[int, int] | None:
    """(prompt tokens, the model's limit) if ``message`` carries :func:`too_long`'s refusal or
    TensorRT-LLM's own (the gateway learns the model's input limit from it alone), else None."""
    found = _TOO_LONG.search(message) or _TRTLLM_TOO_LONG.search(message)
    return None if found is None else (int(found[1]), int(found[2]))


def output_out_of_range(limit: int, asked: int) -> str:
    """The refusal of an output length outside ``[1, limit]``."""
    return f"request_output_len must be within [1, {limit}], got {asked}"


def output_refusal(message: str) -> tuple[int, int] | None:
    """(the engine's output limit, the length asked) if ``message`` carries
    :func:`output_out_of_range`'s refusal, else None."""
    found = _OUTPUT.search(message)
    return None if found is None else (int(found[1]), int(found[2]))


def guide_does_not_compile(kind: str, reason: object) -> str:
    """The refusal of a guided-decoding guide the engine's grammar compiler rejects."""
    return f"guided_decoding_guide ({kind}) does not compile: {reason}"


def guide_refusal(message: str) -> str | None:
    """The compiler's reason if ``message`` carries :func:`guide_does_not_compile`'s refusal, else None."""
    found = _GUIDE.search(message)
    return None if found is None else found[1].strip()
