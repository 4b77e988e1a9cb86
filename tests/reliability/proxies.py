"""The two proxies of the reliability suite: they see what the engine and the database see.

* :class:`CountingProxy` sits between gateway and engine (KServe v2 gRPC) and counts,
  per ``tenant_id`` tensor, the requests the engine is working on, so concurrency
  limits are checked where they matter: at the engine. It also keeps every call's
  prompt and generated tokens, so streams can be compared with what was generated.
* :class:`TcpCut` forwards TCP to PostgreSQL and can be cut (every connection reset,
  new ones refused) and restored, which is what a database outage looks like to us.
"""

from __future__ import annotations

import socket
import threading
import time
from array import array
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from tritonclient.grpc import service_pb2_grpc

from tests.server.gateway.recording_proxy import RecordingProxy
from tests.server.gateway.stack import free_port


# Engine-side counting proxy ------------------------------------------------------------------
def _tenant_of(request) -> str | None:
    for index, tensor in enumerate(request.inputs):
        if tensor.name == "tenant_id" and index < len(request.raw_input_contents):
            raw = request.raw_input_contents[index]
            size = int.from_bytes(raw[:4], "little")  # KServe BYTES: 4-byte length, then the bytes
            return raw[4:4 + size].decode()
    return None


def _ints(raw: bytes) -> tuple[int, ...]:
    return tuple(array("i", raw))


def _input_ids(request) -> tuple[int, ...] | None:
    for index, tensor in enumerate(request.inputs):
        if tensor.name == "input_ids" and index < len(request.raw_input_contents):
            return _ints(request.raw_input_contents[index])
    return None


def _output_ids(response) -> tuple[int, ...]:
    infer = response.infer_response
    for index, tensor in enumerate(infer.outputs):
        if tensor.name == "output_ids" and index < len(infer.raw_output_contents):
            return _ints(infer.raw_output_contents[index])
    return ()


@dataclass
class EngineCall:
    """One generation request as the engine saw it: who, which prompt, which tokens came back."""

    tenant_id: str
    input_ids: tuple[int, ...]
    output_ids: list[int] = field(default_factory=list)
    final: bool = False
    arrived: float = 0.0  # time.monotonic() at the proxy (one clock for every process on the host)
    first_response: float | None = None  # when the engine's first response passed the proxy
    ended: float | None = None  # when the call stopped counting as in flight


def _is_final(response) -> bool:
    param = response.infer_response.parameters.get("triton_final_response")
    return bool(param.bool_param) if param is not None else True


class CountingProxy(RecordingProxy):
    """Forwards to the engine and tracks, per tenant id, generation requests in progress.

    A request counts from its arrival at the proxy until the proxy forwards its final
    response (or the call ends): the gateway releases a tenant's concurrency lease only
    after it has read that final response, so a correct gateway never makes the count
    exceed the tenant's limit, with no race in the measurement itself.
    """

    def __init__(self, upstream: str, *, record: bool = False) -> None:
        super().__init__(upstream)
        self._record = record
        self.in_flight: dict[str, int] = defaultdict(int)
        self.max_in_flight: dict[str, int] = defaultdict(int)
        self.started: dict[str, int] = defaultdict(int)
        self.finished: dict[str, int] = defaultdict(int)
        self.responses: dict[str, int] = defaultdict(int)
        self.calls: list[EngineCall] = []  # every generation call, in arrival order

    async def ModelStreamInfer(self, request_iterator, context):
        tenants: list[str] = []
        open_: set[str] = set()
        calls: list[EngineCall] = []

        async def forward():
            async for request in request_iterator:
                if self._record:
                    self.requests.append(request)
                tenant_id = _tenant_of(request)
                if tenant_id is not None:
                    tenants.append(tenant_id)
                    self.started[tenant_id] += 1
                    self.in_flight[tenant_id] += 1
                    self.max_in_flight[tenant_id] = max(self.max_in_flight[tenant_id], self.in_flight[tenant_id])
                    open_.add(tenant_id)
                    call = EngineCall(tenant_id, _input_ids(request) or (), arrived=time.monotonic())
                    calls.append(call)
                    self.calls.append(call)
                yield request

        def close(tenant_id: str) -> None:
            if tenant_id in open_:
                open_.discard(tenant_id)
                for call in calls:
                    if call.tenant_id == tenant_id and call.ended is None:
                        call.ended = time.monotonic()
                self.in_flight[tenant_id] -= 1
                self.finished[tenant_id] += 1

        try:
            async for response in self._stub.ModelStreamInfer(forward()):
                if tenants:
                    self.responses[tenants[-1]] += 1
                    if calls[-1].first_response is None:
                        calls[-1].first_response = time.monotonic()
                    calls[-1].output_ids.extend(_output_ids(response))
                    if _is_final(response):
                        calls[-1].final = True
                        close(tenants[-1])
                yield response
        finally:
            for tenant_id in list(open_):
                close(tenant_id)


async def start_counting_proxy(upstream: str, *, port: int = 0) -> tuple[grpc.aio.Server, CountingProxy, int]:
    proxy = CountingProxy(upstream)
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(proxy, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, proxy, bound


def run_counting_proxy_in_thread(upstream: str) -> tuple[CountingProxy, int, Callable[[], None]]:
    """The proxy on its own event loop thread (for tests whose clients are synchronous)."""
    import asyncio

    loop = asyncio.new_event_loop()
    started: dict = {}
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        server, proxy, port = loop.run_until_complete(start_counting_proxy(upstream))
        started.update(server=server, proxy=proxy, port=port)
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(30)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(started["server"].stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return started["proxy"], started["port"], stop


# Cuttable TCP proxy --------------------------------------------------------------------------
class TcpCut:
    """TCP forwarder to ``upstream_port`` on loopback; :meth:`cut` makes the upstream vanish (resets,
    refused connections); :meth:`stall` makes it go silent instead (no byte moves either way and new
    connections are accepted but unanswered, no reset: a partition or a frozen server) until
    :meth:`resume`, which moves them again, held connections included."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stalled = threading.Event()
        self._held: list[socket.socket] = []

    def start(self) -> TcpCut:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._thread.start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self._stalled.is_set():
                    self._held.append(client)
                    continue
            self._connect(client)

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._sockets.update((client, upstream))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self._stalled.is_set():
                    time.sleep(0.02)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """Refuse new connections and reset every open one (a database that went away)."""
        # Why shutdown before close: close() alone does not wake a thread blocked in
        # accept()/recv() on Linux, and the socket would keep working.
        if self._listener is not None:
            _hard_close(self._listener)
            self._listener = None
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for s in sockets:
            _hard_close(s, reset=True)

    def restore(self) -> None:
        self.start()

    def stall(self) -> None:
        self._stalled.set()

    def resume(self) -> None:
        with self._lock:
            self._stalled.clear()
            held, self._held = self._held, []
        for client in held:
            self._connect(client)

    def close(self) -> None:
        self.resume()
        self.cut()


def _hard_close(sock: socket.socket, *, reset: bool = False) -> None:
    try:
        if reset:  # linger 0: the peer sees a reset, as when a server dies
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
