"""Tokenizers per pool (by engine spec), created on first use and reused; known pools.

Engine clients live with the pool's replicas (``server/gateway/replicas/routing.py``). Tokenizers
are resolved by engine spec through an injected ``tokenizer_for`` (the reference pool
uses the GGUF's own tokenizer; a GPU pool's spec names its tokenizer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio

from engines.tokenizer import ChatTokenizer
from tenants.snapshots import PoolSnapshot
from server.gateway.api.prompting import ChatPrompter


class EngineDirectory:
    def __init__(self, tokenizer_for: Callable[[PoolSnapshot], ChatTokenizer]) -> None:
        self._tokenizer_for = tokenizer_for
        self._prompters: dict[str, ChatPrompter] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        self.pools: dict[str, PoolSnapshot] = {}  # pools seen by requests or registered at start-up

    def register(self, pool: PoolSnapshot) -> None:
        self.pools[pool.name] = pool

    def seen(self, pool: PoolSnapshot) -> PoolSnapshot:
        """Remember a pool a request used (so the poll loop keeps polling it); returns it."""
        self.pools.setdefault(pool.name, pool)
        return pool

    async def prompter(self, pool: PoolSnapshot) -> ChatPrompter:
        """The pool's tokenizer; the first call per spec loads it in a worker thread.

        Why a thread and a lock: loading a GGUF tokenizer takes seconds and must neither
        stall the event loop nor run twice when the first requests arrive together.
        """
        prompter = self._prompters.get(pool.engine_spec)
        if prompter is not None:
            return prompter
        lock = self._loading.setdefault(pool.engine_spec, asyncio.Lock())
        async with lock:
            prompter = self._prompters.get(pool.engine_spec)
            if prompter is None:
                tokenizer = await anyio.to_thread.run_sync(self._tokenizer_for, pool)
                prompter = self._prompters[pool.engine_spec] = ChatPrompter(tokenizer)
        return prompter

    async def close(self) -> None:
        self._prompters.clear()
