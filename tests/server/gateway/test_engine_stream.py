"""The engine client's shared ``ModelStreamInfer`` stream (``replicas/engine_stream.py``),
against the fixed benchmark engine served in-process over real gRPC: many requests on one
stream each get their own answer, an abandoned request is stopped by id without disturbing
the others, a refused request fails alone, and a dead stream fails its open requests and is
replaced by the next request."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc

from bench.fixed_engine import FixedModel
from engines.contract import EngineRequest, SamplingParams
from retention.types import RetentionPlan
from server.gateway.replicas.engine_client import EngineClient, EngineRejected, EngineUnavailable

TOKENS = [101, 102, 103, 104, 105, 106, 107, 108]


class CountingModel(FixedModel):
    """The fixed engine, counting the streams opened to it and the requests they carried."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.streams = 0
        self.request_ids: list[str] = []
        self.stopped: list[str] = []

    async def ModelStreamInfer(self, request_iterator, context):
        self.streams += 1

        async def seen():
            async for request in request_iterator:
                names = {t.name for t in request.inputs}
                (self.stopped if names == {"stop"} else self.request_ids).append(request.id)
                yield request

        async for response in super().ModelStreamInfer(seen(), context):
            yield response


@contextlib.asynccontextmanager
async def serving(model: FixedModel, port: int = 0):
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(model, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield bound
    finally:
        await server.stop(None)


def request(max_new_tokens: int = len(TOKENS), *, streaming: bool = True, input_ids=(1, 2, 3)) -> EngineRequest:
    return EngineRequest(tuple(input_ids), max_new_tokens, None, streaming, SamplingParams(), RetentionPlan(), "", "t")


async def collect(client: EngineClient, req: EngineRequest, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for chunk in client.generate(req, request_id=request_id):
        tokens.extend(chunk.token_ids)
    return tokens


async def test_concurrent_requests_share_one_stream_and_each_gets_its_own_answer() -> None:
    model = CountingModel(TOKENS, token_delay_s=0.002)  # paced: the answers interleave on the stream
    async with serving(model) as port:
        client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm", streams=1)
        try:
            lengths = [1 + i % len(TOKENS) for i in range(12)]
            results = await asyncio.gather(*(collect(client, request(n), f"r{i}") for i, n in enumerate(lengths)))
            unary = await collect(client, request(3, streaming=False), "one-message")
        finally:
            await client.close()
    assert results == [TOKENS[:n] for n in lengths]
    assert unary == TOKENS[:3]
    assert model.streams == 1 and sorted(model.request_ids) == sorted([f"r{i}" for i in range(12)] + ["one-message"])
    assert model.stopped == []


async def test_concurrent_requests_spread_over_the_clients_streams_and_a_lone_one_reuses_the_first() -> None:
    model = CountingModel(TOKENS, token_delay_s=0.002)
    async with serving(model) as port:
        client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm", streams=3)
        try:
            results = await asyncio.gather(*(collect(client, request(), f"r{i}") for i in range(9)))
            opened = model.streams
            for i in range(3):
                assert await collect(client, request(1), f"alone{i}") == TOKENS[:1]
        finally:
            await client.close()
    assert results == [TOKENS] * 9
    assert opened == 3 and model.streams == 3


async def test_an_abandoned_request_is_stopped_by_id_and_the_others_go_on() -> None:
    model = CountingModel(TOKENS, token_delay_s=0.02)
    async with serving(model) as port:
        client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm", streams=1)
        try:
            other = asyncio.create_task(collect(client, request(), "keeps-going"))
            async with contextlib.aclosing(client.generate(request(), request_id="leaves")) as chunks:
                first = await anext(chunks)  # then the consumer leaves (a stop string, a client gone)
            assert await other == TOKENS
            after = await collect(client, request(2), "after")
        finally:
            await client.close()
    assert first.token_ids == (TOKENS[0],)
    assert model.stopped == ["leaves"] and model.streams == 1
    assert after == TOKENS[:2]


async def test_a_refused_request_fails_alone() -> None:
    model = CountingModel(TOKENS)
    async with serving(model) as port:
        client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm", streams=1)
        try:
            bad = collect(client, request(input_ids=()), "empty-prompt")  # the contract refuses no input ids
            good = collect(client, request(4), "fine")
            outcomes = await asyncio.gather(bad, good, return_exceptions=True)
        finally:
            await client.close()
    assert isinstance(outcomes[0], EngineRejected) and "input_ids" in str(outcomes[0])
    assert outcomes[1] == TOKENS[:4]
    assert model.streams == 1


async def test_a_dead_stream_fails_its_open_requests_and_the_next_request_opens_a_new_one() -> None:
    model = CountingModel(TOKENS, token_delay_s=0.05)
    async with serving(model) as port:
        client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm", streams=1)
        pending = asyncio.create_task(collect(client, request(), "in-flight"))
        await asyncio.sleep(0.12)  # the request is open, its answer half sent
    try:
        with pytest.raises(EngineUnavailable):
            await pending
        async with serving(model, port):  # the engine is back on the same port
            assert await collect(client, request(2, streaming=False), "next") == TOKENS[:2]
    finally:
        await client.close()
    assert model.streams == 2


async def test_responses_that_arrived_while_the_consumer_was_busy_come_as_one_chunk() -> None:
    model = CountingModel(TOKENS)  # answers every token at once: all are there before they are read
    async with serving(model) as port:
        client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm", streams=1)
        try:
            async with contextlib.aclosing(client.generate(request(), request_id="burst")) as chunks:
                first = await anext(chunks)
                await asyncio.sleep(0.3)  # a slow consumer (a client reading slowly)
                rest = [chunk async for chunk in chunks]
        finally:
            await client.close()
    assert first.token_ids + sum((c.token_ids for c in rest), ()) == tuple(TOKENS)
    assert len(rest) <= 1 and (rest or [first])[-1].final and (rest or [first])[-1].generated == len(TOKENS)
    assert model.stopped == []
