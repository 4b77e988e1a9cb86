"""The one-message contract the gateway's unary path relies on (server/gateway/replicas/engine_client.py).

A request with ``streaming`` false gets exactly one ``ModelStreamInfer`` message, final or an
error, whatever ends it: its answer, a bad input, a ``stop`` (both the stopped request and
the stop call), a stats call. Every message of the call is read, up to the end of the
stream, so an extra one would be counted. The same holds for ``bench/server/fixed_engine.py``.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench.server.fixed_engine import FixedModel
from engines.contract import encode_request
from server.gateway.replicas.engine_client import _request_proto
from tests.engines.reference.helpers import MODEL, chat_ids, make_request

METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def _proto(tensors: dict[str, np.ndarray], request_id: str) -> service_pb2.ModelInferRequest:
    return _request_proto(MODEL, request_id, tensors)  # the gateway's own encoding


async def _every_message(url: str, request: service_pb2.ModelInferRequest) -> list[service_pb2.ModelStreamInferResponse]:
    """One request, half-closed, and every message up to the end of the stream (as the gateway calls it)."""
    async with grpc.aio.insecure_channel(url) as channel:
        call = channel.unary_stream(METHOD, request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                    response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        return [message async for message in call(request, timeout=60)]


def _generated(message) -> int:
    names = [o.name for o in message.infer_response.outputs]
    return int(np.frombuffer(message.infer_response.raw_output_contents[names.index("sequence_length")], "<i4")[0])


def _one_final(messages) -> service_pb2.ModelStreamInferResponse:
    assert len(messages) == 1, [m.error_message or m.infer_response.parameters for m in messages]
    [message] = messages
    if not message.error_message:
        assert message.infer_response.parameters["triton_final_response"].bool_param
    return message


async def test_reference_server_sends_one_message_for_a_non_streaming_request(fp8_server, tokenizer):
    ids = chat_ids(tokenizer, "Name a planet.")
    answer = _one_final(await _every_message(fp8_server.url, _proto(encode_request(make_request(ids, 6)), "a")))
    assert not answer.error_message
    bad = {**encode_request(make_request(ids, 6)), "input_ids": np.array([], np.int32)}
    error = _one_final(await _every_message(fp8_server.url, _proto(bad, "b")))
    assert "input_ids" in error.error_message
    stats = _one_final(await _every_message(fp8_server.url, _proto({"kv_stats": np.array([True])}, "s")))
    assert not stats.error_message


async def test_reference_server_sends_one_message_to_a_stopped_non_streaming_request_and_its_stop(fp8_server, tokenizer):
    request = make_request(chat_ids(tokenizer, "Tell me a long story about a dragon."), 64, end_id=-1)
    running = asyncio.create_task(_every_message(fp8_server.url, _proto(encode_request(request), "story-2")))
    for _ in range(400):  # poll until the engine holds it (no timing assumption on the answer)
        if fp8_server.engine.in_flight() > 0 or running.done():
            break
        await asyncio.sleep(0.01)
    stop = {**encode_request(request), "stop": np.array([True])}
    stopped = _one_final(await _every_message(fp8_server.url, _proto(stop, "story-2")))
    assert not stopped.error_message
    answer = _one_final(await running)
    assert not answer.error_message
    assert _generated(answer) < 64  # the stop reached it in flight


async def test_fixed_engine_sends_one_message_for_a_non_streaming_request():
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(FixedModel(list(range(10, 26))), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        url = f"127.0.0.1:{port}"
        answer = _one_final(await _every_message(url, _proto(encode_request(make_request((1, 2, 3), 16)), "f")))
        assert not answer.error_message
        streamed = await _every_message(url, _proto(encode_request(make_request((1, 2, 3), 16, streaming=True)), "g"))
        assert len(streamed) == 16  # the stream path is unchanged: one message per token
    finally:
        await server.stop(0)
