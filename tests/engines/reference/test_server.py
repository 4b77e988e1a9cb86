"""End to end through tritonclient against a real reference server (real forward passes)."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from engines.contract import encode_request
from tests.engines.reference.helpers import (
    MODEL, chat_ids, document, infer, make_request, stats, stream, to_inputs, unique_salt,
)

pytestmark = pytest.mark.slow


def test_health_metadata_and_config(fp8_server):
    client = grpcclient.InferenceServerClient(fp8_server.url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready(MODEL)
        assert not client.is_model_ready("some_other_model")
        metadata = client.get_model_metadata(MODEL)
        names = {t.name: t.datatype for t in metadata.inputs}
        assert names["input_ids"] == "INT32" and names["cache_salt"] == "BYTES"
        assert "retention_token_range_durations_ms" in names and "tenant_id" in names
        assert {t.name for t in metadata.outputs} >= {"output_ids", "kv_cache_onboarded_blocks", "kv_cache_stats"}
        config = client.get_model_config(MODEL).config
        assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata("nope")
        assert "unknown model" in info.value.message()
    finally:
        client.close()


def test_france_answer_mentions_paris_unary_and_stream(fp8_server, tokenizer):
    request = make_request(chat_ids(tokenizer, "What is the capital of France?"), 16)
    unary = infer(fp8_server.url, request)
    assert "Paris" in tokenizer.decode(unary.tokens)
    assert unary.sequence_length == len(unary.tokens) and 2 not in unary.tokens  # end id excluded

    async def run():
        client = grpcaio.InferenceServerClient(fp8_server.url)
        try:
            return await stream(client, dataclasses.replace(request, streaming=True))
        finally:
            await client.close()

    import asyncio

    streamed = asyncio.run(run())
    assert streamed.tokens == unary.tokens  # greedy, same KV dtype: same answer
    assert streamed.responses >= len(streamed.tokens)  # one response per token (+ a final one)


def test_shared_prefix_reuse_and_salt_isolation(fp8_server, tokenizer):
    doc = document("reuse")
    salt = unique_salt()
    first = infer(fp8_server.url, make_request(chat_ids(tokenizer, doc + " Which river is named first?"), 4, salt=salt))
    prefix_tokens = len(chat_ids(tokenizer, doc))
    assert prefix_tokens > 300
    second = infer(fp8_server.url, make_request(chat_ids(tokenizer, doc + " Which harbor is named last?"), 4, salt=salt))
    assert first.kv.reused_blocks == 0
    assert second.kv.reused_blocks >= (prefix_tokens - 8) // 32  # every full block of the shared prefix
    prompt_blocks = -(-len(chat_ids(tokenizer, doc + " Which harbor is named last?")) // 32)
    assert second.kv.reused_blocks + second.kv.new_blocks == prompt_blocks  # new: the prompt blocks computed
    # taken from the free pool at admission (addSequence): misses and onboards, no reused GPU block
    assert second.kv.total_blocks == second.kv.new_blocks + second.kv.onboarded_blocks
    other = infer(fp8_server.url, make_request(chat_ids(tokenizer, doc + " Which harbor is named last?"), 4, salt=unique_salt()))
    assert other.kv.reused_blocks == 0
    # The same salt again hits, so the miss above was the salt, not eviction.
    again = infer(fp8_server.url, make_request(chat_ids(tokenizer, doc + " Which harbor is named last?"), 4, salt=salt))
    assert again.kv.reused_blocks >= second.kv.reused_blocks


def test_stats_call_reports_tenants_and_tiers(fp8_server, tokenizer):
    infer(fp8_server.url, make_request(chat_ids(tokenizer, document("stats", 6)), 2, tenant="tenant-stats", salt=unique_salt()))
    report = stats(fp8_server.url)
    assert report.tokens_per_block == 32 and report.primary.max_blocks == 40
    assert report.secondary.max_blocks == 64
    assert report.primary.used_blocks == 0  # idle: nothing referenced, cached blocks are free
    assert report.tenants["tenant-stats"][0] > 0
    assert report.secondary_offload_min_priority == 30


BAD_CASES = {
    "unequal retention arrays": ({"retention_token_range_starts": np.array([0, 4], np.int32),
                                  "retention_token_range_ends": np.array([4], np.int32),
                                  "retention_token_range_priorities": np.array([50, 50], np.int32)},
                                 "retention_token_range_ends"),
    "priority above 100": ({"retention_token_range_starts": np.array([0], np.int32),
                            "retention_token_range_ends": np.array([-1], np.int32),
                            "retention_token_range_priorities": np.array([101], np.int32)},
                           "priority"),
    "negative decode priority": ({"retention_decode_priority": np.array([-1], np.int32)}, "decode_priority"),
    "empty input_ids": ({"input_ids": np.array([], np.int32)}, "input_ids"),
    "output length beyond the limit": ({"request_output_len": np.array([10_000], np.int32)}, "request_output_len"),
    "token id outside the vocabulary": ({"input_ids": np.array([1, 49152], np.int32)}, "input_ids"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_is_a_clear_grpc_error_and_the_server_keeps_serving(fp8_server, tokenizer, case):
    overrides, named = BAD_CASES[case]
    good = make_request(chat_ids(tokenizer, "Say hi."), 2)
    tensors = {**encode_request(good), **overrides}
    client = grpcclient.InferenceServerClient(fp8_server.url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer(MODEL, to_inputs(tensors))
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert named in info.value.message()
        result = client.infer(MODEL, to_inputs(encode_request(good)))
        assert result.as_numpy("sequence_length")[0] >= 1
    finally:
        client.close()


def test_unknown_model_and_wrong_datatype(fp8_server, tokenizer):
    good = make_request(chat_ids(tokenizer, "Say hi."), 2)
    client = grpcclient.InferenceServerClient(fp8_server.url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer("not_a_model", to_inputs(encode_request(good)))
        assert info.value.status() == "StatusCode.NOT_FOUND" and "not_a_model" in info.value.message()
        wrong = grpcclient.InferInput("input_ids", [3], "INT64")
        wrong.set_data_from_numpy(np.array([1, 2, 3], np.int64))
        length = grpcclient.InferInput("request_output_len", [1], "INT32")
        length.set_data_from_numpy(np.array([2], np.int32))
        with pytest.raises(InferenceServerException) as info:
            client.infer(MODEL, [wrong, length])
        assert "input_ids" in info.value.message() and "INT32" in info.value.message()
        unknown = grpcclient.InferInput("mystery", [1], "INT32")
        unknown.set_data_from_numpy(np.array([1], np.int32))
        with pytest.raises(InferenceServerException) as info:
            client.infer(MODEL, to_inputs(encode_request(good)) + [unknown])
        assert "mystery" in info.value.message()
        assert client.infer(MODEL, to_inputs(encode_request(good))).as_numpy("sequence_length")[0] >= 1
    finally:
        client.close()


async def test_stream_error_response_then_stream_keeps_serving(fp8_server, tokenizer):
    good = make_request(chat_ids(tokenizer, "Say hi."), 3, streaming=True)
    bad = {**encode_request(good), "input_ids": np.array([], np.int32)}

    async def requests():
        yield {"model_name": MODEL, "inputs": to_inputs(bad), "request_id": "bad"}
        yield {"model_name": MODEL, "inputs": to_inputs(encode_request(good)), "request_id": "good"}

    client = grpcaio.InferenceServerClient(fp8_server.url)
    errors, finals = [], []
    try:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                errors.append(error.message())
                continue
            if result.get_response().parameters["triton_final_response"].bool_param:
                finals.append(result.get_response().id)
                break
    finally:
        await client.close()
    assert len(errors) == 1 and "input_ids" in errors[0]
    assert finals == ["good"]


async def test_raw_and_typed_contents_are_both_read(fp8_server, tokenizer):
    """A client that fills ``contents`` instead of ``raw_input_contents`` gets the same answer."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    ids = chat_ids(tokenizer, "What is the capital of France?")
    expected = infer(fp8_server.url, make_request(ids, 6)).tokens
    request = service_pb2.ModelInferRequest(model_name=MODEL, id="typed")
    tensor = request.inputs.add(name="input_ids", datatype="INT32", shape=[len(ids)])
    tensor.contents.int_contents.extend(ids)
    tensor = request.inputs.add(name="request_output_len", datatype="INT32", shape=[1])
    tensor.contents.int_contents.append(6)
    tensor = request.inputs.add(name="end_id", datatype="INT32", shape=[1])
    tensor.contents.int_contents.append(2)
    tensor = request.inputs.add(name="tenant_id", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"tenant-a")
    async with grpc.aio.insecure_channel(fp8_server.url) as channel:
        response = await service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    names = [o.name for o in response.outputs]
    raw = response.raw_output_contents[names.index("output_ids")]
    assert np.frombuffer(raw, "<i4").tolist() == expected


async def test_unary_with_streaming_true_and_stream_with_streaming_false(fp8_server, tokenizer):
    """Both transports give the same tokens whatever ``streaming`` says; only the framing differs."""
    request = make_request(chat_ids(tokenizer, "Name a planet."), 6, end_id=-1)
    expected = infer(fp8_server.url, request).tokens
    assert len(expected) == 6
    merged = infer(fp8_server.url, dataclasses.replace(request, streaming=True))
    assert merged.tokens == expected and merged.sequence_length == 6

    async def requests():
        yield {"model_name": MODEL, "inputs": to_inputs(encode_request(request)), "request_id": "whole"}

    client = grpcaio.InferenceServerClient(fp8_server.url)
    responses = []
    try:
        async for result, error in client.stream_infer(requests()):
            assert error is None
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        await client.close()
    assert len(responses) == 1 and responses[0].as_numpy("output_ids").tolist() == expected


def test_unary_streaming_true_with_only_some_outputs_requested(fp8_server, tokenizer):
    """ModelInfer merges a streamed request's deltas before selecting the requested outputs (the
    merge needs sequence_length and the KV metrics even when the client asked for output_ids only)."""
    request = make_request(chat_ids(tokenizer, "Name a colour."), 5, end_id=-1)
    client = grpcclient.InferenceServerClient(fp8_server.url)
    try:
        answers = {}
        for streaming in (False, True):
            for wanted in (["output_ids"], ["sequence_length", "kv_cache_alloc_total_blocks"]):
                result = client.infer(MODEL, to_inputs(encode_request(dataclasses.replace(request, streaming=streaming))),
                                      outputs=[grpcclient.InferRequestedOutput(n) for n in wanted])
                got = {o.name for o in result.get_response().outputs}
                assert got == set(wanted)
                assert "triton_final_response" not in result.get_response().parameters
                answers[streaming, tuple(wanted)] = {n: result.as_numpy(n).tolist() for n in wanted}
    finally:
        client.close()
    for wanted in (("output_ids",), ("sequence_length", "kv_cache_alloc_total_blocks")):
        assert answers[True, wanted] == answers[False, wanted]
    assert len(answers[True, ("output_ids",)]["output_ids"]) == 5
    assert answers[True, ("sequence_length", "kv_cache_alloc_total_blocks")]["sequence_length"] == [5]
