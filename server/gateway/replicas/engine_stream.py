"""One long-lived ``ModelStreamInfer`` stream per engine replica, shared by its requests.

Why: a gRPC call per request was the largest single cost of the gateway's hot path (call
set-up, initial metadata, status; both sides). ``ModelStreamInfer`` is bidirectional and
serves many in-flight requests over one stream, each response tagged with its request's
``id``: Triton reads the next request as soon as one is issued and, for a failed request,
"repopulate[s] the id so that client knows which request failed"
(triton-inference-server/server ``src/grpc/stream_infer_handler.cc``,
``ModelStreamInferHandler::Process`` and ``StreamInferResponseComplete``); the reference
engine does the same (``engines/reference/server.py``), and so does ``bench/fixed_engine.py``.

A request is written by one writer task (gRPC allows one outstanding write per call, and a
cancelled write would cancel the whole stream), its responses are read by one reader task and
routed to the request's :class:`Inbox` by id. Submitting and abandoning are synchronous, so
a request being cancelled can never cancel the stream.

Invariants:

* at most one open stream per :class:`EngineStream`; a request id is open at most once on it
  (a duplicate is refused with :class:`EngineUnavailable`);
* when the stream fails or ends, every open request's inbox receives the failure, and the
  next request opens a new stream;
* a request abandoned before its final response is stopped the contract's way: a request
  with the same ``id`` and ``stop`` true (the stock backend's cancel, ``engines/contract.py``)
  goes out on the stream, and later responses with that id are dropped;
* nothing here decodes responses: the inbox yields raw ``ModelStreamInferResponse``
  messages (or raises the stream's failure) in the order the engine sent them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2

from engines.contract import STOP

log = logging.getLogger("kvgate.gateway.engine_stream")


class Inbox:
    """The responses of one request on a shared stream, in arrival order."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        """A response message, or an exception the consumer's :meth:`get` raises."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def ready(self) -> service_pb2.ModelStreamInferResponse | None:
        """The next response if one has already arrived and is not a failure (an exception or an
        ``error_message``: :meth:`get` delivers those)."""
        items = self._items
        if items and not isinstance(items[0], BaseException) and not items[0].error_message:
            return items.popleft()
        return None

    async def get(self) -> service_pb2.ModelStreamInferResponse:
        items = self._items
        while not items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


def stop_request(model: str, request_id: str) -> service_pb2.ModelInferRequest:
    """The contract's cancel of ``request_id``: only ``stop`` = true, with the same id."""
    proto = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    proto.inputs.add(name=STOP.name, datatype=STOP.datatype, shape=[1])
    proto.raw_input_contents.append(b"\x01")
    return proto


class _Stream:
    """One open gRPC stream: its call, writer and reader tasks, and its open requests."""

    __slots__ = ("call", "inboxes", "outbox", "writer", "reader", "failed")

    def __init__(self, call) -> None:
        self.call = call
        self.inboxes: dict[str, Inbox] = {}
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.writer: asyncio.Task | None = None
        self.reader: asyncio.Task | None = None
        self.failed = False


class EngineStream:
    """The shared stream of one engine client (see the module invariants).

    ``open_call`` starts a new bidirectional ``ModelStreamInfer`` call; ``classify`` turns a
    transport failure into the :class:`EngineError` every open request then raises;
    ``unavailable`` builds the error for a stream the engine ended.
    """

    def __init__(self, open_call: Callable[[], object], classify: Callable[[BaseException], Exception],
                 unavailable: Callable[[str], Exception]) -> None:
        self._open_call = open_call
        self._classify = classify
        self._unavailable = unavailable
        self._stream: _Stream | None = None

    @property
    def open_requests(self) -> int:
        stream = self._stream
        return 0 if stream is None else len(stream.inboxes)

    @property
    def live(self) -> bool:
        """Whether a stream is open (a new request needs no connection wait)."""
        return self._stream is not None

    def submit(self, request_id: str, proto: service_pb2.ModelInferRequest) -> Inbox:
        """Queue ``proto`` for writing and return the inbox of its responses (never awaits)."""
        stream = self._stream
        if stream is None:
            stream = self._stream = self._start()
        if request_id in stream.inboxes:
            raise self._unavailable(f"request id {request_id!r} is already open on this engine stream")
        inbox = stream.inboxes[request_id] = Inbox()
        stream.outbox.put_nowait(proto)
        return inbox

    def release(self, request_id: str) -> None:
        """The request is over (final response or an error seen): forget it."""
        stream = self._stream
        if stream is not None:
            stream.inboxes.pop(request_id, None)

    def abandon(self, request_id: str, stop: service_pb2.ModelInferRequest) -> None:
        """The consumer left before the final response: forget it and stop it at the engine."""
        stream = self._stream
        if stream is not None and stream.inboxes.pop(request_id, None) is not None:
            stream.outbox.put_nowait(stop)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self._fail(stream, self._unavailable("engine client closed"))
            for task in (stream.writer, stream.reader):
                if task is not None:
                    task.cancel()

    # internals -----------------------------------------------------------------------
    def _start(self) -> _Stream:
        stream = _Stream(self._open_call())
        stream.writer = asyncio.create_task(self._write(stream), name="engine-stream-writer")
        stream.reader = asyncio.create_task(self._read(stream), name="engine-stream-reader")
        return stream

    def _fail(self, stream: _Stream, error: Exception) -> None:
        """Every open request of ``stream`` gets ``error``; the next request opens a new stream."""
        if stream.failed:
            return
        stream.failed = True
        if self._stream is stream:
            self._stream = None
        inboxes, stream.inboxes = stream.inboxes, {}
        for inbox in inboxes.values():
            inbox.put(error)
        stream.call.cancel()

    async def _write(self, stream: _Stream) -> None:
        call, outbox = stream.call, stream.outbox
        try:
            while True:
                proto = await outbox.get()
                await call.write(proto)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke: the reader sees why; fail now in case it does not
            self._fail(stream, self._classify(exc))

    async def _read(self, stream: _Stream) -> None:
        call, eof = stream.call, grpc.aio.EOF
        try:
            while True:
                message = await call.read()
                if message is eof:
                    break
                inbox = stream.inboxes.get(message.infer_response.id)
                if inbox is not None:
                    inbox.put(message)
                elif message.error_message and not message.infer_response.id:
                    log.warning("engine stream error without a request id: %s", message.error_message)
            error = self._unavailable("engine closed the stream before its final response")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = self._classify(exc)
        self._fail(stream, error)
