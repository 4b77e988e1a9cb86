"""KServe v2 gRPC server for model ``kvgate_llm`` on top of :class:`ReferenceEngine`.

The servicer is the one generated in ``tritonclient.grpc.service_pb2_grpc``
(``GRPCInferenceServiceServicer``, from triton-inference-server/common
``protobuf/grpc_service.proto``) running on ``grpc.aio``, so ``tritonclient.grpc`` and
``tritonclient.grpc.aio`` talk to it unmodified.

Calls:
* ``ModelInfer`` (unary): one response with every generated token.
* ``ModelStreamInfer`` (bidirectional, decoupled like the TensorRT-LLM backend):
  requests are served concurrently; ``streaming`` true gives one response per token
  plus a last one carrying ``triton_final_response = true`` (Triton's decoupled
  marker); a bad request yields an ``error_message`` response carrying its request id
  (as Triton's stream handler repopulates it: server src/grpc/stream_infer_handler.cc) and the stream goes on;
  a half-closed stream still gets every response; a cancelled stream cancels its
  requests (their blocks are released).
* ``stop`` true cancels the in-flight request(s) with the same request ``id``, as the
  stock backend does; ``kv_stats`` true answers with the pool statistics JSON.
* health, server/model metadata and model config.

Invariants: every request is answered. A bad one (a malformed tensor, an output the model
does not have) gets ``INVALID_ARGUMENT`` (unary) or an ``error_message`` (stream) naming the
tensor at fault, marked as the contract's refusal (``ContractError.refusal``), before anything
is generated; any other failure while serving it gets ``INTERNAL`` or ``UNAVAILABLE`` (the
engine stopped), or an unmarked ``error_message``. Neither disturbs other requests or the server.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from engines.contract import (
    MODEL_NAME, STOP, ContractError, EngineRequest, KvMetrics, TokenLogProbs, is_stats_request, kv_events_cursor,
    parse_request,
)
from engines.reference.config import ReferenceEngineConfig
from engines.reference.engine import EngineOutput, EngineStoppedError, ReferenceEngine
from engines.reference.kserve import (
    MODEL_VERSION, check_requested_outputs, decode_inputs, encode_outputs, model_config, model_metadata,
)
from engines.reference.loader import ModelBundle, load_model
from engines.response_tensors import (
    KV_CACHE_STATS, KV_NEW, KV_ONBOARDED, KV_REUSED, KV_TOTAL, OUTPUT_IDS, SEQUENCE_LENGTH, TOP_LOG_PROBS,
    decode_log_probs, encode_response,
)

log = logging.getLogger(__name__)
SERVER_NAME = "kvgate-reference"
_STREAM_DONE = object()


class _RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class KvgateInferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine
        self._ids = itertools.count(1)
        self._by_client_id: dict[str, set[str]] = {}

    # Health and metadata ------------------------------------------------------------------
    async def ServerLive(self, request, context):
        # Not live once the engine stopped itself (engine.py, _loop): only a restart brings it back,
        # and a liveness probe (Helm's reference pods) is what asks for one.
        return service_pb2.ServerLiveResponse(live=not self.engine.failed)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.engine.is_running())

    async def ModelReady(self, request, context):
        known = request.name == MODEL_NAME and request.version in ("", MODEL_VERSION)
        return service_pb2.ModelReadyResponse(ready=known and self.engine.is_running())

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version="2", extensions=["kvgate_kv_stats"])

    async def ModelMetadata(self, request, context):
        await self._check_model(request.name, request.version, context)
        return model_metadata()

    async def ModelConfig(self, request, context):
        await self._check_model(request.name, request.version, context)
        cfg = self.engine.config
        return service_pb2.ModelConfigResponse(
            config=model_config(max_input_len=cfg.max_input_len, max_output_len=cfg.max_output_len)
        )

    async def _check_model(self, name: str, version: str, context) -> None:
        problem = _model_problem(name, version)
        if problem is not None:
            await context.abort(grpc.StatusCode.NOT_FOUND, problem)

    # Inference --------------------------------------------------------------------------
    async def ModelInfer(self, request, context):
        # Every output is collected unfiltered and merged first (the merge reads sequence_length
        # and the KV metrics); the requested outputs are selected from the merged answer only.
        try:
            parts = [p async for p in self._serve_tensors(request)]
            if len(parts) == 1:
                tensors, requested, _ = parts[0]
            else:
                tensors, requested = _merge([t for t, _, _ in parts]), _requested(request)
            return _response(request, tensors, requested, final=None)
        except _RequestFailed as failure:
            await context.abort(failure.code, failure.message)
        except Exception as exc:  # noqa: BLE001 - a bug answers INTERNAL, not gRPC's bare UNKNOWN
            log.exception("ModelInfer %r failed", request.id)
            await context.abort(grpc.StatusCode.INTERNAL, _internal_message(exc))

    async def ModelStreamInfer(self, request_iterator, context):
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def serve_one(request) -> None:
            # Whatever fails, the request is answered: the client waits for a final response
            # or an error for each id, and an exception lost in this task would leave it waiting.
            try:
                async for response in self._serve(request):
                    queue.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))
            except _RequestFailed as failure:
                queue.put_nowait(_stream_error(request, failure.message))
            except Exception as exc:  # noqa: BLE001 - see above
                log.exception("ModelStreamInfer request %r failed", request.id)
                queue.put_nowait(_stream_error(request, _internal_message(exc)))

        async def read_requests() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(serve_one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            # Half-closed: keep answering what was asked.
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            queue.put_nowait(_STREAM_DONE)

        reader = asyncio.create_task(read_requests())
        try:
            while True:
                item = await queue.get()
                if item is _STREAM_DONE:
                    break
                yield item
            await reader
        finally:
            # Client cancelled (or the server is stopping): cancel every request of this stream.
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _serve(self, request: service_pb2.ModelInferRequest) -> AsyncIterator[service_pb2.ModelInferResponse]:
        """Responses for one request; raises ``_RequestFailed`` for bad input."""
        async for tensors, requested, final in self._serve_tensors(request):
            yield _response(request, tensors, requested, final=final)

    async def _serve_tensors(
        self, request: service_pb2.ModelInferRequest
    ) -> AsyncIterator[tuple[dict[str, np.ndarray], set[str] | None, bool]]:
        """Every output tensor of each response (unfiltered), the outputs to send (None: all) and
        whether it is the final one; raises ``_RequestFailed`` for bad input."""
        problem = _model_problem(request.model_name, request.model_version)
        if problem is not None:
            raise _RequestFailed(grpc.StatusCode.NOT_FOUND, problem)
        requested = _requested(request)
        try:
            check_requested_outputs(request)
            tensors = decode_inputs(request)
            if is_stats_request(tensors):
                report = self.engine.stats(kv_events_cursor(tensors))
                yield {KV_CACHE_STATS.name: np.array([report.to_json().encode()], dtype=np.object_)}, None, True
                return
            if STOP.name in tensors and bool(np.asarray(tensors[STOP.name]).reshape(-1)[:1].any()):
                self._stop(request.id)
                yield encode_response([], 0, KvMetrics()), requested, True
                return
            cfg = self.engine.config
            parsed = parse_request(
                tensors, max_output_len=cfg.max_output_len, max_input_len=cfg.max_input_len,
                vocab_size=self.engine.vocab_size,
            )
        except ContractError as exc:
            raise _RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"[{MODEL_NAME}] {exc.refusal}") from None
        async for output in self._generate(request.id, parsed):
            if output.error is not None:
                raise _RequestFailed(grpc.StatusCode.INTERNAL, f"[{MODEL_NAME}] {output.error}")
            tensors_out = encode_response(list(output.new_tokens), output.sequence_length, output.kv,
                                          output.log_probs, parsed.num_top_log_probs)
            yield tensors_out, requested, output.finished

    async def _generate(self, client_id: str, parsed: EngineRequest) -> AsyncIterator[EngineOutput]:
        internal_id = f"{next(self._ids)}:{client_id}"
        self._by_client_id.setdefault(client_id, set()).add(internal_id)
        try:
            async for output in self.engine.generate(internal_id, parsed):
                yield output
        except EngineStoppedError as exc:
            raise _RequestFailed(grpc.StatusCode.UNAVAILABLE, f"[{MODEL_NAME}] {exc}") from None
        except ContractError as exc:  # a guide that does not compile
            raise _RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"[{MODEL_NAME}] {exc.refusal}") from None
        finally:
            ids = self._by_client_id.get(client_id)
            if ids is not None:
                ids.discard(internal_id)
                if not ids:
                    del self._by_client_id[client_id]

    def _stop(self, client_id: str) -> None:
        for internal_id in list(self._by_client_id.get(client_id, ())):
            self.engine.cancel(internal_id)


def _model_problem(name: str, version: str) -> str | None:
    if name != MODEL_NAME:
        return f"Request for unknown model: '{name}' is not found (this server serves '{MODEL_NAME}')"
    if version not in ("", MODEL_VERSION):
        return f"Request for unknown model: '{name}' version {version} is not found (only version {MODEL_VERSION})"
    return None


def _stream_error(request: service_pb2.ModelInferRequest, message: str) -> service_pb2.ModelStreamInferResponse:
    """A stream's error answer to ``request``. It carries the request's id, as Triton's stream
    handler does, so a client with several requests on one stream knows which one failed."""
    known = _model_problem(request.model_name, request.model_version) is None
    return service_pb2.ModelStreamInferResponse(
        error_message=message,
        infer_response=service_pb2.ModelInferResponse(
            id=request.id, model_name=MODEL_NAME if known else request.model_name,
            model_version=MODEL_VERSION if known else request.model_version,
        ),
    )


def _internal_message(exc: Exception) -> str:
    return f"[{MODEL_NAME}] internal error: {type(exc).__name__}: {exc}"


def _requested(request: service_pb2.ModelInferRequest) -> set[str] | None:
    """The outputs the client asked for (None: every output)."""
    return {o.name for o in request.outputs} or None


def _response(request, tensors, requested, *, final: bool | None) -> service_pb2.ModelInferResponse:
    """A response with ``tensors`` (only the ``requested`` ones); ``final`` None (unary) sets no
    ``triton_final_response`` parameter."""
    response = service_pb2.ModelInferResponse(model_name=MODEL_NAME, model_version=MODEL_VERSION, id=request.id)
    encode_outputs(response, tensors, requested)
    if final is not None:
        response.parameters["triton_final_response"].bool_param = final
    return response


def _merge(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One unary answer from a streamed sequence's output tensors: concatenated tokens (and log
    probabilities), the last sequence_length and KV metrics."""
    tokens: list[int] = []
    log_probs: list[TokenLogProbs] | None = None
    num_top = 0
    for tensors in parts:
        tokens.extend(int(t) for t in np.asarray(tensors[OUTPUT_IDS.name]).reshape(-1))
        part = decode_log_probs(tensors)
        if part is not None:
            log_probs = (log_probs or []) + list(part)
            if TOP_LOG_PROBS.name in tensors:
                num_top = max(num_top, int(np.shape(tensors[TOP_LOG_PROBS.name])[-1]))
    last = parts[-1]
    kv = KvMetrics(*(int(np.asarray(last[spec.name]).reshape(-1)[0]) for spec in (KV_REUSED, KV_NEW, KV_TOTAL, KV_ONBOARDED)))
    return encode_response(tokens, int(np.asarray(last[SEQUENCE_LENGTH.name]).reshape(-1)[0]), kv, log_probs, num_top)


@dataclass(slots=True)
class RunningServer:
    """A started server; ``stop`` ends the gRPC server, then the engine thread."""

    server: grpc.aio.Server
    engine: ReferenceEngine
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace: float | None = 1.0) -> None:
        await self.server.stop(grace)
        await asyncio.to_thread(self.engine.stop)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def start_reference_server(
    config: ReferenceEngineConfig, *, host: str = "127.0.0.1", port: int = 8001, bundle: ModelBundle | None = None
) -> RunningServer:
    """Load the model (unless ``bundle`` is given), start the engine and serve on ``host:port``.

    ``port=0`` binds a free port; the bound one is ``RunningServer.port``.
    """
    if bundle is None:
        bundle = await asyncio.to_thread(load_model, config.gguf_path, weight_format=config.weight_format)
    engine = await asyncio.to_thread(ReferenceEngine, bundle, config)
    engine.start()
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", 64 * 1024 * 1024), ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KvgateInferenceServicer(engine), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        await asyncio.to_thread(engine.stop)
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    return RunningServer(server, engine, host, bound)
