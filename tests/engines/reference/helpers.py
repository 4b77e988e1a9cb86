"""Client-side helpers: build tritonclient inputs from the contract, run requests."""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from engines.contract import INPUTS, EngineRequest, KvMetrics, SamplingParams, encode_request
from engines.pool_stats import PoolStatsReport
from retention.types import RetentionPlan

MODEL = "kvgate_llm"
_DATATYPES = {spec.name: spec.datatype for spec in INPUTS}


def to_inputs(tensors: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in tensors.items():
        item = grpcclient.InferInput(name, list(array.shape), _DATATYPES.get(name, "INT32"))
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


def chat_ids(tokenizer, text: str, system: str | None = None) -> tuple[int, ...]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tuple(tokenizer.encode(tokenizer.render_chat(messages)))


def make_request(ids, max_new: int = 12, *, streaming: bool = False, salt: str | None = None,
                 tenant: str | None = "tenant-a", plan: RetentionPlan | None = None, end_id: int | None = 2) -> EngineRequest:
    return EngineRequest(
        input_ids=tuple(ids), max_new_tokens=max_new, end_id=end_id, streaming=streaming,
        sampling=SamplingParams(), retention=plan or RetentionPlan(), cache_salt=salt, tenant_id=tenant,
    )


def unique_salt() -> str:
    return f"salt-{uuid.uuid4().hex}"


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    sequence_length: int
    kv: KvMetrics
    responses: int


def _kv(result) -> KvMetrics:
    return KvMetrics(*(int(result.as_numpy(n)[0]) for n in (
        "kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks", "kv_cache_onboarded_blocks",
    )))


def infer(url: str, request: EngineRequest) -> Generation:
    """Unary ModelInfer with the synchronous tritonclient."""
    client = grpcclient.InferenceServerClient(url)
    try:
        result = client.infer(MODEL, to_inputs(encode_request(request)))
    finally:
        client.close()
    tokens = result.as_numpy("output_ids").tolist()
    return Generation(tokens, int(result.as_numpy("sequence_length")[0]), _kv(result), 1)


async def stream(client: grpcaio.InferenceServerClient, request: EngineRequest, request_id: str = "") -> Generation:
    """ModelStreamInfer with tritonclient.grpc.aio until the final response."""
    async def requests():
        yield {"model_name": MODEL, "inputs": to_inputs(encode_request(request)), "request_id": request_id}

    tokens: list[int] = []
    count = 0
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise error
        count += 1
        tokens.extend(result.as_numpy("output_ids").tolist())
        if result.get_response().parameters["triton_final_response"].bool_param:
            return Generation(tokens, int(result.as_numpy("sequence_length")[0]), _kv(result), count)
    raise AssertionError("stream ended without a final response")


def stats(url: str, events_since: int | None = None) -> PoolStatsReport:
    client = grpcclient.InferenceServerClient(url)
    try:
        flag = grpcclient.InferInput("kv_stats", [1], "BOOL")
        flag.set_data_from_numpy(np.array([True]))
        inputs = [flag]
        if events_since is not None:
            cursor = grpcclient.InferInput("kv_events_since", [1], "UINT64")
            cursor.set_data_from_numpy(np.array([events_since], np.uint64))
            inputs.append(cursor)
        result = client.infer(MODEL, inputs)
    finally:
        client.close()
    return PoolStatsReport.from_json(result.as_numpy("kv_cache_stats")[0])


def document(tag: str, sentences: int = 24) -> str:
    """A long, unique document (~14 tokens per sentence) so prefixes are not shared by accident."""
    topics = ["rivers", "bridges", "orchards", "lighthouses", "glaciers", "markets", "libraries", "harbors"]
    return " ".join(
        f"Note {tag}-{i}: the {topics[i % len(topics)]} of the valley changed in year {1700 + 7 * i}."
        for i in range(sentences)
    )
