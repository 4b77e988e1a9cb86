"""Engine clients and tokenizers per pool, created on first use and reused.

A client is keyed by (Triton URL, model name), so an admin edit of a pool's URL takes
effect with the next request without a restart. Tokenizers are resolved by engine spec
through an injected ``tokenizer_for`` (the reference pool uses the GGUF's own
tokenizer; a GPU pool's spec names its tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable

from engines.tokenizer import ChatTokenizer
from server.gateway.context import PoolRef
from server.gateway.engine_client import EngineClient


class EngineDirectory:
    def __init__(self, tokenizer_for: Callable[[PoolRef], ChatTokenizer]) -> None:
        self._tokenizer_for = tokenizer_for
        self._clients: dict[tuple[str, str], EngineClient] = {}
        self._tokenizers: dict[str, ChatTokenizer] = {}
        self.pools: dict[str, PoolRef] = {}  # pools seen by requests or registered at start-up

    def register(self, pool: PoolRef) -> None:
        self.pools[pool.name] = pool

    def client(self, pool: PoolRef) -> EngineClient:
        self.pools[pool.name] = pool
        key = (pool.triton_url, pool.triton_model)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = EngineClient(pool.triton_url, pool.triton_model)
        return client

    def tokenizer(self, pool: PoolRef) -> ChatTokenizer:
        tokenizer = self._tokenizers.get(pool.engine_spec)
        if tokenizer is None:
            tokenizer = self._tokenizers[pool.engine_spec] = self._tokenizer_for(pool)
        return tokenizer

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
