"""A KServe v2 pass-through proxy that records every request it forwards.

Placed between the gateway and the real reference engine, it lets a test read the
exact tensors the engine received, without any hook inside either of them.
"""

from __future__ import annotations

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc


class RecordingProxy(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, upstream: str) -> None:
        self._channel = grpc.aio.insecure_channel(upstream)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self.requests: list[service_pb2.ModelInferRequest] = []

    async def ServerLive(self, request, context):
        return await self._stub.ServerLive(request)

    async def ServerReady(self, request, context):
        return await self._stub.ServerReady(request)

    async def ModelReady(self, request, context):
        return await self._stub.ModelReady(request)

    async def ModelInfer(self, request, context):
        self.requests.append(request)
        return await self._stub.ModelInfer(request)

    async def ModelStreamInfer(self, request_iterator, context):
        async def forward():
            async for request in request_iterator:
                self.requests.append(request)
                yield request

        async for response in self._stub.ModelStreamInfer(forward()):
            yield response


async def start_proxy(upstream: str) -> tuple[grpc.aio.Server, RecordingProxy, int]:
    proxy = RecordingProxy(upstream)
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(proxy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, proxy, port
