"""Background tasks of the gateway: stopping them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel every task, then wait for all to end; what they raise while stopping is swallowed,
    a cancellation of the caller itself is not."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
