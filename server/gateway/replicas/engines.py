"""Prompters per pool (by engine spec), created on first use and reused; known pools.

Engine clients live with the pool's replicas (``server/gateway/replicas/routing.py``). A
pool's prompter (its tokenizer behind the chat template, ``server/gateway/api/prompting.py``)
is built by an injected ``prompter_for`` (the reference pool uses the GGUF's own tokenizer;
a GPU pool's spec names its tokenizer), so this layer never imports the API layer above it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

from tenants.snapshots import PoolSnapshot

Prompter = TypeVar("Prompter")


class EngineDirectory(Generic[Prompter]):
    def __init__(self, prompter_for: Callable[[PoolSnapshot], Prompter]) -> None:
        self._prompter_for = prompter_for
        self._prompters: dict[str, Prompter] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        self.pools: dict[str, PoolSnapshot] = {}  # pools seen by requests or registered at start-up

    def register(self, pool: PoolSnapshot) -> None:
        self.pools[pool.name] = pool

    def forget(self, name: str) -> None:
        """Stop polling a pool the registry no longer lists (its prompter, per engine spec, stays)."""
        self.pools.pop(name, None)

    def seen(self, pool: PoolSnapshot) -> PoolSnapshot:
        """Remember a pool a request used (so the poll loop keeps polling it); returns it."""
        self.pools.setdefault(pool.name, pool)
        return pool

    async def prompter(self, pool: PoolSnapshot) -> Prompter:
        """The pool's prompter; the first call per spec loads it (its tokenizer) in a worker thread.

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
                prompter = await anyio.to_thread.run_sync(self._prompter_for, pool)
                self._prompters[pool.engine_spec] = prompter
        return prompter

    async def close(self) -> None:
        self._prompters.clear()
