"""A trivial KServe v2 model for benchmarking the gateway alone.

It speaks the real ``kvgate_llm`` contract (requests are decoded and validated with the
same code as the reference engine) but "generates" a fixed token sequence instantly,
so what a benchmark measures is the gateway, not the model. ``--token-delay-ms`` paces a
streamed answer (a pause before each token), so faults can catch requests in flight
(``bench/reliability/chaos.py``).

    python bench/server/fixed_engine.py --port 9001 --tokens 16 [--token-delay-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from engines.contract import KvMetrics, is_stats_request, parse_request
from engines.pool_stats import PoolStatsReport, TierStats
from engines.reference.kserve import decode_inputs, encode_outputs
from engines.response_tensors import KV_CACHE_STATS, encode_response


class FixedModel(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, tokens: list[int], token_delay_s: float = 0.0, primary_blocks: int = 1024,
                 secondary_blocks: int = 0) -> None:
        self.tokens = tokens
        self.token_delay_s = token_delay_s
        self.primary_blocks = primary_blocks
        self.secondary_blocks = secondary_blocks

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=True)

    def _responses(self, request):
        tensors = decode_inputs(request)
        if is_stats_request(tensors):
            report = PoolStatsReport(16, TierStats(self.primary_blocks, self.primary_blocks, 0),
                                     TierStats(self.secondary_blocks, self.secondary_blocks, 0))
            response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            encode_outputs(response, {KV_CACHE_STATS.name: np.array([report.to_json().encode()], np.object_)})
            return [response]
        parsed = parse_request(tensors, max_output_len=4096, max_input_len=1 << 20, vocab_size=49152)
        n = min(parsed.max_new_tokens, len(self.tokens))
        kv = KvMetrics(0, 1, 1, 0)
        chunks = [[t] for t in self.tokens[:n]] if parsed.streaming else [self.tokens[:n]]
        out = []
        for index, chunk in enumerate(chunks):
            response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            generated = sum(len(c) for c in chunks[: index + 1])
            encode_outputs(response, encode_response(chunk, generated, kv))
            response.parameters["triton_final_response"].bool_param = index == len(chunks) - 1
            out.append(response)
        return out

    async def ModelInfer(self, request, context):
        return self._responses(request)[-1]

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            for response in self._responses(request):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                yield service_pb2.ModelStreamInferResponse(infer_response=response)


async def serve(port: int, tokens: list[int], token_delay_s: float = 0.0, primary_blocks: int = 1024,
                secondary_blocks: int = 0) -> None:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
        FixedModel(tokens, token_delay_s, primary_blocks, secondary_blocks), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--primary-blocks", type=int, default=1024, help="the primary tier the stats call reports")
    parser.add_argument("--secondary-blocks", type=int, default=0, help="the host tier the stats call reports")
    args = parser.parse_args()
    from engines.tokenizer import load_gguf_tokenizer

    text = " The quick brown fox jumps over the lazy dog and keeps running far away" * 8
    tokens = load_gguf_tokenizer().encode(text)[: args.tokens]
    asyncio.run(serve(args.port, tokens, args.token_delay_ms / 1000, args.primary_blocks, args.secondary_blocks))


if __name__ == "__main__":
    main()
