"""The gateway's client for one pool's engine model (Triton or the reference engine).

Speaks KServe v2 gRPC and nothing else, so the same code drives TensorRT-LLM behind
Triton and the CPU reference engine: streaming generation over grpclib (HTTP/2 on the
event loop, ``engine_stream.py``: less CPU per streamed token), everything else through
``tritonclient.grpc.aio``. One channel of each per replica, reused by every request;
grpc.aio's reconnect backoff is capped at one second and grpclib reconnects at once, so
that the first request after an engine restart succeeds (gRPC's default backoff grows to
120 s).

Invariants: :meth:`EngineClient.generate` yields chunks until the engine's final
response and then stops; if the consumer stops early (client gone, stop string hit),
closing the generator cancels the gRPC call (RST_STREAM), which the engine treats as a
cancel and frees the request's blocks; so does cancelling a task awaiting the next chunk
(the router's first-token deadline): the ``CancelledError`` runs the same ``finally``.
Transport failures surface as :class:`EngineUnavailable`, engine-side refusals as
:class:`EngineRejected`; nothing else escapes. An error the engine answers with (a stream's
``error_message``) is a refusal only when ``engines/refusals.is_refusal`` reads it as one (the
contract's marked validation errors, the prompt / output / guide refusals): the same channel
carries the engine's own failures (an executor error, an engine that stopped), which are
:class:`EngineFailed` (unavailable), and TensorRT-LLM's full queue, :class:`EngineOverloaded`
(:func:`answered_error`).

A non-streaming request gets exactly one engine message (its final answer, or its error),
so it is called as unary-unary on the same method: one gRPC batch instead of a stream's
reads (see :meth:`EngineClient._answer` for the sources of that contract). A message
that is not final, or none at all, is an :class:`EngineUnavailable` naming the breach.
"""

from __future__ import annotations

import asyncio
from array import array
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from engines.contract import (
    INPUTS,
    KV_EVENTS_SINCE,
    KV_STATS,
    EngineRequest,
    KvMetrics,
    TokenLogProbs,
    encode_request,
)
from engines.pool_stats import PoolStatsReport
from engines.response_tensors import (
    KV_CACHE_STATS,
    KV_NEW,
    KV_ONBOARDED,
    KV_REUSED,
    KV_TOTAL,
    OUTPUT_IDS,
    OUTPUT_LOG_PROBS,
    SEQUENCE_LENGTH,
    TOP_LOG_PROBS,
    TOP_LOG_PROBS_IDS,
)
from engines.refusals import is_refusal, overloaded
from server.gateway.replicas.engine_stream import STREAM_INFER_METHOD, TRANSPORT_ERRORS, StreamChannel, status_error

MODEL_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
_STATS_FLAG = np.array([True], np.bool_)
_DATATYPES = {spec.name: spec.datatype for spec in INPUTS}
_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
}


class EngineError(Exception):
    """Base of engine failures seen by the gateway."""


class EngineUnavailable(EngineError):
    """The engine cannot be reached or dropped the call (gateway answers 503)."""


class EngineRejected(EngineError):
    """The engine refused the request (its contract validation)."""


class EngineFailed(EngineUnavailable):
    """The engine answered the request with its own failure (an executor error, an engine that
    stopped): retried elsewhere and counted against the replica like any unavailability; the
    replica answered, though, so its other requests are left to run (``routing.mark_failed``)."""


class EngineOverloaded(EngineUnavailable):
    """The engine is up but refuses work for now (TensorRT-LLM's request queue is full): retried on
    another replica like any unavailability, but never counted against this replica's breaker (it
    serves; it is busy). With no replica left the client gets 503 ``engine_overloaded``."""


def answered_error(message: str) -> EngineError:
    """The engine error for an error the engine answered a request with (``message``): a refusal
    only when ``engines/refusals.py`` knows it as one, overload for a full queue, else the engine's
    own failure (unavailable)."""
    if is_refusal(message):
        return EngineRejected(message)
    if overloaded(message) is not None:
        return EngineOverloaded(f"engine overloaded: {message}")
    return EngineFailed(f"engine failed: {message}")


class EngineTimeout(EngineUnavailable):
    """The engine accepted the request but sent nothing before the gateway's first-token
    deadline (gateway answers 504). Raised by the router (``routing.RoutedEngine``), which
    has already cancelled the call: the engine saw a cancel and freed the request."""


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a call that got no answer within its deadline (the engine hangs: a
    refused or reset connection is not this)."""
    cause = exc.__cause__
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@dataclass(frozen=True, slots=True)
class EngineChunk:
    token_ids: tuple[int, ...]  # tokens new in this response
    generated: int  # cumulative generated tokens (``sequence_length``)
    kv: KvMetrics
    final: bool
    log_probs: tuple[TokenLogProbs, ...] | None = None  # one per token_ids entry, when asked


def _request_proto(model: str, request_id: str, tensors: dict[str, np.ndarray]) -> service_pb2.ModelInferRequest:
    """Build the KServe request directly (raw contents), skipping per-tensor client objects."""
    proto = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    raw = proto.raw_input_contents
    for name, array in tensors.items():
        datatype = _DATATYPES[name]
        proto.inputs.add(name=name, datatype=datatype, shape=array.shape)
        raw.append(serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes())
    return proto


_SCALAR_OUTPUTS = {SEQUENCE_LENGTH.name: 0, KV_REUSED.name: 1, KV_NEW.name: 2, KV_TOTAL.name: 3, KV_ONBOARDED.name: 4}
_LOG_PROB_OUTPUTS = {OUTPUT_LOG_PROBS.name: "f", TOP_LOG_PROBS.name: "f", TOP_LOG_PROBS_IDS.name: "i"}


def _log_probs(raw: dict[str, tuple[array, list[int]]]) -> tuple[TokenLogProbs, ...] | None:
    """``TokenLogProbs`` from the raw log-probability outputs of one response."""
    if OUTPUT_LOG_PROBS.name not in raw:
        return None
    chosen = raw[OUTPUT_LOG_PROBS.name][0]
    values = raw.get(TOP_LOG_PROBS.name)
    ids = raw.get(TOP_LOG_PROBS_IDS.name)
    width = values[1][-1] if values is not None and len(values[1]) == 2 else 0
    out = []
    for row, value in enumerate(chosen):
        top: tuple[tuple[int, float], ...] = ()
        if width and ids is not None:
            top = tuple((ids[0][row * width + k], values[0][row * width + k]) for k in range(width)
                        if values[0][row * width + k] != float("-inf"))
        out.append(TokenLogProbs(value, top))
    return tuple(out)
_OUTPUT_IDS = OUTPUT_IDS.name
_from_bytes = int.from_bytes


def _chunk(response: service_pb2.ModelInferResponse, streaming: bool, previous_kv: KvMetrics | None = None) -> EngineChunk:
    """Decode one response's outputs straight from ``raw_output_contents`` (one pass).

    ``previous_kv`` (the last chunk's) is reused when the counts did not change, which
    is every chunk after the first: one object per request instead of one per token.
    """
    ids: tuple[int, ...] = ()
    scalars = [0, 0, 0, 0, 0]
    slots = _SCALAR_OUTPUTS
    raw_log_probs: dict[str, tuple[array, list[int]]] | None = None
    for output, data in zip(response.outputs, response.raw_output_contents):
        name = output.name
        if name == _OUTPUT_IDS:
            ids = tuple(array("i", data))
        else:
            slot = slots.get(name)
            if slot is not None and data:
                scalars[slot] = _from_bytes(data[:4], "little", signed=True)
            elif name in _LOG_PROB_OUTPUTS:
                raw_log_probs = raw_log_probs or {}
                raw_log_probs[name] = (array(_LOG_PROB_OUTPUTS[name], data), list(output.shape))
    final_param = response.parameters.get("triton_final_response")
    final = bool(final_param.bool_param) if final_param is not None else not streaming
    _, reused, new, total, onboarded = scalars
    if (previous_kv is not None and previous_kv.reused_blocks == reused and previous_kv.new_blocks == new
            and previous_kv.total_blocks == total and previous_kv.onboarded_blocks == onboarded):
        kv = previous_kv
    else:
        kv = KvMetrics(reused, new, total, onboarded)
    return EngineChunk(ids, scalars[0], kv, final, _log_probs(raw_log_probs) if raw_log_probs else None)


def _transport_error(exc: BaseException) -> EngineError:
    """The engine error for a failed grpclib stream call (see ``engine_stream.status_error``)."""
    rejected, message = status_error(exc)
    return EngineRejected(message) if rejected else EngineUnavailable(f"engine unavailable {message}")


def _classify(exc: BaseException) -> EngineError:
    if isinstance(exc, grpc.aio.AioRpcError):
        code, message = exc.code(), exc.details() or str(exc)
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE):
            return EngineRejected(message)
        return EngineUnavailable(f"engine unavailable ({code.name}): {message}")
    if isinstance(exc, InferenceServerException):
        status = (exc.status() or "").upper()
        if "INVALID_ARGUMENT" in status or "NOT_FOUND" in status:
            return EngineRejected(exc.message())
        if not status:  # an error response inside a stream: a refusal, or the engine's own failure
            return answered_error(exc.message() or str(exc))
        return EngineUnavailable(f"engine unavailable: {exc.message()}")
    return EngineUnavailable(f"engine unavailable: {exc}")


class EngineClient:
    """One pool's engine model over KServe v2 gRPC."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        self._client = InferenceServerClient(url, channel_args=_CHANNEL_ARGS)
        # Streaming generation: ModelStreamInfer over grpclib (engine_stream.py, which says
        # why). The method is bidirectional, but the gateway only ever sends one request and
        # then half-closes, so it is called as unary-stream: headers, the request and the
        # half-close go out in one write; the server sees the same messages in the same order.
        # Triton keeps a half-closed stream open until its in-flight requests have sent
        # every response (triton-inference-server/server src/grpc/stream_infer_handler.cc,
        # ModelStreamInferHandler::Process: "If done reading and no in-flight requests then
        # can finish the entire stream"), as does the reference engine (tested).
        self._streams = StreamChannel(url)
        self._model_infer = self._client._channel.unary_unary(
            MODEL_INFER_METHOD,
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        # The same method for non-streaming requests, as unary-unary: one batch (metadata,
        # request, half-close, response, status) and no read loop. Correct only because such
        # a request gets exactly one stream message; see ``generate``.
        self._infer_once = self._client._channel.unary_unary(
            STREAM_INFER_METHOD,
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )

    async def close(self) -> None:
        self._streams.close()
        await self._client.close()

    async def ready(self, timeout: float = 2.0) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model, client_timeout=timeout))
        except (InferenceServerException, grpc.RpcError):
            return False

    async def stats(self, timeout: float = 5.0, *, events_since: int | None = None) -> PoolStatsReport:
        """The engine's pool statistics (the ``kv_stats`` side channel).

        With ``events_since`` (a cursor, 0 = from scratch) the report also carries the
        replica's KV events after it (``engines/kv_events.py``). Called every poll interval
        per replica, idle or not, so the request is a prebuilt protobuf on the unary
        ``ModelInfer`` and the one BYTES output is read from its raw contents (the KServe
        BYTES layout: a 4-byte little-endian length, then the bytes), without tritonclient's
        per-tensor objects.
        """
        tensors = {KV_STATS.name: _STATS_FLAG}
        if events_since is not None:
            tensors[KV_EVENTS_SINCE.name] = np.array([events_since], np.uint64)
        proto = _request_proto(self.model, "", tensors)
        proto.outputs.add(name=KV_CACHE_STATS.name)
        try:
            response = await self._model_infer(proto, timeout=timeout)
        except grpc.RpcError as exc:
            raise _classify(exc) from exc
        for output, data in zip(response.outputs, response.raw_output_contents):
            if output.name == KV_CACHE_STATS.name and len(data) >= 4:
                size = _from_bytes(data[:4], "little")
                return PoolStatsReport.from_json(data[4 : 4 + size])
        raise EngineUnavailable(f"engine answered the stats call without {KV_CACHE_STATS.name}")

    async def _connected(self, timeout: float) -> None:
        """Wait (briefly) for the channel to be READY.

        Why: after an engine restart the channel may sit in reconnect backoff, and a call
        made then fails at once with UNAVAILABLE although the engine is back.
        """
        channel = self._client._channel  # tritonclient exposes no public accessor
        if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(channel.channel_ready(), timeout)

    async def generate(self, request: EngineRequest, *, request_id: str, timeout: float | None = None,
                       connect_timeout: float = 2.0) -> AsyncIterator[EngineChunk]:
        """Stream ``request`` through ``ModelStreamInfer``; see the module invariants.

        One chunk per engine message, even when several arrived together. Merging the
        messages already in grpclib's receive buffer into one chunk (one pass through the
        request core and one SSE frame for all of them) was measured against this code in
        alternating rounds (``bench/server/vs_litellm.py --baseline``), gateway CPU per streamed
        chat request, merged ÷ this: 0.98 at one client, 1.05 at 32, so no gain. At one client
        a 16-token answer arrives in about 9 socket reads (1.7 messages each), and a token's
        cost is mostly in the HTTP/2 receive path (h2's frame handling, grpclib's buffer),
        which merging after it does not touch.
        """
        proto = _request_proto(self.model, request_id, encode_request(request))
        if not request.streaming:
            await self._connected(connect_timeout)
            yield await self._answer(proto, timeout)
            return

        try:
            call = await self._streams.open(proto, timeout=timeout, connect_timeout=connect_timeout)
        except TRANSPORT_ERRORS as exc:
            raise _transport_error(exc) from exc
        finished = False
        kv = None
        try:
            while True:
                message = await call.recv()
                if message is None:
                    raise EngineUnavailable("engine closed the stream before its final response")
                if message.error_message:
                    raise answered_error(message.error_message)
                chunk = _chunk(message.infer_response, True, kv)
                kv = chunk.kv
                finished = chunk.final
                yield chunk
                if finished:
                    return
        except EngineError:
            raise
        except TRANSPORT_ERRORS as exc:
            call.failed()
            raise _transport_error(exc) from exc
        finally:
            call.close(cancel=not finished)

    async def _answer(self, proto: service_pb2.ModelInferRequest, timeout: float | None) -> EngineChunk:
        """The one message of a non-streaming request, through a unary-unary call.

        The contract it relies on: the engine sends exactly one ``ModelStreamInfer`` message
        for a request with ``streaming`` false, final (``triton_final_response`` true) or an
        ``error_message``. Sources:

        * TensorRT-LLM (``cpp/tensorrt_llm/batch_manager/llmRequest.cpp``,
          ``LlmRequest::createResult``): a non-streaming request yields no Result until it is
          finished, and its Result is final once every returned sequence is (one here: beam
          width 1, no ``num_return_sequences``); ``cpp/tensorrt_llm/executor/executorImpl.cpp``
          ``populateNewResponses`` then drops it from the active requests, and
          ``terminateActiveRequests`` (a failed iteration) sends one error Response per
          request and drops it too; a cancel ends it as finished (``terminateCancelledRequests``),
          so again one Response. (Main-branch snapshots around the release/1.2 branch point;
          see ``engines/trtllm/bindings.py``.)
        * Our Triton model (``engines/triton/model.py``) sends every answer with
          ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` except streaming deltas, and the Python
          backend refuses any send after the final one
          (triton-inference-server/python_backend ``src/response_sender.cc``,
          ``ResponseSender::UpdateStateAndCounters``: "Response sender has been closed").
        * Triton writes one stream message per response, marked final with the FINAL flag,
          and no empty final one unless the request asks for
          ``triton_enable_empty_final_response`` (triton-inference-server/server
          ``src/grpc/stream_infer_handler.cc``, ``ModelStreamInferHandler::
          StreamInferResponseComplete``); the gateway never asks.
        * The reference engine and ``bench/server/fixed_engine.py``: tested
          (tests/engines/reference/test_one_message.py), as is the Triton model against its
          doubles (tests/engines/triton/test_model.py).

        A breach is an engine error, never a silent truncation: a non-final message or no
        message raises :class:`EngineUnavailable`. Two messages cannot be seen here: gRPC
        delivers the status only after every message is read, so such a call waits until
        the router's answer deadline (``RoutingConfig.first_response_wait``) cancels it as
        an :class:`EngineTimeout` naming the replica.
        """
        call = self._infer_once(proto, timeout=timeout)
        try:
            message = await call
        except (grpc.RpcError, InferenceServerException) as exc:
            error = _classify(exc)
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                error = EngineUnavailable(f"{error} (non-streaming call: no answer in time, or more than the one "
                                          "message the engine contract allows)")
            raise error from exc
        except BaseException:  # cancelled (first-token deadline, client gone): the engine drops it
            call.cancel()
            raise
        if message is None:
            raise EngineUnavailable("engine ended a non-streaming call without an answer")
        if message.error_message:
            raise answered_error(message.error_message)
        chunk = _chunk(message.infer_response, False)
        if not chunk.final:
            call.cancel()
            raise EngineUnavailable("engine sent a non-final message for a non-streaming request "
                                    "(the engine contract is exactly one message)")
        return chunk
