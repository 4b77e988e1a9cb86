"""Continuous batching, cancellation, queueing and host-tier offload through tritonclient."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio

from engines.contract import encode_request
from engines.reference.config import ReferenceEngineConfig
from tests.engines.reference.conftest import start_in_thread, stop_in_thread
from tests.engines.reference.helpers import (
    MODEL, chat_ids, document, infer, make_request, stats, stream, to_inputs, unique_salt,
)

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is 2+2?", "Name a color.", "What is the capital of Italy?", "Say hello.", "What is water?",
    "Who wrote Hamlet?", "What is the capital of Spain?", "Count to three.", "Name a fruit.", "What is a cat?",
]


async def test_ten_concurrent_streams_match_solo_runs(fp32_server, tokenizer):
    requests = [make_request(chat_ids(tokenizer, q), 8, salt=unique_salt()) for q in QUESTIONS]
    solo = [infer(fp32_server.url, r).tokens for r in requests]
    assert len({tuple(s) for s in solo}) == len(solo)  # the prompts really differ
    client = grpcaio.InferenceServerClient(fp32_server.url)
    try:
        results = await asyncio.gather(*[
            stream(client, dataclasses.replace(r, streaming=True), f"c{i}") for i, r in enumerate(requests)
        ])
    finally:
        await client.close()
    assert [r.tokens for r in results] == solo
    assert fp32_server.engine.steps > 0


async def test_cancelling_one_stream_returns_the_pool_to_idle(fp8_server, tokenizer):
    idle = stats(fp8_server.url)
    assert idle.primary.used_blocks == 0
    requests = [make_request(chat_ids(tokenizer, q), 48, streaming=True, end_id=-1, salt=unique_salt())
                for q in QUESTIONS[:4]]
    client = grpcaio.InferenceServerClient(fp8_server.url)
    try:
        async def one_request(request):
            yield {"model_name": MODEL, "inputs": to_inputs(encode_request(request)), "request_id": "victim"}

        victim = client.stream_infer(one_request(requests[0]))
        others = [asyncio.create_task(stream(client, r)) for r in requests[1:]]
        seen = 0
        async for result, error in victim:
            assert error is None
            seen += len(result.as_numpy("output_ids"))
            if seen >= 2:
                break
        victim.cancel()
        done = await asyncio.gather(*others)
    finally:
        await client.close()
    assert all(len(g.tokens) == 48 for g in done)  # end_id -1: every request runs to its length
    for _ in range(100):  # the engine applies the cancel between steps
        if fp8_server.engine.in_flight() == 0:
            break
        await asyncio.sleep(0.05)
    after = stats(fp8_server.url)
    assert fp8_server.engine.in_flight() == 0
    assert after.primary.used_blocks == 0 and after.primary.free_blocks == after.primary.max_blocks


async def test_stop_input_cancels_the_request_with_the_same_id(fp8_server, tokenizer):
    request = make_request(chat_ids(tokenizer, "Tell me a long story about a dragon."), 64, streaming=True, end_id=-1)
    stop = {**encode_request(request), "stop": np.array([True])}
    client = grpcaio.InferenceServerClient(fp8_server.url)
    try:
        async def requests():
            yield {"model_name": MODEL, "inputs": to_inputs(encode_request(request)), "request_id": "story-1"}

        tokens = []
        stopped = False
        async for result, error in client.stream_infer(requests()):
            assert error is None
            tokens.extend(result.as_numpy("output_ids").tolist())
            if len(tokens) >= 2 and not stopped:
                stopped = True
                await client.infer(MODEL, to_inputs(stop), request_id="story-1")
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        await client.close()
    assert 2 <= len(tokens) < 64
    assert stats(fp8_server.url).primary.used_blocks == 0


def test_requests_queue_when_kv_is_short(bundle, tokenizer):
    """Six prompts of ~4 blocks against a 6-block pool: they queue and all finish correctly."""
    config = ReferenceEngineConfig(
        kv_dtype="fp32", primary_blocks=6, secondary_blocks=0, tokens_per_block=32,
        max_input_len=150, max_output_len=24, max_num_tokens=128,
    )
    handle, thread = start_in_thread(config, bundle)
    try:
        prompts = [chat_ids(tokenizer, document(f"queue{i}", 5) + " Summarize.") for i in range(6)]
        assert all(96 < len(p) <= 150 for p in prompts)
        requests = [make_request(p, 24, end_id=-1) for p in prompts]
        solo = [infer(handle.url, r).tokens for r in requests[:2]]

        async def run_all():
            client = grpcaio.InferenceServerClient(handle.url)
            try:
                return await asyncio.gather(*[
                    stream(client, dataclasses.replace(r, streaming=True)) for r in requests
                ])
            finally:
                await client.close()

        results = asyncio.run(run_all())
        assert all(len(r.tokens) == 24 for r in results)
        assert [r.tokens for r in results[:2]] == solo
        assert stats(handle.url).primary.used_blocks == 0
    finally:
        stop_in_thread(handle, thread)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp32"])
def test_offloaded_prefix_is_onboarded_with_identical_output(bundle, tokenizer, kv_dtype):
    """Cold run, warm (GPU-tier) run, evict to host with fillers, host-tier run."""
    config = ReferenceEngineConfig(
        kv_dtype=kv_dtype, primary_blocks=24, secondary_blocks=48, tokens_per_block=32,
        max_input_len=512, max_output_len=16, secondary_offload_min_priority=30,
    )
    handle, thread = start_in_thread(config, bundle)
    try:
        ids = chat_ids(tokenizer, document("offload", 14) + " Which lighthouse is mentioned?")
        assert len(ids) > 300
        request = make_request(ids, 12, end_id=-1)
        cold = infer(handle.url, request)
        warm = infer(handle.url, request)
        assert warm.kv.reused_blocks == (len(ids) - 1) // 32 and warm.kv.onboarded_blocks == 0
        for i in range(3):  # fillers with new content push the prefix out of the primary tier
            infer(handle.url, make_request(chat_ids(tokenizer, document(f"filler{i}", 20)), 1))
        report = stats(handle.url)
        assert report.offloaded_blocks >= warm.kv.reused_blocks
        hosted = infer(handle.url, request)
        assert hosted.kv.onboarded_blocks > 0
        assert hosted.kv.reused_blocks == warm.kv.reused_blocks
        assert hosted.tokens == warm.tokens
        if kv_dtype == "fp32":
            assert hosted.tokens == cold.tokens
        assert stats(handle.url).onboarded_blocks >= hosted.kv.onboarded_blocks
    finally:
        stop_in_thread(handle, thread)


def test_a_prompt_is_reusable_once_its_prefill_ends_not_when_its_request_does(bundle, tokenizer):
    """As TensorRT-LLM stores context blocks at the end of the context phase: a request sharing a
    running request's prompt reuses its full blocks (all but the last token's) while it decodes."""
    config = ReferenceEngineConfig(kv_dtype="fp32", primary_blocks=32, secondary_blocks=0, tokens_per_block=32,
                                   max_input_len=200, max_output_len=64, max_num_tokens=256)
    handle, thread = start_in_thread(config, bundle)
    try:
        prompt = chat_ids(tokenizer, document("reuse-early", 5) + " Summarize.")
        salt = unique_salt()
        first = dataclasses.replace(make_request(prompt, 64, end_id=-1, salt=salt), streaming=True)

        async def run() -> tuple[int, int]:
            client = grpcaio.InferenceServerClient(handle.url)
            try:
                async def requests():
                    yield {"model_name": MODEL, "inputs": to_inputs(encode_request(first)), "request_id": "long"}

                seen = 0
                twin = None
                still_running = False
                async for result, error in client.stream_infer(requests()):
                    assert error is None, error
                    seen += len(result.as_numpy("output_ids").tolist())
                    if twin is None:  # the first token: the prefill is done, the request runs on
                        twin = await asyncio.to_thread(infer, handle.url, make_request(prompt, 1, salt=salt))
                        still_running = handle.running.engine.in_flight() == 1  # the first, past the twin
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        break
                assert still_running, "the first request ended before its twin was served: nothing shown"
                return seen, twin.kv.reused_blocks
            finally:
                await client.close()

        generated, reused = asyncio.run(run())
        assert generated == 64
        assert reused == (len(prompt) - 1) // 32 >= 3
    finally:
        stop_in_thread(handle, thread)
