"""EngineClient against a scripted KServe server: the non-streaming (unary) path and its contract.

A non-streaming request is called as unary-unary on ``ModelStreamInfer``: it must take the
engine's one message, and a breach of the one-message contract must be an engine error,
never a hang without end nor a truncated answer.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from engines.contract import EngineRequest, KvMetrics, SamplingParams
from engines.response_tensors import encode_response
from bench.server.fixed_engine import FixedModel
from engines.reference.kserve import encode_outputs
from retention.types import RetentionPlan
from engines.refusals import contract_refused, too_long
from server.gateway.replicas.engine_client import (
    EngineClient, EngineError, EngineFailed, EngineOverloaded, EngineRejected, EngineUnavailable,
)
from server.gateway.replicas.engine_stream import StreamChannel


def _message(tokens: list[int], generated: int, final: bool | None) -> service_pb2.ModelStreamInferResponse:
    response = service_pb2.ModelInferResponse(model_name="kvgate_llm", id="r")
    encode_outputs(response, encode_response(tokens, generated, KvMetrics(1, 2, 3, 0)))
    if final is not None:
        response.parameters["triton_final_response"].bool_param = final
    return service_pb2.ModelStreamInferResponse(infer_response=response)


class Scripted(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers every request with ``script`` (a list of messages), or never when ``hang``;
    ``hang_after`` holds the stream open after the script, ``status`` ends it with an error."""

    def __init__(self) -> None:
        self.script: list[service_pb2.ModelStreamInferResponse] = []
        self.hang = False
        self.hang_after = False
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.received = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def ModelStreamInfer(self, request_iterator, context):
        try:
            async for _ in request_iterator:
                self.received.set()
                if self.hang:
                    await asyncio.Event().wait()
                for message in self.script:
                    yield message
                if self.status is not None:
                    await context.abort(*self.status)
                if self.hang_after:
                    await asyncio.Event().wait()
        except (asyncio.CancelledError, GeneratorExit):
            # grpc.aio cancels the handler when the client cancels: in an await
            # (CancelledError), or, when the cancel lands while a yielded message is being
            # written (a client that closes right after its first chunk), by closing the
            # generator at its ``yield`` (GeneratorExit)
            self.cancelled.set()
            raise


@pytest.fixture
async def engine():
    servicer = Scripted()
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm")
    try:
        yield servicer, client
    finally:
        await client.close()
        await server.stop(0)


def _request(streaming: bool = False) -> EngineRequest:
    return EngineRequest(input_ids=(1, 2, 3), max_new_tokens=4, end_id=None, streaming=streaming,
                         sampling=SamplingParams(), retention=RetentionPlan(), cache_salt=None, tenant_id=None)


async def _collect(client: EngineClient, request: EngineRequest, timeout: float | None = None):
    return [chunk async for chunk in client.generate(request, request_id="r", timeout=timeout)]


async def test_a_non_streaming_request_takes_its_one_message_through_the_unary_call(engine, monkeypatch):
    servicer, client = engine
    servicer.script = [_message([7, 8, 9], 3, True)]
    monkeypatch.setattr(StreamChannel, "open", None)  # calling the stream path would fail
    [chunk] = await _collect(client, _request())
    assert chunk.token_ids == (7, 8, 9) and chunk.generated == 3 and chunk.final
    assert chunk.kv == KvMetrics(1, 2, 3, 0)
    servicer.script = [_message([7, 8, 9], 3, None)]  # no final marker: a unary answer is final
    [chunk] = await _collect(client, _request())
    assert chunk.final


async def test_a_streaming_request_stays_on_the_stream(engine, monkeypatch):
    servicer, client = engine
    servicer.script = [_message([7], 1, False), _message([8], 2, True)]
    monkeypatch.setattr(client, "_infer_once", None)  # calling it would fail
    chunks = await _collect(client, _request(streaming=True))
    assert [c.token_ids for c in chunks] == [(7,), (8,)] and chunks[-1].final


@pytest.mark.parametrize("streaming", [False, True])
async def test_only_a_known_refusal_is_a_rejection_and_other_error_messages_are_the_engines_failure(engine, streaming):
    """The error channel carries refusals and the engine's own failures alike: only the contract's
    marked errors and the refusals of engines/refusals.py are the request's fault."""
    servicer, client = engine
    cases = [
        (contract_refused("input_ids: input_ids must not be empty"), EngineRejected),
        ("[kvgate_llm] " + too_long(9000, 8192), EngineRejected),
        ("engine error: Maximum queue size of 64 has been reached, please try again later "
         "(/src/cpp/tensorrt_llm/executor/executorImpl.cpp:1021)", EngineOverloaded),
        ("engine error: [TensorRT-LLM][ERROR] CUDA runtime error in cudaMemcpyAsync", EngineFailed),
        ("[kvgate_llm] the reference engine is not running", EngineFailed),
        ("input_ids: empty", EngineFailed),  # unmarked: not the contract's refusal
    ]
    for message, kind in cases:
        servicer.script = [service_pb2.ModelStreamInferResponse(error_message=message)]
        with pytest.raises(EngineError) as caught:
            await _collect(client, _request(streaming=streaming))
        assert type(caught.value) is kind and isinstance(caught.value, (EngineRejected, EngineUnavailable))


async def test_a_non_final_or_missing_answer_is_an_engine_error_not_a_truncated_answer(engine):
    servicer, client = engine
    servicer.script = [_message([7], 1, False)]
    with pytest.raises(EngineUnavailable, match="non-final message for a non-streaming request"):
        await _collect(client, _request())
    servicer.script = []
    with pytest.raises(EngineUnavailable, match="without an answer"):
        await _collect(client, _request())


async def test_two_messages_for_a_non_streaming_request_end_in_an_engine_error(engine):
    """gRPC holds the status behind the unread second message: the call's deadline ends it."""
    servicer, client = engine
    servicer.script = [_message([7], 1, True), _message([8], 2, True)]
    with pytest.raises(EngineUnavailable, match="DEADLINE_EXCEEDED"):
        await _collect(client, _request(), timeout=1.0)


async def test_cancelling_the_wait_for_the_answer_cancels_the_engine_call(engine):
    servicer, client = engine
    servicer.hang = True
    task = asyncio.create_task(_collect(client, _request()))
    await servicer.received.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(servicer.cancelled.wait(), 10)  # the engine saw the cancel (frees the request)


# -- the streaming path (grpclib) ------------------------------------------------------------

async def test_closing_a_stream_early_cancels_the_engine_call(engine):
    servicer, client = engine
    servicer.script, servicer.hang_after = [_message([7], 1, False)], True
    chunks = client.generate(_request(streaming=True), request_id="r")
    first = await anext(chunks)
    assert first.token_ids == (7,) and not first.final
    await chunks.aclose()  # the consumer left (client gone, stop string)
    await asyncio.wait_for(servicer.cancelled.wait(), 10)  # the engine saw the cancel (frees the request)


async def test_cancelling_the_wait_for_the_next_token_cancels_the_engine_call(engine):
    servicer, client = engine
    servicer.hang = True
    task = asyncio.create_task(_collect(client, _request(streaming=True)))
    await servicer.received.wait()
    task.cancel()  # the router's first-token deadline
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(servicer.cancelled.wait(), 10)


async def test_a_stream_without_its_final_response_is_an_engine_error(engine):
    servicer, client = engine
    servicer.script = [_message([7], 1, False)]
    with pytest.raises(EngineUnavailable, match="before its final response"):
        await _collect(client, _request(streaming=True))


async def test_stream_statuses_map_to_rejection_or_unavailability(engine):
    servicer, client = engine
    servicer.status = (grpc.StatusCode.INVALID_ARGUMENT, "bad input_ids")
    with pytest.raises(EngineRejected) as streamed:
        await _collect(client, _request(streaming=True))
    with pytest.raises(EngineRejected) as unary:
        await _collect(client, _request())
    assert str(streamed.value) == str(unary.value) == "bad input_ids"  # the same on both paths
    servicer.script, servicer.status = [_message([7], 1, False)], (grpc.StatusCode.INTERNAL, "engine crashed")
    with pytest.raises(EngineUnavailable, match="INTERNAL.*engine crashed"):
        await _collect(client, _request(streaming=True))
    refusal = service_pb2.ModelStreamInferResponse(error_message=contract_refused("bad stop"))
    servicer.script, servicer.status = [refusal], None
    with pytest.raises(EngineRejected, match="bad stop"):
        await _collect(client, _request(streaming=True))


async def test_a_stream_deadline_is_an_engine_error(engine):
    servicer, client = engine
    servicer.hang = True
    with pytest.raises(EngineUnavailable, match="DEADLINE_EXCEEDED"):
        await _collect(client, _request(streaming=True), timeout=0.5)
    await asyncio.wait_for(servicer.cancelled.wait(), 10)
    assert asyncio.current_task().cancelling() == 0  # grpclib's wake-up left no cancel request behind


async def _serve(servicer: Scripted, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def test_an_engine_restart_ends_the_stream_as_unavailable_and_the_next_stream_reconnects():
    servicer = Scripted()
    servicer.script, servicer.hang_after = [_message([7], 1, False)], True
    server, port = await _serve(servicer)
    client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm")
    try:
        chunks = client.generate(_request(streaming=True), request_id="r")
        assert (await anext(chunks)).token_ids == (7,)
        await server.stop(0)  # the engine dies mid-stream
        with pytest.raises(EngineUnavailable):
            await anext(chunks)
        assert asyncio.current_task().cancelling() == 0
        with pytest.raises(EngineUnavailable):  # nothing listens: refused after the connect wait
            await _collect(client, _request(streaming=True))
        servicer.script, servicer.hang_after = [_message([7], 1, False), _message([8], 2, True)], False
        server, _ = await _serve(servicer, port)  # back on the same port
        chunks = [c async for c in client.generate(_request(streaming=True), request_id="r", connect_timeout=5.0)]
        assert [c.token_ids for c in chunks] == [(7,), (8,)] and chunks[-1].final
    finally:
        await client.close()
        await server.stop(0)


async def _serve_fixed(tokens: list[int], token_delay_s: float, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(FixedModel(tokens, token_delay_s), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def test_a_graceful_engine_stop_lets_running_streams_finish_and_the_next_call_reconnects():
    """A stop with a grace period (GOAWAY, then the running calls end) must not cut the
    streams already running; the next call opens a new connection (the engine back on the
    same port)."""
    tokens = list(range(100, 108))
    server, port = await _serve_fixed(tokens, 0.05)
    client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm")
    request = EngineRequest(input_ids=(1, 2, 3), max_new_tokens=8, end_id=None, streaming=True,
                            sampling=SamplingParams(), retention=RetentionPlan(), cache_salt=None, tenant_id=None)
    try:
        chunks = client.generate(request, request_id="r")
        got = [(await anext(chunks)).token_ids, (await anext(chunks)).token_ids]
        stopping = asyncio.create_task(server.stop(5.0))  # graceful: GOAWAY, running calls finish
        got += [c.token_ids async for c in chunks]
        assert got == [(t,) for t in tokens]
        await stopping
        server, _ = await _serve_fixed(tokens, 0.0, port)  # back on the same port
        after = [c async for c in client.generate(request, request_id="r2", connect_timeout=5.0)]
        assert [c.token_ids for c in after] == [(t,) for t in tokens] and after[-1].final
    finally:
        await client.close()
        await server.stop(0)


async def test_a_connect_the_engine_never_answers_fails_at_the_connect_timeout():
    """A listener whose accept queue is full drops new SYNs: the connect would wait for the
    kernel's retries (minutes); the connect timeout must cut it as EngineUnavailable."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepted
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(64):  # fill the accept queue until a connect is not answered
            filler = socket.socket()
            fillers.append(filler)
            filler.settimeout(0.2)
            try:
                filler.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.fail("the listener answered every connect: its accept queue never filled")
        client = EngineClient(f"127.0.0.1:{port}", "kvgate_llm")
        try:
            with pytest.raises(EngineUnavailable, match="connect timeout"):
                # the guard turns a hang into a failure; the connect timeout must end it first
                await asyncio.wait_for(_collect_with(client, connect_timeout=0.5), 30)
        finally:
            await client.close()
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def _collect_with(client: EngineClient, *, connect_timeout: float):
    return [c async for c in client.generate(_request(streaming=True), request_id="r", connect_timeout=connect_timeout)]
