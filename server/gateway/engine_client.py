"""The gateway's client for one pool's engine model (Triton or the reference engine).

Speaks KServe v2 gRPC through ``tritonclient.grpc.aio`` and nothing else, so the same
code drives TensorRT-LLM behind Triton and the CPU reference engine. One channel per
pool, reused by every request; reconnect backoff is capped at one second so that the
first request after an engine restart succeeds (gRPC's default backoff grows to 120 s).

Invariants: :meth:`EngineClient.generate` yields chunks until the engine's final
response and then stops; if the consumer stops early (client gone, stop string hit),
closing the generator cancels the gRPC call, which the engine treats as a cancel and
frees the request's blocks. Transport failures surface as :class:`EngineUnavailable`,
engine-side refusals as :class:`EngineRejected`; nothing else escapes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from engines.contract import (
    INPUTS,
    KV_CACHE_STATS,
    KV_NEW,
    KV_ONBOARDED,
    KV_REUSED,
    KV_STATS,
    KV_TOTAL,
    OUTPUT_IDS,
    SEQUENCE_LENGTH,
    EngineRequest,
    KvMetrics,
    PoolStatsReport,
    encode_request,
)

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


@dataclass(frozen=True, slots=True)
class EngineChunk:
    token_ids: tuple[int, ...]  # tokens new in this response
    generated: int  # cumulative generated tokens (``sequence_length``)
    kv: KvMetrics
    final: bool


def _to_inputs(tensors: dict[str, np.ndarray]) -> list[InferInput]:
    inputs = []
    for name, array in tensors.items():
        item = InferInput(name, list(array.shape), _DATATYPES[name])
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


def _first_int(result, name: str) -> int:
    array = result.as_numpy(name)
    return 0 if array is None or array.size == 0 else int(array.reshape(-1)[0])


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
        if not status:  # an error response inside a stream: the engine's own validation
            return EngineRejected(exc.message() or str(exc))
        return EngineUnavailable(f"engine unavailable: {exc.message()}")
    return EngineUnavailable(f"engine unavailable: {exc}")


class EngineClient:
    """One pool's engine model over KServe v2 gRPC."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        self._client = InferenceServerClient(url, channel_args=_CHANNEL_ARGS)

    async def close(self) -> None:
        await self._client.close()

    async def ready(self, timeout: float = 2.0) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model, client_timeout=timeout))
        except (InferenceServerException, grpc.RpcError):
            return False

    async def stats(self, timeout: float = 5.0) -> PoolStatsReport:
        """The engine's pool statistics (the ``kv_stats`` side channel)."""
        flag = InferInput(KV_STATS.name, [1], KV_STATS.datatype)
        flag.set_data_from_numpy(np.array([True], np.bool_))
        try:
            result = await self._client.infer(
                self.model, [flag], outputs=[InferRequestedOutput(KV_CACHE_STATS.name)], client_timeout=timeout
            )
        except (InferenceServerException, grpc.RpcError) as exc:
            raise _classify(exc) from exc
        raw = result.as_numpy(KV_CACHE_STATS.name).reshape(-1)[0]
        return PoolStatsReport.from_json(raw)

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
        """Stream ``request`` through ``ModelStreamInfer``; see the module invariants."""
        inputs = _to_inputs(encode_request(request))
        await self._connected(connect_timeout)
        async def one_request():
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        stream = self._client.stream_infer(one_request(), stream_timeout=timeout)
        finished = False
        try:
            async for result, error in stream:
                if error is not None:
                    raise _classify(error)
                response = result.get_response()
                final_param = response.parameters.get("triton_final_response")
                final = bool(final_param.bool_param) if final_param is not None else not request.streaming
                ids = result.as_numpy(OUTPUT_IDS.name)
                yield EngineChunk(
                    token_ids=() if ids is None else tuple(int(t) for t in ids.reshape(-1)),
                    generated=_first_int(result, SEQUENCE_LENGTH.name),
                    kv=KvMetrics(
                        reused_blocks=_first_int(result, KV_REUSED.name),
                        new_blocks=_first_int(result, KV_NEW.name),
                        total_blocks=_first_int(result, KV_TOTAL.name),
                        onboarded_blocks=_first_int(result, KV_ONBOARDED.name),
                    ),
                    final=final,
                )
                if final:
                    finished = True
                    return
            raise EngineUnavailable("engine closed the stream before its final response")
        except EngineError:
            raise
        except (grpc.RpcError, InferenceServerException) as exc:
            raise _classify(exc) from exc
        except StopAsyncIteration as exc:  # tritonclient's iterator ends this way on some transports
            raise EngineUnavailable("engine closed the stream before its final response") from exc
        finally:
            if not finished:
                stream.cancel()
