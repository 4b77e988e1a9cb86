"""Requests the server must refuse or fail, over real gRPC: each one is answered (never left
waiting), with the request's id on a stream, and the server keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from engines.contract import ContractError, encode_request
from engines.reference.kserve import decode_inputs
from tests.engines.reference.helpers import MODEL, chat_ids, make_request, to_inputs

ANSWER_WITHIN_S = 30.0
SHAPES_NO_PAYLOAD_FITS = {
    "count overflows int64": [2**33, 2**31],
    "count is exactly 2**64": [2**32, 2**32],
    "count wraps to 2**64": [2**62, 4],
    "zero elements, a dimension numpy cannot allocate": [0, 2**62],
    "zero elements, more dimensions than numpy has": [0] * 70,
}


def _request(request_id: str, input_ids_shape: list[int], *, typed: bool = False) -> service_pb2.ModelInferRequest:
    """A generation request whose input_ids claim ``input_ids_shape`` but carry no element."""
    request = service_pb2.ModelInferRequest(model_name=MODEL, id=request_id)
    request.inputs.add(name="input_ids", datatype="INT32", shape=input_ids_shape)
    length = request.inputs.add(name="request_output_len", datatype="INT32", shape=[1])
    if typed:
        length.contents.int_contents.append(2)
    else:
        request.raw_input_contents.extend([b"", np.array([2], "<i4").tobytes()])
    return request


def _proto(request, request_id: str) -> service_pb2.ModelInferRequest:
    """``request`` as a raw ModelInferRequest, encoded as tritonclient does (raw contents)."""
    proto = service_pb2.ModelInferRequest(model_name=MODEL, id=request_id)
    for name, array in encode_request(request).items():
        datatype = to_inputs({name: array})[0].datatype()
        proto.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        proto.raw_input_contents.append(
            serialize_byte_tensor(array).item() if datatype == "BYTES" else np.ascontiguousarray(array).tobytes()
        )
    return proto


async def _first_stream_answer(url: str, request: service_pb2.ModelInferRequest) -> service_pb2.ModelStreamInferResponse:
    """The first response on a stream that stays open (as the gateway keeps it until the final
    response); fails the test instead of hanging when the request is never answered."""
    async with grpc.aio.insecure_channel(url) as channel:
        release = asyncio.Event()

        async def requests():
            yield request
            await release.wait()

        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
        try:
            return await asyncio.wait_for(call.read(), ANSWER_WITHIN_S)
        finally:
            release.set()
            call.cancel()


async def _unary(url: str, request: service_pb2.ModelInferRequest) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(url) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request), ANSWER_WITHIN_S)
    return info.value


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
@pytest.mark.parametrize("case", sorted(SHAPES_NO_PAYLOAD_FITS))
def test_decode_refuses_a_shape_its_contents_cannot_take_naming_the_tensor(case, typed):
    """A ContractError, never numpy's ValueError (which no caller turns into INVALID_ARGUMENT)."""
    with pytest.raises(ContractError) as info:
        decode_inputs(_request("r", SHAPES_NO_PAYLOAD_FITS[case], typed=typed))
    assert info.value.tensor == "input_ids" and "input_ids" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
@pytest.mark.parametrize("shape", [[2**33, 2**31], [2**32, 2**32], [2**62, 4]], ids=str)
async def test_a_shape_whose_element_count_overflows_is_refused_naming_the_tensor(fp8_server, tokenizer, shape, typed):
    """An element count past int64 (it used to wrap to 0 and pass the size check) is refused on
    both paths; the stream answers it instead of leaving it unanswered."""
    answer = await _first_stream_answer(fp8_server.url, _request("overflow", shape, typed=typed))
    assert "input_ids" in answer.error_message
    assert answer.infer_response.id == "overflow"
    error = await _unary(fp8_server.url, _request("overflow", shape, typed=typed))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids" in error.details()
    assert "Paris" in _ask_paris(fp8_server.url, tokenizer)


def _ask_paris(url: str, tokenizer) -> str:
    request = make_request(chat_ids(tokenizer, "What is the capital of France? One word."), 6)
    client = grpcclient.InferenceServerClient(url)
    try:
        result = client.infer(MODEL, to_inputs(encode_request(request)))
    finally:
        client.close()
    return tokenizer.decode(result.as_numpy("output_ids").tolist())


@pytest.mark.slow
async def test_an_unexpected_server_error_is_answered_internal_and_on_the_stream(fp8_server, monkeypatch):
    """Any exception while serving a request, not only a refusal, answers it: INTERNAL on the
    unary path, an error_message with the request's id on a stream."""
    def broken(*args, **kwargs):
        raise RuntimeError("injected stats failure")

    monkeypatch.setattr(fp8_server.engine, "stats", broken)
    stats = service_pb2.ModelInferRequest(model_name=MODEL, id="stats-1")
    stats.inputs.add(name="kv_stats", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    answer = await _first_stream_answer(fp8_server.url, stats)
    assert "injected stats failure" in answer.error_message
    assert answer.infer_response.id == "stats-1"
    error = await _unary(fp8_server.url, stats)
    assert error.code() == grpc.StatusCode.INTERNAL and "injected stats failure" in error.details()


@pytest.mark.slow
async def test_a_stream_error_names_the_request_it_belongs_to(fp8_server):
    """Like Triton's stream handler, the error response carries the failed request's id (and the
    model), so a client multiplexing requests on one stream knows which one failed."""
    bad = service_pb2.ModelInferRequest(model_name=MODEL, id="bad-42")
    bad.inputs.add(name="input_ids", datatype="INT32", shape=[1]).contents.int_contents.append(5)
    bad.inputs.add(name="request_output_len", datatype="INT32", shape=[1]).contents.int_contents.append(0)
    answer = await _first_stream_answer(fp8_server.url, bad)
    assert "request_output_len" in answer.error_message
    assert answer.infer_response.id == "bad-42"
    assert answer.infer_response.model_name == MODEL and answer.infer_response.model_version == "1"


@pytest.mark.slow
async def test_a_requested_output_the_model_lacks_is_refused_before_generating(fp8_server, tokenizer):
    """Triton refuses an "unexpected inference output"; it used to be dropped silently."""
    steps = fp8_server.engine.steps
    request = make_request(chat_ids(tokenizer, "Say hi."), 2)
    client = grpcclient.InferenceServerClient(fp8_server.url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer(MODEL, to_inputs(encode_request(request)), outputs=[
                grpcclient.InferRequestedOutput("output_ids"), grpcclient.InferRequestedOutput("no_such_output"),
            ])
    finally:
        client.close()
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "no_such_output" in info.value.message()
    stream_request = _proto(request, "streamed")
    stream_request.outputs.add(name="no_such_output")
    answer = await _first_stream_answer(fp8_server.url, stream_request)
    assert "no_such_output" in answer.error_message and answer.infer_response.id == "streamed"
    assert fp8_server.engine.steps == steps

