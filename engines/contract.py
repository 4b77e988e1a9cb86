"""The one engine-model contract (DESIGN §3), shared by every implementation.

Both the Triton Python-backend model around TensorRT-LLM 1.2 and the CPU reference
engine import this module for tensor names, dtypes and request validation, so the
gateway cannot tell them apart (the output tensors and their encoding, ``encode_response``
and ``decode_log_probs``, are in ``engines/response_tensors.py``; the values they carry,
:class:`KvMetrics` and :class:`TokenLogProbs`, are here). Names follow the stock
tensorrtllm backend where one exists (triton-inference-server/tensorrtllm_backend
``all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt``: ``input_ids``,
``request_output_len``, ``end_id``, ``streaming``, ``temperature``, ``runtime_top_p``,
``runtime_top_k``, ``stop``, ``output_ids``, ``sequence_length``,
``kv_cache_reused_blocks``, ``kv_cache_alloc_new_blocks``,
``kv_cache_alloc_total_blocks``); the ``retention_*`` names mirror
``KvCacheRetentionConfig``; ``cache_salt``, ``tenant_id``,
``kv_cache_onboarded_blocks`` and the stats call are kvgate additions. ``random_seed`` does not
follow the stock name: the 1.2-era backend calls that input ``seed`` (inflight_batcher_llm/src/utils.h,
config.pbtxt); kvgate keeps ``random_seed``.

Per-request KV figures mean the same on both engines: ``kv_cache_reused_blocks`` prompt blocks
served from the cache, ``kv_cache_alloc_new_blocks`` prompt blocks that missed it and were
computed (TensorRT-LLM's ``KvCacheMetrics.num_missed_blocks``: its ``num_new_allocated_blocks``
counts slots that never held tokens, about none on a warm pool, ``getFreeBlock`` in
kvCacheManager.cpp), ``kv_cache_alloc_total_blocks`` the blocks taken from the free pool for the
prompt when the request was admitted: its misses, plus the reused blocks that had to be brought to
the GPU (onboarded from host memory; on TensorRT-LLM also a partly matched block copied into a fresh
one), never a reused block already on the GPU and never a generation block (TensorRT-LLM's
``num_total_allocated_blocks``: ``++mAllocTotalBlocks`` only in ``getFreeBlock``, counted per request
around ``KVCacheManager::addSequence``, kvCacheManager.cpp; KVCacheManagerTest expects
``numBlocks - numSharedBlocks`` for a second identical request); the reference engine counts it the
same way (misses + onboards; it has no partial reuse). All four figures add up over the request's
admissions (``LlmRequest::update*PerRequest`` use ``+=``, cpp/include/tensorrt_llm/batch_manager/
llmRequest.h): a request preempted and re-admitted (``max_utilization`` only) reports the lookups of
both. The gateway compares the total only between responses. ``kv_cache_onboarded_blocks`` reused
prompt blocks that came back from the host tier (the Triton model derives it as total − new, capped
at reused). So reused / (reused + new) is the prompt's
block hit rate.

Sampling extensions, log probabilities and guided decoding use the stock names
of TensorRT-LLM's ``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt``
(NVIDIA/TensorRT-LLM 0c8de69a): ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty`` (FP32), ``min_tokens`` (INT32), ``return_log_probs`` (BOOL),
``guided_decoding_guide_type`` / ``guided_decoding_guide`` (STRING = BYTES) and the output
``output_log_probs`` (FP32). The guide types are the stock Python model's mapping
(``tensorrt_llm/1/model.py`` ``get_guided_decoding_params_from_request``: ``json``,
``json_schema``, ``regex``, ``ebnf_grammar``). kvgate additions, because the stock model
has no input for them: ``ignore_eos`` (the LLM API's ``SamplingParams.ignore_eos``, which
``tensorrt_llm/executor/base_worker.py`` turns into ``end_id=-1``), ``num_top_log_probs``
with the outputs ``top_log_probs`` / ``top_log_probs_token_ids`` (OpenAI ``top_logprobs``),
and a sparse logit bias ``logit_bias_token_ids`` / ``logit_bias_values`` (the stock
``embedding_bias`` is a dense vocabulary-sized tensor: ~200 KB per request for SmolLM2,
~500 KB for Llama 3 in FP32; the Triton model densifies the sparse form into the executor's
``Request.embedding_bias``, ``[1, vocab_size]`` in the engine's logits dtype).

Sampling semantics (both implementations; the GPU engine is the product, so the order and
the counting are TensorRT-LLM's, ``cpp/tensorrt_llm/kernels/penaltyKernels.cu``
``batchApplyPenalty``; the reference sampler is tested against a re-implementation of it).
A step's logits are processed in this order:

1. the guide's mask (tokens the grammar forbids → -inf) — before everything else, so it
   commutes with the rest;
2. ``+`` the logit bias;
3. ``/`` temperature — only when sampling (temperature 0 is greedy and divides by nothing);
4. for every token that occurs in the prompt **or** the output so far (occurrences counted
   over both): ``repetition_penalty`` (> 0, 1 = off) divides a positive / multiplies a
   negative logit, then ``presence_penalty`` subtracts a constant, then
   ``frequency_penalty`` subtracts ``value × occurrences``;
5. ``min_tokens``: the end token is masked while fewer than ``min_tokens`` were generated.

Where that differs from OpenAI's wording: OpenAI applies presence/frequency penalties to
tokens "that appear in the text so far" of the *completion* and before temperature; here
prompt tokens count too and the penalties are subtracted from temperature-scaled logits.
``presence_penalty`` / ``frequency_penalty`` are OpenAI's range, [-2, 2].
``ignore_eos`` never ends a request on an end token (it runs to ``request_output_len`` or
``stop``); with a guide it is refused (``ignore_eos`` + ``guided_decoding_guide_type``: the
GPU engine would never end a completed guide, see :func:`check_combinations`).

Log probabilities (``output_log_probs``, ``top_log_probs``) are of that *processed*
distribution: ``log_softmax`` over the whole vocabulary of the logits after steps 1-5,
before any top-k / top-p cut and never renormalised within it (what TensorRT-LLM returns
with ``ExecutorConfig(normalize_log_probs=False)``: ``samplingTopKKernels.cu``
``topKStage2Sampling``, "NOT normalized (same way as OpenAI does)"; the top-p kernel,
``samplingTopPKernels.cu`` ``epilogue``, always writes that unnormalised value); the Triton model sets
it because the 1.2 binding's default is true, which reports log P within the top-k set —
0.0 for every greedy token). A greedy request's log probabilities are therefore those of
the model after bias and penalties; with no extension they are the model's own. The top
alternatives (``num_top_log_probs``, reference engine only) are the most likely tokens of
the same distribution, descending.

Shapes: the model is configured with ``max_batch_size: 0``, so tensors carry exactly
the shapes below. Only the reference engine (which calls :func:`parse_request` on
whatever it is sent) accepts and squeezes a leading batch dimension of 1, as sent by
clients written for the stock backend; Triton checks each input's rank against
config.pbtxt (``dims: [ -1 ]``) and rejects a ``[1, N]`` tensor before ``model.py`` runs.

Stats side channel: a request whose ``kv_stats`` input is true (and that carries no
``input_ids``) gets one response with ``kv_cache_stats``: BYTES[1], the JSON of
:class:`engines.pool_stats.PoolStatsReport`. With ``kv_events_since`` (UINT64[1], a cursor; 0 = from
scratch) the report also carries ``kv_events``: the replica's KV events in kvgate's
block-hash space since that cursor, or a snapshot of its cached hashes when the cursor
is too old (``engines/kv_events.py``). Replicas that cannot report events answer with
``kv_events.supported`` false. Without the input, no events are reported.

Responses (both implementations, streaming or not):

* ``streaming`` true: every response carries only the tokens generated since the
  previous response in ``output_ids`` (a delta, as the stock backend streams), plus the
  request's KV metrics; the last response has the parameter ``triton_final_response``
  true and may carry zero tokens. ``streaming`` false: one response with every generated
  token, and on ``ModelStreamInfer`` exactly one message per request however it ends
  (answer, error, ``stop``): the gateway calls such requests as unary
  (``server/gateway/replicas/engine_client.py``; tested for the reference engine and the
  Triton model, read at source for TensorRT-LLM and Triton).
* ``sequence_length`` is the number of tokens generated so far (cumulative).
* The end token (``end_id``) is never included in ``output_ids``; a request that ends
  with fewer than ``request_output_len`` tokens stopped on ``end_id`` (or ``stop``),
  otherwise it hit its length limit.
* A client that half-closes its stream after sending the request still receives every
  response; a client that cancels the call cancels the request and frees its blocks.

Errors (both implementations): a request the contract refuses (a :class:`ContractError`,
or an extension this engine does not support) is answered with an error whose text carries
``ContractError.refusal``: the marker ``refused by the kvgate_llm contract: ``
(``engines/refusals.py``, ``CONTRACT_REFUSAL``) before the reason. That marker, or one of the
refusals of ``engines/refusals.py`` (prompt or output too long, a guide that does not compile),
is what makes an error the request's fault: the gateway answers it 400 and never retries it.
Any other error text is the engine's own failure (an executor error, a full queue, an engine
that stopped): the gateway retries it on another replica and counts it against the replica.

Invariant: :func:`parse_request` either returns a fully valid :class:`EngineRequest`
or raises :class:`ContractError` naming the tensor at fault; it never lets a bad
request reach a scheduler.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from engines.refusals import contract_refused, output_out_of_range, too_long
from retention.types import (
    DEFAULT_PRIORITY,
    RetentionPlan,
    RetentionPlanError,
    TokenRange,
)

MODEL_NAME = "kvgate_llm"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str  # KServe v2 / Triton datatype name
    shape: tuple[int, ...]
    optional: bool = True


# Inputs ---------------------------------------------------------------------------------
INPUT_IDS = TensorSpec("input_ids", "INT32", (-1,), optional=False)
REQUEST_OUTPUT_LEN = TensorSpec("request_output_len", "INT32", (1,), optional=False)
END_ID = TensorSpec("end_id", "INT32", (1,))
STREAMING = TensorSpec("streaming", "BOOL", (1,))
TEMPERATURE = TensorSpec("temperature", "FP32", (1,))
TOP_P = TensorSpec("runtime_top_p", "FP32", (1,))
_FP32_TINY = float(np.finfo(np.float32).tiny)
TOP_K = TensorSpec("runtime_top_k", "INT32", (1,))
RANDOM_SEED = TensorSpec("random_seed", "UINT64", (1,))
STOP = TensorSpec("stop", "BOOL", (1,))
RANGE_STARTS = TensorSpec("retention_token_range_starts", "INT32", (-1,))
RANGE_ENDS = TensorSpec("retention_token_range_ends", "INT32", (-1,))
RANGE_PRIORITIES = TensorSpec("retention_token_range_priorities", "INT32", (-1,))
RANGE_DURATIONS = TensorSpec("retention_token_range_durations_ms", "INT32", (-1,))
DECODE_PRIORITY = TensorSpec("retention_decode_priority", "INT32", (1,))
DECODE_DURATION = TensorSpec("retention_decode_duration_ms", "INT32", (1,))
CACHE_SALT = TensorSpec("cache_salt", "BYTES", (1,))
TENANT_ID = TensorSpec("tenant_id", "BYTES", (1,))
KV_STATS = TensorSpec("kv_stats", "BOOL", (1,))
# Sampling extensions (stock names, see the module docstring) and kvgate additions.
REPETITION_PENALTY = TensorSpec("repetition_penalty", "FP32", (1,))
PRESENCE_PENALTY = TensorSpec("presence_penalty", "FP32", (1,))
FREQUENCY_PENALTY = TensorSpec("frequency_penalty", "FP32", (1,))
MIN_TOKENS = TensorSpec("min_tokens", "INT32", (1,))
IGNORE_EOS = TensorSpec("ignore_eos", "BOOL", (1,))  # kvgate
RETURN_LOG_PROBS = TensorSpec("return_log_probs", "BOOL", (1,))
NUM_TOP_LOG_PROBS = TensorSpec("num_top_log_probs", "INT32", (1,))  # kvgate
LOGIT_BIAS_IDS = TensorSpec("logit_bias_token_ids", "INT32", (-1,))  # kvgate (sparse embedding_bias)
LOGIT_BIAS_VALUES = TensorSpec("logit_bias_values", "FP32", (-1,))  # kvgate
GUIDE_TYPE = TensorSpec("guided_decoding_guide_type", "BYTES", (1,))
GUIDE = TensorSpec("guided_decoding_guide", "BYTES", (1,))
KV_EVENTS_SINCE = TensorSpec("kv_events_since", "UINT64", (1,))

INPUTS: tuple[TensorSpec, ...] = (
    INPUT_IDS, REQUEST_OUTPUT_LEN, END_ID, STREAMING, TEMPERATURE, TOP_P, TOP_K, RANDOM_SEED,
    STOP, RANGE_STARTS, RANGE_ENDS, RANGE_PRIORITIES, RANGE_DURATIONS, DECODE_PRIORITY,
    DECODE_DURATION, CACHE_SALT, TENANT_ID, KV_STATS, KV_EVENTS_SINCE,
    REPETITION_PENALTY, PRESENCE_PENALTY, FREQUENCY_PENALTY, MIN_TOKENS, IGNORE_EOS, RETURN_LOG_PROBS,
    NUM_TOP_LOG_PROBS, LOGIT_BIAS_IDS, LOGIT_BIAS_VALUES, GUIDE_TYPE, GUIDE,
)
# input_ids / request_output_len are required for generation but not for the stats call,
# so the Triton config marks every input optional and parse_request enforces the rest.

NUMPY_DTYPES: dict[str, type] = {
    "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_, "BYTES": np.object_,
}

MAX_SALT_BYTES = 256
MAX_TENANT_ID_BYTES = 128
MAX_TOP_LOG_PROBS = 20  # OpenAI's top_logprobs limit
MAX_LOGIT_BIAS = 300  # OpenAI's logit_bias limit (entries)
MAX_GUIDE_BYTES = 256 * 1024
MAX_GUIDE_DEPTH = 64  # nesting of a JSON-schema guide (grammar compilers recurse on it)
# TensorRT-LLM's largest top-k (cpp/tensorrt_llm/kernels/samplingTopKKernels.h TOP_K_MAX); its sampling
# layers clamp a larger runtime top-k to it (clampTopK: "TopK (%d) is larger than max supported number").
TOP_K_MAX = 1024
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")


class ContractError(ValueError):
    """A request violates the model contract; ``tensor`` names the input at fault."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor

    @property
    def refusal(self) -> str:
        """The error text an engine answers with: the contract's refusal marker, then the message
        (the gateway reads the marker as "the request's fault", see the module's Errors)."""
        return contract_refused(self)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class Guide:
    """Guided decoding: the output must match ``text`` read as ``kind`` (one of GUIDE_TYPES).

    ``json`` with empty text: any JSON value (TensorRT-LLM's ``GuideType.JSON`` with no guide);
    ``json`` with a text: that schema (sent to TensorRT-LLM as ``GuideType.JSON_SCHEMA``).
    """

    kind: str
    text: str = ""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A validated generation request, independent of the transport."""

    input_ids: tuple[int, ...]
    max_new_tokens: int
    end_id: int | None
    streaming: bool
    sampling: SamplingParams
    retention: RetentionPlan
    cache_salt: str | None
    tenant_id: str | None
    stop: bool = False
    ignore_eos: bool = False
    return_log_probs: bool = False
    num_top_log_probs: int = 0  # only with return_log_probs
    guide: Guide | None = None


# Parsing --------------------------------------------------------------------------------
def _as_1d(name: str, value: np.ndarray) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 0:
        array = array.reshape(1)
    if array.ndim != 1:
        raise ContractError(f"{name} must be 1-D, got shape {list(np.shape(value))}", tensor=name)
    return array


def _scalar(tensors: Mapping[str, np.ndarray], spec: TensorSpec, default):
    if spec.name not in tensors:
        return default
    array = _as_1d(spec.name, tensors[spec.name])
    if array.shape[0] != 1:
        raise ContractError(f"{spec.name} must hold exactly one value, got {array.shape[0]}", tensor=spec.name)
    return array[0]


def _int_array(tensors: Mapping[str, np.ndarray], name: str) -> np.ndarray | None:
    if name not in tensors:
        return None
    array = _as_1d(name, tensors[name])
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ContractError(f"{name} must be an integer tensor, got {array.dtype}", tensor=name)
    return array.astype(np.int64)


def _text(tensors: Mapping[str, np.ndarray], spec: TensorSpec, limit: int) -> str | None:
    raw = _scalar(tensors, spec, None)
    if raw is None:
        return None
    if isinstance(raw, (bytes, bytearray, np.bytes_)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ContractError(f"{spec.name} is not valid UTF-8", tensor=spec.name) from exc
    text = str(raw)
    if len(text.encode("utf-8")) > limit:
        raise ContractError(f"{spec.name} is longer than {limit} bytes", tensor=spec.name)
    return text or None


def is_stats_request(tensors: Mapping[str, np.ndarray]) -> bool:
    return bool(_scalar(tensors, KV_STATS, False))


def kv_events_cursor(tensors: Mapping[str, np.ndarray]) -> int | None:
    """The stats request's ``kv_events_since`` cursor, or None when events were not asked for."""
    raw = _scalar(tensors, KV_EVENTS_SINCE, None)
    if raw is None:
        return None
    if not np.issubdtype(np.asarray(raw).dtype, np.integer) or int(raw) < 0:
        raise ContractError("kv_events_since must be a non-negative integer", tensor=KV_EVENTS_SINCE.name)
    return int(raw)


def parse_retention(tensors: Mapping[str, np.ndarray], num_prompt_tokens: int) -> RetentionPlan:
    """Build the request's :class:`RetentionPlan` from the ``retention_*`` tensors.

    The four range arrays must have equal lengths (durations may be absent: no
    expiry); ``-1`` in ends means open-ended, ``-1`` in durations means no expiry.
    Ranges must lie within the prompt (TensorRT-LLM applies them to prompt tokens only).
    """
    starts = _int_array(tensors, RANGE_STARTS.name)
    ends = _int_array(tensors, RANGE_ENDS.name)
    priorities = _int_array(tensors, RANGE_PRIORITIES.name)
    durations = _int_array(tensors, RANGE_DURATIONS.name)
    present = [a for a in (starts, ends, priorities) if a is not None]
    ranges: list[TokenRange] = []
    if present:
        if len(present) != 3:
            raise ContractError(
                "retention_token_range_starts, _ends and _priorities must be sent together",
                tensor=RANGE_STARTS.name,
            )
        count = starts.shape[0]  # type: ignore[union-attr]
        lengths = {RANGE_STARTS.name: count, RANGE_ENDS.name: ends.shape[0], RANGE_PRIORITIES.name: priorities.shape[0]}  # type: ignore[union-attr]
        if durations is not None:
            lengths[RANGE_DURATIONS.name] = durations.shape[0]
        if len(set(lengths.values())) != 1:
            detail = ", ".join(f"{k}={v}" for k, v in lengths.items())
            raise ContractError(f"retention range arrays have unequal lengths ({detail})", tensor=RANGE_ENDS.name)
        for i in range(count):
            start, end, priority = int(starts[i]), int(ends[i]), int(priorities[i])  # type: ignore[index]
            duration = None if durations is None or int(durations[i]) == -1 else int(durations[i])
            if start >= num_prompt_tokens:
                raise ContractError(
                    f"retention range {i} starts at {start}, beyond the {num_prompt_tokens}-token prompt",
                    tensor=RANGE_STARTS.name,
                )
            try:
                ranges.append(TokenRange(start, None if end == -1 else end, priority, duration))
            except RetentionPlanError as exc:
                raise ContractError(f"retention range {i}: {exc}", tensor=_range_tensor(exc.field)) from exc
    decode_priority = int(_scalar(tensors, DECODE_PRIORITY, DEFAULT_PRIORITY))
    raw_decode_duration = _scalar(tensors, DECODE_DURATION, -1)
    decode_duration = None if int(raw_decode_duration) == -1 else int(raw_decode_duration)
    try:
        return RetentionPlan(tuple(ranges), decode_priority, decode_duration)
    except RetentionPlanError as exc:
        name = {"decode_priority": DECODE_PRIORITY.name, "decode_duration_ms": DECODE_DURATION.name}.get(
            exc.field or "", RANGE_STARTS.name
        )
        raise ContractError(str(exc), tensor=name) from exc


def _range_tensor(field_name: str | None) -> str:
    return {
        "start": RANGE_STARTS.name, "end": RANGE_ENDS.name, "priority": RANGE_PRIORITIES.name,
        "duration_ms": RANGE_DURATIONS.name,
    }.get(field_name or "", RANGE_STARTS.name)


def parse_request(
    tensors: Mapping[str, np.ndarray], *, max_output_len: int, max_input_len: int, vocab_size: int
) -> EngineRequest:
    """Validate raw input tensors (name -> numpy array) into an :class:`EngineRequest`."""
    if INPUT_IDS.name not in tensors:
        raise ContractError("input_ids is required", tensor=INPUT_IDS.name)
    ids = _int_array(tensors, INPUT_IDS.name)
    assert ids is not None
    if ids.size == 0:
        raise ContractError("input_ids must not be empty", tensor=INPUT_IDS.name)
    if ids.size > max_input_len:
        raise ContractError(too_long(ids.size, max_input_len), tensor=INPUT_IDS.name)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ContractError(f"input_ids must be token ids in [0, {vocab_size})", tensor=INPUT_IDS.name)
    if REQUEST_OUTPUT_LEN.name not in tensors:
        raise ContractError("request_output_len is required", tensor=REQUEST_OUTPUT_LEN.name)
    max_new = int(_scalar(tensors, REQUEST_OUTPUT_LEN, 0))
    if not 1 <= max_new <= max_output_len:
        raise ContractError(output_out_of_range(max_output_len, max_new), tensor=REQUEST_OUTPUT_LEN.name)
    end_raw = _scalar(tensors, END_ID, None)
    end_id = None if end_raw is None or int(end_raw) < 0 else int(end_raw)
    if end_id is not None and end_id >= vocab_size:
        # The min-length mask writes logits[end_id] (unguarded in penaltyKernels.cu) and a guide's
        # matcher takes it as its stop token: an id outside the vocabulary is refused up front.
        raise ContractError(f"end_id must be a token id in [0, {vocab_size}) or -1 (none), got {end_id}",
                            tensor=END_ID.name)
    temperature = float(_scalar(tensors, TEMPERATURE, 0.0))
    top_p = float(_scalar(tensors, TOP_P, 1.0))
    top_k = int(_scalar(tensors, TOP_K, 0))
    if not (np.isfinite(temperature) and temperature >= 0.0):
        raise ContractError(f"temperature must be finite and >= 0, got {temperature}", tensor=TEMPERATURE.name)
    if not (0.0 < top_p <= 1.0):
        raise ContractError(f"runtime_top_p must be within (0, 1], got {top_p}", tensor=TOP_P.name)
    if top_k < 0:
        raise ContractError(f"runtime_top_k must be >= 0, got {top_k}", tensor=TOP_K.name)
    top_k = min(top_k, TOP_K_MAX)  # what TensorRT-LLM samples with (clampTopK), so every engine cuts the same
    if top_k >= vocab_size:
        top_k = 0  # a cut at or above the vocabulary is no cut
    seed_raw = _scalar(tensors, RANDOM_SEED, None)
    repetition = _finite(tensors, REPETITION_PENALTY, 1.0)
    if repetition <= 0.0:
        raise ContractError(f"repetition_penalty must be > 0, got {repetition}", tensor=REPETITION_PENALTY.name)
    presence = _finite(tensors, PRESENCE_PENALTY, 0.0)
    frequency = _finite(tensors, FREQUENCY_PENALTY, 0.0)
    for spec, value in ((PRESENCE_PENALTY, presence), (FREQUENCY_PENALTY, frequency)):
        if not -2.0 <= value <= 2.0:
            raise ContractError(f"{spec.name} must be within [-2, 2], got {value}", tensor=spec.name)
    min_tokens = int(_scalar(tensors, MIN_TOKENS, 0))
    if not 0 <= min_tokens <= max_new:
        raise ContractError(
            f"min_tokens must be within [0, request_output_len={max_new}], got {min_tokens}", tensor=MIN_TOKENS.name
        )
    return_log_probs = bool(_scalar(tensors, RETURN_LOG_PROBS, False))
    num_top = int(_scalar(tensors, NUM_TOP_LOG_PROBS, 0))
    if not 0 <= num_top <= MAX_TOP_LOG_PROBS:
        raise ContractError(f"num_top_log_probs must be within [0, {MAX_TOP_LOG_PROBS}], got {num_top}",
                            tensor=NUM_TOP_LOG_PROBS.name)
    if num_top and not return_log_probs:
        raise ContractError("num_top_log_probs needs return_log_probs true", tensor=NUM_TOP_LOG_PROBS.name)
    sampling = SamplingParams(
        temperature, top_p, top_k, None if seed_raw is None else int(seed_raw),
        repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
        min_tokens=min_tokens, logit_bias=parse_logit_bias(tensors, vocab_size),
    )
    request = EngineRequest(
        input_ids=tuple(int(t) for t in ids),
        max_new_tokens=max_new,
        end_id=end_id,
        streaming=bool(_scalar(tensors, STREAMING, False)),
        sampling=sampling,
        retention=parse_retention(tensors, int(ids.size)),
        cache_salt=_text(tensors, CACHE_SALT, MAX_SALT_BYTES),
        tenant_id=_text(tensors, TENANT_ID, MAX_TENANT_ID_BYTES),
        stop=bool(_scalar(tensors, STOP, False)),
        ignore_eos=bool(_scalar(tensors, IGNORE_EOS, False)),
        return_log_probs=return_log_probs,
        num_top_log_probs=num_top,
        guide=parse_guide(tensors),
    )
    check_combinations(request)
    return request


def check_combinations(request: EngineRequest) -> None:
    """Refuse field combinations no implementation can honour the same way (both engines call it).

    ``ignore_eos`` with a guide: TensorRT-LLM's guided decoder only narrows the allowed tokens
    to the stop tokens once the grammar completes (``GuidedDecodingConfig(stop_token_ids=)``,
    xgrammar's matcher), and with ``end_id=-1`` (how ``ignore_eos`` is sent) no stop token ends
    the request: it would run to ``request_output_len``. Refused on every engine so the
    contract stays one.
    """
    if request.ignore_eos and request.guide is not None:
        raise ContractError(
            "ignore_eos cannot be combined with guided_decoding_guide_type (a guided request ends when its "
            "grammar completes, which ignore_eos would prevent)", tensor=IGNORE_EOS.name,
        )


def _finite(tensors: Mapping[str, np.ndarray], spec: TensorSpec, default: float) -> float:
    value = float(_scalar(tensors, spec, default))
    if not np.isfinite(value):
        raise ContractError(f"{spec.name} must be finite, got {value}", tensor=spec.name)
    return value


def parse_logit_bias(tensors: Mapping[str, np.ndarray], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``(token id, bias)`` pairs from the two sparse tensors (sent together, equal lengths, unique ids)."""
    ids = _int_array(tensors, LOGIT_BIAS_IDS.name)
    has_values = LOGIT_BIAS_VALUES.name in tensors
    if ids is None and not has_values:
        return ()
    if ids is None or not has_values:
        raise ContractError("logit_bias_token_ids and logit_bias_values must be sent together", tensor=LOGIT_BIAS_IDS.name)
    values = _as_1d(LOGIT_BIAS_VALUES.name, tensors[LOGIT_BIAS_VALUES.name]).astype(np.float64)
    if values.shape[0] != ids.shape[0]:
        raise ContractError(f"logit_bias_values has {values.shape[0]} entries for {ids.shape[0]} token ids",
                            tensor=LOGIT_BIAS_VALUES.name)
    if ids.shape[0] > MAX_LOGIT_BIAS:
        raise ContractError(f"logit_bias_token_ids has {ids.shape[0]} entries; at most {MAX_LOGIT_BIAS}",
                            tensor=LOGIT_BIAS_IDS.name)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ContractError(f"logit_bias_token_ids must be token ids in [0, {vocab_size})", tensor=LOGIT_BIAS_IDS.name)
    if len(set(ids.tolist())) != ids.shape[0]:
        raise ContractError("logit_bias_token_ids must not repeat a token id", tensor=LOGIT_BIAS_IDS.name)
    if not np.all(np.isfinite(values)) or np.any(np.abs(values) > 100.0):
        raise ContractError("logit_bias_values must be finite and within [-100, 100]", tensor=LOGIT_BIAS_VALUES.name)
    return tuple((int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist()))


def json_depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (iterative: safe on any input json.loads returned)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def parse_guide(tensors: Mapping[str, np.ndarray]) -> Guide | None:
    """The request's guide; the type is required, the text is required except for ``json``.

    Only the form is checked here; whether the schema/grammar/regex compiles is the
    implementation's check (it answers with a ContractError naming ``guided_decoding_guide``).
    """
    kind = _text(tensors, GUIDE_TYPE, 64)
    text = _text(tensors, GUIDE, MAX_GUIDE_BYTES)
    if kind is None:
        if text is not None:
            raise ContractError("guided_decoding_guide needs guided_decoding_guide_type", tensor=GUIDE_TYPE.name)
        return None
    if kind not in GUIDE_TYPES:
        raise ContractError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}; got {kind!r}",
                            tensor=GUIDE_TYPE.name)
    if text is None and kind != "json":
        raise ContractError(f"guided_decoding_guide is required for guide type {kind!r}", tensor=GUIDE.name)
    if kind == "json_schema" or (kind == "json" and text):
        try:
            schema = json.loads(text or "")
        except (ValueError, RecursionError) as exc:
            raise ContractError(f"guided_decoding_guide is not valid JSON: {exc}", tensor=GUIDE.name) from exc
        if not isinstance(schema, (dict, bool)):
            raise ContractError("guided_decoding_guide must be a JSON schema object", tensor=GUIDE.name)
        if json_depth(schema) > MAX_GUIDE_DEPTH:
            raise ContractError(f"guided_decoding_guide nests deeper than {MAX_GUIDE_DEPTH} levels", tensor=GUIDE.name)
    return Guide(kind, text or "")


# Encoding (what a client sends) ----------------------------------------------------------
def encode_retention(plan: RetentionPlan) -> dict[str, np.ndarray]:
    """The ``retention_*`` tensors for ``plan`` (inverse of :func:`parse_retention`)."""
    tensors = {
        DECODE_PRIORITY.name: np.array([plan.decode_priority], np.int32),
        DECODE_DURATION.name: np.array([-1 if plan.decode_duration_ms is None else plan.decode_duration_ms], np.int32),
    }
    if plan.ranges:
        tensors[RANGE_STARTS.name] = np.array([r.start for r in plan.ranges], np.int32)
        tensors[RANGE_ENDS.name] = np.array([-1 if r.end is None else r.end for r in plan.ranges], np.int32)
        tensors[RANGE_PRIORITIES.name] = np.array([r.priority for r in plan.ranges], np.int32)
        tensors[RANGE_DURATIONS.name] = np.array(
            [-1 if r.duration_ms is None else r.duration_ms for r in plan.ranges], np.int32
        )
    return tensors


def encode_request(request: EngineRequest) -> dict[str, np.ndarray]:
    """All input tensors for ``request`` (inverse of :func:`parse_request`)."""
    tensors: dict[str, np.ndarray] = {
        INPUT_IDS.name: np.array(request.input_ids, np.int32),
        REQUEST_OUTPUT_LEN.name: np.array([request.max_new_tokens], np.int32),
        END_ID.name: np.array([-1 if request.end_id is None else request.end_id], np.int32),
        STREAMING.name: np.array([request.streaming], np.bool_),
        TEMPERATURE.name: np.array([request.sampling.temperature], np.float32),
        # a top_p under float32's range would round to 0.0, which the contract refuses: send the smallest
        # float32 instead (the same nucleus: the most likely token alone)
        TOP_P.name: np.array([max(request.sampling.top_p, _FP32_TINY)], np.float32),
        TOP_K.name: np.array([request.sampling.top_k], np.int32),
        STOP.name: np.array([request.stop], np.bool_),
    }
    if request.sampling.seed is not None:
        tensors[RANDOM_SEED.name] = np.array([request.sampling.seed], np.uint64)
    s = request.sampling
    # Extensions only when they differ from the default: the common request stays small.
    if s.repetition_penalty != 1.0:
        tensors[REPETITION_PENALTY.name] = np.array([s.repetition_penalty], np.float32)
    if s.presence_penalty != 0.0:
        tensors[PRESENCE_PENALTY.name] = np.array([s.presence_penalty], np.float32)
    if s.frequency_penalty != 0.0:
        tensors[FREQUENCY_PENALTY.name] = np.array([s.frequency_penalty], np.float32)
    if s.min_tokens:
        tensors[MIN_TOKENS.name] = np.array([s.min_tokens], np.int32)
    if s.logit_bias:
        tensors[LOGIT_BIAS_IDS.name] = np.array([t for t, _ in s.logit_bias], np.int32)
        tensors[LOGIT_BIAS_VALUES.name] = np.array([v for _, v in s.logit_bias], np.float32)
    if request.ignore_eos:
        tensors[IGNORE_EOS.name] = np.array([True], np.bool_)
    if request.return_log_probs:
        tensors[RETURN_LOG_PROBS.name] = np.array([True], np.bool_)
        if request.num_top_log_probs:
            tensors[NUM_TOP_LOG_PROBS.name] = np.array([request.num_top_log_probs], np.int32)
    if request.guide is not None:
        tensors[GUIDE_TYPE.name] = np.array([request.guide.kind.encode()], np.object_)
        if request.guide.text:
            tensors[GUIDE.name] = np.array([request.guide.text.encode()], np.object_)
    if request.cache_salt is not None:
        tensors[CACHE_SALT.name] = np.array([request.cache_salt.encode()], np.object_)
    if request.tenant_id is not None:
        tensors[TENANT_ID.name] = np.array([request.tenant_id.encode()], np.object_)
    tensors.update(encode_retention(request.retention))
    return tensors


@dataclass(frozen=True, slots=True)
class KvMetrics:
    """Per-request KV metrics reported with every response."""

    reused_blocks: int = 0
    new_blocks: int = 0
    total_blocks: int = 0
    onboarded_blocks: int = 0


def cached_prompt_tokens(reused_blocks: int, prompt_tokens: int, tokens_per_block: int) -> int:
    """Prompt tokens served from the KV cache, from a response's ``kv_cache_reused_blocks``.

    ``reused_blocks × tokens_per_block``, at most ``prompt_tokens − 1``: the engine always computes
    the last prompt token (matching stops one token short, ``WindowBlockManager::loadOrAllocateBlocks``).
    The cap also bounds TensorRT-LLM's partial reuse (``enable_partial_reuse``): a block matched in
    part counts as reused (``++mReusedBlocks``) though only its matched tokens are; when the match
    ends inside the prompt's last block the cap makes the count exact, when it ends inside an earlier
    block the count is over by fewer than ``tokens_per_block`` tokens (the executor reports no token
    count to make it exact; the reference engine reuses whole blocks only).
    """
    return max(0, min(prompt_tokens - 1, reused_blocks * tokens_per_block))


@dataclass(frozen=True, slots=True)
class TokenLogProbs:
    """Log probabilities of one generated token (see the module docstring for their meaning)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
