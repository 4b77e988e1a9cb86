"""The engine client's streaming transport: ``ModelStreamInfer`` over grpclib (HTTP/2 on the loop).

Why a second transport: grpc.aio runs gRPC's C core on its own poller thread, which hands
every completion to the asyncio loop; a 16-token stream is then ~16 cross-thread wake-ups
(futex and epoll calls around each). grpclib parses HTTP/2 (``h2``) in the event loop's
own ``data_received``, so a streamed token costs a frame parse and no thread hand-off:
measured 1.66 ms against 2.53 ms of client process CPU per 16-token stream against
``bench/server/fixed_engine.py``, one caller (1.39 × less, median of 7 alternating rounds; 1.24 ×
at 32 callers), and 6.4 ms against 8.3 ms of gateway CPU per streamed chat request, one
client (``bench/server/vs_litellm.py --baseline``). A unary call is the other way round
(grpc.aio's single batch: 0.53 ms against grpclib's 0.64 ms), so non-streaming requests
and the side calls stay on grpc.aio (``engine_client.py``).

Invariants, the same as the grpc.aio path's:

* one HTTP/2 connection per replica, opened on first use and again after it is lost (no
  backoff: the call after an engine restart connects at once); a call made while the engine
  does not accept connections retries the connect every 0.1 s up to its connect timeout,
  then fails as :class:`EngineUnavailable`;
* keepalive: while a stream is open, a ping every 30 s, within grpclib's default bounds
  (at most 2 pings without data, 300 s apart); no ack within 10 s closes the connection,
  which ends its streams as :class:`EngineUnavailable`;
* messages above ``MAX_GRPC_MESSAGE_SIZE`` (tritonclient's limit, which the grpc.aio
  channel sets) are refused both ways as RESOURCE_EXHAUSTED, as gRPC does;
* :meth:`StreamCall.close` before the final response resets the HTTP/2 stream
  (RST_STREAM), which the engine treats as a cancel and frees the request; after the final
  response the stream is released without a reset, as the gRPC call is left to end.

grpclib has no synchronous way to end a call (``Stream.__aexit__`` awaits the trailers),
and an async generator's ``finally`` must not depend on an await that a second cancel can
interrupt; so :meth:`StreamCall.close` does what ``__aexit__`` does on an error, through
grpclib's attributes (pinned in requirements.lock).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import h2.exceptions
from grpclib.client import Channel, Stream
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from tritonclient.grpc import service_pb2
from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE

STREAM_INFER_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
_CONFIG = Configuration(_keepalive_time=30.0, _keepalive_timeout=10.0)
_CONNECT_RETRY_S = 0.1
_REJECTED = {Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.OUT_OF_RANGE}
# What a broken call raises: a status, a lost or reset connection, a deadline, a refused
# connect, an HTTP/2 violation. Anything else is a bug and propagates.
TRANSPORT_ERRORS = (GRPCError, StreamTerminatedError, ProtocolError, h2.exceptions.ProtocolError, OSError,
                    asyncio.TimeoutError)


class _LimitedCodec(ProtoCodec):
    """The protobuf codec with gRPC's message size limit (RESOURCE_EXHAUSTED beyond it)."""

    def encode(self, message, message_type) -> bytes:
        data = message.SerializeToString()
        if len(data) > MAX_GRPC_MESSAGE_SIZE:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"request of {len(data)} bytes exceeds the limit")
        return data

    def decode(self, data: bytes, message_type):
        if len(data) > MAX_GRPC_MESSAGE_SIZE:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"response of {len(data)} bytes exceeds the limit")
        return message_type.FromString(data)


def status_error(exc: BaseException) -> tuple[bool, str]:
    """``(rejected, message)`` for a transport error: only the engine's own validation
    statuses are a refusal; every other failure means the engine is unavailable."""
    if isinstance(exc, GRPCError):
        return exc.status in _REJECTED, f"({exc.status.name}): {exc.message or ''}"
    if isinstance(exc, asyncio.TimeoutError):
        return False, "(DEADLINE_EXCEEDED): no answer in time"
    return False, f"({type(exc).__name__}): {exc}"


@dataclass(slots=True)
class StreamCall:
    """One ``ModelStreamInfer`` call with its request sent and half-closed."""

    stream: Stream

    async def recv(self) -> service_pb2.ModelStreamInferResponse | None:
        """The next message; ``None`` once the engine ended the stream with an OK status
        (a non-OK status raises ``GRPCError``)."""
        message = await self.stream.recv_message()
        if message is None:
            await self.stream.recv_trailing_metadata()
        return message

    def failed(self) -> None:
        """Call on a transport error: grpclib wakes a task waiting on a broken call by
        cancelling it and raising its own error instead of the ``CancelledError``; the
        task's cancel request is withdrawn here so that its count stays true for
        ``asyncio.timeout`` and task groups up the stack."""
        wrapper = self.stream._wrapper
        if wrapper.cancelled and wrapper.cancel_failed is False:  # it replaced a CancelledError
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()

    def close(self, *, cancel: bool) -> None:
        """Release the call; with ``cancel``, reset it first (the engine drops the request)."""
        stream = self.stream
        inner = getattr(stream, "_stream", None)  # absent when the request was never sent
        if inner is not None:
            if cancel and inner.closable:
                inner.reset_nowait()
            stream._release_stream()
        if stream._wrapper_ctx is not None:  # the deadline timer
            stream._wrapper_ctx.__exit__(None, None, None)


@dataclass(slots=True)
class StreamChannel:
    """The HTTP/2 connection to one engine endpoint (``host:port``; IPv6 in brackets)."""

    url: str
    _channel: Channel | None = field(default=None, init=False)

    def _get(self) -> Channel:
        # Created on first use: a grpclib Channel binds the running loop.
        if self._channel is None:
            host, _, port = self.url.rpartition(":")
            self._channel = Channel(host.strip("[]"), int(port), codec=_LimitedCodec(), config=_CONFIG)
        return self._channel

    async def open(self, request: service_pb2.ModelInferRequest, *, timeout: float | None,
                   connect_timeout: float) -> StreamCall:
        """Send ``request`` and half-close (one request, then the responses). Raises one
        of :data:`TRANSPORT_ERRORS`; the call is released on any failure here."""
        channel = self._get()
        if not channel._connected:  # grpclib exposes no public accessor
            await self._connect(channel, connect_timeout)
        stream = channel.request(STREAM_INFER_METHOD, Cardinality.UNARY_STREAM, service_pb2.ModelInferRequest,
                                 service_pb2.ModelStreamInferResponse, timeout=timeout)
        await stream.__aenter__()
        call = StreamCall(stream)
        try:
            await stream.send_message(request, end=True)
        except BaseException as exc:
            if isinstance(exc, TRANSPORT_ERRORS):
                call.failed()
            call.close(cancel=True)
            raise
        return call

    @staticmethod
    async def _connect(channel: Channel, connect_timeout: float) -> None:
        """Connect, retrying while the engine refuses (it may be restarting)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout
        while True:
            try:
                await channel.__connect__()
                return
            except OSError:
                if loop.time() + _CONNECT_RETRY_S > deadline:
                    raise
                await asyncio.sleep(_CONNECT_RETRY_S)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
