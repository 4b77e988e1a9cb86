"""GPU smoke check against the running kvgate_llm model (Triton + TensorRT-LLM 1.2).

Run by build/gpu_smoke.sh inside the gateway image on the compose network. Talks to the
engine model directly with tritonclient, through the very encoder the gateway uses
(engines.contract), so it needs no tenant set-up:

1. the same salted prompt twice → the second reports kv_cache_reused_blocks > 0;
2. the same prompt under another salt → 0 reused blocks (tenant isolation);
3. flood the GPU tier with higher-priority prompts → the first prompt's blocks (priority
   at/above secondary_offload_min_priority) are offloaded to host: the stats call shows
   offloaded blocks and host blocks for the smoke tenant;
4. the first prompt again → reused blocks > 0 and the stats call's onboarded count grows.

Exits non-zero with the failed check named; prints every figure it measured.
"""

from __future__ import annotations

import argparse
import queue
import random
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient

from engines import contract, pool_stats, response_tensors
from retention.types import RetentionPlan, TokenRange


def infer(client, model: str, tensors: dict[str, np.ndarray], timeout: float = 300.0) -> dict[str, np.ndarray]:
    """One decoupled request over the gRPC stream; returns the final response's tensors."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        inputs = []
        for name, value in tensors.items():
            spec = next(s for s in contract.INPUTS if s.name == name)
            tensor = grpcclient.InferInput(name, list(value.shape), spec.datatype)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        merged: dict[str, np.ndarray] = {}
        deadline = time.monotonic() + timeout
        while True:
            result, error = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            if error is not None:
                raise RuntimeError(f"engine error: {error}")
            response = result.get_response()
            for output in response.outputs:
                merged[output.name] = result.as_numpy(output.name)
            if response.parameters.get("triton_final_response") and response.parameters["triton_final_response"].bool_param:
                return merged
    finally:
        client.stop_stream()


def request(ids: list[int], *, salt: str, tenant: str, priority: int) -> dict[str, np.ndarray]:
    plan = RetentionPlan((TokenRange(0, None, priority, None),), decode_priority=priority)
    return contract.encode_request(
        contract.EngineRequest(
            input_ids=tuple(ids), max_new_tokens=4, end_id=None, streaming=False,
            sampling=contract.SamplingParams(), retention=plan, cache_salt=salt, tenant_id=tenant,
        )
    )


def stats(client, model: str) -> pool_stats.PoolStatsReport:
    out = infer(client, model, {contract.KV_STATS.name: np.array([True])})
    return pool_stats.PoolStatsReport.from_json(out[response_tensors.KV_CACHE_STATS.name][0])


def check(ok: bool, what: str) -> None:
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="engine:8001")
    parser.add_argument("--model", default=contract.MODEL_NAME)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128000)
    args = parser.parse_args()
    client = grpcclient.InferenceServerClient(args.url)
    for _ in range(120):
        try:
            if client.is_model_ready(args.model):
                break
        except Exception:
            pass
        time.sleep(5)
    check(client.is_model_ready(args.model), f"model {args.model} ready at {args.url}")
    rng = random.Random(1234)
    prompt = [rng.randrange(1000, args.vocab) for _ in range(args.prompt_tokens)]
    before = stats(client, args.model)
    threshold = before.secondary_offload_min_priority
    print(f"pool: primary {before.primary.max_blocks} blocks, secondary {before.secondary.max_blocks} blocks, "
          f"tokens/block {before.tokens_per_block}, offload threshold {threshold}")
    keep = min(threshold + 10, 100)  # offloaded, not dropped, when evicted
    first = infer(client, args.model, request(prompt, salt="smoke-a", tenant="smoke-a", priority=keep))
    second = infer(client, args.model, request(prompt, salt="smoke-a", tenant="smoke-a", priority=keep))
    reused = int(second[response_tensors.KV_REUSED.name][0])
    print(f"first: reused {int(first[response_tensors.KV_REUSED.name][0])}; second: reused {reused}")
    check(reused > 0, "same salted prompt twice reuses blocks")
    other = infer(client, args.model, request(prompt, salt="smoke-b", tenant="smoke-b", priority=keep))
    check(int(other[response_tensors.KV_REUSED.name][0]) == 0, "another salt reuses nothing")

    per_request = max(args.prompt_tokens, before.tokens_per_block)
    flood_requests = before.primary.max_blocks * before.tokens_per_block // per_request + 2
    print(f"flooding the GPU tier with {flood_requests} prompts at priority {min(keep + 5, 100)} ...")
    for i in range(flood_requests):
        ids = [rng.randrange(1000, args.vocab) for _ in range(per_request)]
        infer(client, args.model, request(ids, salt=f"smoke-flood-{i}", tenant="smoke-flood", priority=min(keep + 5, 100)))
    mid = stats(client, args.model)
    print(f"after flood: offloaded {mid.offloaded_blocks}, evicted {mid.evicted_blocks}, tenants {mid.tenants.get('smoke-a')}")
    check(mid.offloaded_blocks > before.offloaded_blocks, "eviction offloaded blocks to host")
    check(mid.tenants.get("smoke-a", [0, 0])[1] > 0, "smoke tenant holds host-tier blocks")
    again = infer(client, args.model, request(prompt, salt="smoke-a", tenant="smoke-a", priority=keep))
    after = stats(client, args.model)
    print(f"again: reused {int(again[response_tensors.KV_REUSED.name][0])}; onboarded {mid.onboarded_blocks} -> {after.onboarded_blocks}")
    check(int(again[response_tensors.KV_REUSED.name][0]) > 0, "offloaded prefix is reused")
    check(after.onboarded_blocks > mid.onboarded_blocks, "host blocks were onboarded")
    print("GPU smoke: all checks passed")


if __name__ == "__main__":
    main()
