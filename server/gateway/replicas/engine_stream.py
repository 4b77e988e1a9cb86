"""The engine client's streaming transport: ``ModelStreamInfer`` over grpclib (HTTP/2 on the loop).

Why a second transport: grpc.aio runs gRPC's C core on its own poller thread, which hands
every completion to the asyncio loop; a 16-token stream is then ~16 cross-thread wake-ups
(futex and epoll calls around each). grpclib parses HTTP/2 (``h2``) in the event loop's
own ``data_received``, so a streamed token costs a frame parse and no thread hand-off:
measured 1.66 ms against 2.53 ms of client process CPU per 16-token stream against
``bench/server/fixed_engine.py``, one caller (1.39 × less, median of 7 alternating rounds; 1.24 ×
at 32 callers), and 6.4 ms against 8.3 ms of gateway CPU per streamed chat request, one
client (``bench/server/vs_litellm.py --baseline``). A unary call is the other way round
(grpc.aio's single batch: 0.53 ms against grpclib's 0.64 ms of process CPU per call, one
caller, on asyncio's loop; 0.37 ms against 0.51 ms on uvloop, the gateway's loop), so
non-streaming requests and the side calls stay on grpc.aio (``engine_client.py``).

Invariants, the same as the grpc.aio path's:

* one HTTP/2 connection per replica, opened on first use and again after it is lost (no
  backoff: the call after an engine restart connects at once); a call made while the engine
  does not accept connections retries the connect every 0.1 s up to its connect timeout,
  then fails as :class:`EngineUnavailable`;
* keepalive: while a stream is open, grpclib looks every 30 s and pings if it has not
  pinged in the last 300 s (its ``_http2_min_sent_ping_interval_without_data``), at most 2
  pings between two calls sent; so the first ping goes out 30 s after the connection is
  made, the next ones at best 300 s apart. No ack within 10 s closes the connection, which
  ends its streams as :class:`EngineUnavailable`;
* messages above ``MAX_GRPC_MESSAGE_SIZE`` (tritonclient's limit, which the grpc.aio
  channel sets) are refused both ways as RESOURCE_EXHAUSTED, as gRPC does;
* :meth:`StreamCall.close` before the final response resets the HTTP/2 stream
  (RST_STREAM), which the engine treats as a cancel and frees the request; after the final
  response the stream is released without a reset, as the gRPC call is left to end;
* a GOAWAY (the engine's graceful stop, a rolling restart) ends only the streams above its
  ``last_stream_id``; the others run to their end on the old connection, and the next call
  opens a new one, as gRPC does (:class:`_DrainingProcessor`);
* a connect the engine never answers is cut at the connect timeout (:class:`EngineUnavailable`).

grpclib has no synchronous way to end a call (``Stream.__aexit__`` awaits the trailers),
and an async generator's ``finally`` must not depend on an await that a second cancel can
interrupt; so :meth:`StreamCall.close` does what ``__aexit__`` does on an error, through
grpclib's attributes (pinned in requirements.lock).

The private grpclib 0.4.9 / h2 4.4.1 surface used here, all of it (both pinned in
pyproject.toml and requirements.lock; check it on any upgrade): ``Channel._connected``,
``Channel._protocol_factory`` (with ``_config``, ``_h2_config``), ``Stream._stream``,
``_release_stream``, ``_wrapper``, ``_wrapper_ctx``; ``EventsProcessor.register`` /
``process_connection_terminated`` / ``streams`` and ``H2Protocol.connection_made`` (to
install the draining processor); h2's ``H2Connection._frame_dispatch_table`` (reached as
grpclib's ``Connection._connection``), whose GOAWAY entry is replaced.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import h2.errors
import h2.exceptions
from grpclib.client import Channel, Handler, Stream
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.protocol import EventsProcessor, H2Protocol
from h2.events import ConnectionTerminated
from hyperframe.frame import GoAwayFrame
from tritonclient.grpc import service_pb2
from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE

STREAM_INFER_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
_CONFIG = Configuration(_keepalive_time=30.0, _keepalive_timeout=10.0)
_CONNECT_RETRY_S = 0.1
_REJECTED = frozenset({Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.OUT_OF_RANGE})
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


def _receive_goaway(frame: GoAwayFrame) -> tuple[list, list]:
    """h2's GOAWAY handler without its two side effects: h2 moves the connection to CLOSED
    (every later frame, the draining streams' DATA included, is then a ProtocolError) and
    drops its unsent output (a pending SETTINGS or PING ack). Only the event is kept; the
    connection stays open for the streams the server keeps (see :class:`_DrainingProcessor`)."""
    event = ConnectionTerminated()
    try:
        event.error_code = h2.errors.ErrorCodes(frame.error_code)
    except ValueError:  # an unknown code stays an int, as h2 does
        event.error_code = frame.error_code
    event.last_stream_id = frame.last_stream_id
    event.additional_data = frame.additional_data or None
    return [], [event]


class _DrainingProcessor(EventsProcessor):
    """grpclib's events processor, except that a GOAWAY drains the connection instead of
    cutting it (grpclib closes it and ends every stream as "Connection lost").

    Invariants after a GOAWAY: the streams above its ``last_stream_id`` (never seen by the
    server) end at once; the others keep reading to their end; the handler reports the
    connection lost, so the channel opens a new connection for the next call; the connection
    closes when its last stream is released or the server closes TCP (``connection_lost``
    then ends what is left, as before). This is what gRPC (and grpc.aio) does on a server's
    graceful stop (``server.stop(grace)``, a rolling restart).
    """

    draining = False

    def register(self, stream):
        release = super().register(stream)

        def release_stream() -> None:
            release()
            if self.draining and not self.streams:
                self.close("Connection drained after GOAWAY")

        return release_stream

    def process_connection_terminated(self, event: ConnectionTerminated) -> None:
        self.draining = True
        self.handler.close()  # Channel._connected is now false: new calls connect anew
        reason = f"Received GOAWAY frame; error_code: {event.error_code}"
        kept = 0
        for stream_id, stream in list(self.streams.items()):
            if stream_id > event.last_stream_id:
                stream.__terminated__(reason)
            else:
                kept += 1
        if not kept:
            self.close(reason)


class _DrainingProtocol(H2Protocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.processor = _DrainingProcessor(self.handler, self.connection)
        self.connection._connection._frame_dispatch_table[GoAwayFrame] = _receive_goaway


class _Channel(Channel):
    """A grpclib channel whose connections drain on GOAWAY (:class:`_DrainingProcessor`)."""

    def _protocol_factory(self) -> H2Protocol:
        return _DrainingProtocol(Handler(), self._config, self._h2_config)


def status_error(exc: BaseException) -> tuple[bool, str]:
    """``(rejected, message)`` for a transport error: only the engine's own validation
    statuses are a refusal; every other failure means the engine is unavailable. A refusal's
    message is the engine's own text, as on the unary path (``engine_client._classify``)."""
    if isinstance(exc, GRPCError):
        if exc.status in _REJECTED:
            return True, exc.message or exc.status.name
        return False, f"({exc.status.name}): {exc.message or ''}"
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
                inner.reset_nowait(h2.errors.ErrorCodes.CANCEL)  # gRPC's client cancel
            stream._release_stream()
        if stream._wrapper_ctx is not None:  # the deadline timer
            stream._wrapper_ctx.__exit__(None, None, None)


@dataclass(slots=True)
class StreamChannel:
    """The HTTP/2 connection to one engine endpoint (``host:port``; IPv6 in brackets)."""

    url: str
    _channel: _Channel | None = field(default=None, init=False)

    def _get(self) -> Channel:
        # Created on first use: a grpclib Channel binds the running loop.
        if self._channel is None:
            host, _, port = self.url.rpartition(":")
            self._channel = _Channel(host.strip("[]"), int(port), codec=_LimitedCodec(), config=_CONFIG)
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
        """Connect within ``connect_timeout``, retrying while the engine refuses (it may be
        restarting); an attempt the engine never answers (SYNs dropped, a full backlog) is
        cut at the deadline. Raises ``OSError`` (a transport error: the engine is unavailable)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    await channel.__connect__()
                return
            except TimeoutError:
                raise ConnectionError(f"no connection within the connect timeout ({connect_timeout} s)") from None
            except OSError:
                if loop.time() + _CONNECT_RETRY_S > deadline:
                    raise
                await asyncio.sleep(_CONNECT_RETRY_S)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
