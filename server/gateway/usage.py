"""Per-tenant usage, counted in memory and written to the registry in batches.

Every flush is a batch with its own ``flush_id``; ``tenants.usage.record_usage`` applies
a batch at most once. A batch that fails to commit stays pending with the *same* id and
is retried, so a retry after a crash or a lost commit acknowledgement never double
counts. What is lost on a hard crash (SIGKILL) is bounded by the flush interval: the
counts accumulated since the last successful flush.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime

import anyio
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from tenants.usage import UsageRow, minute_bucket, record_usage


class UsageRecorder:
    def __init__(self, session_factory: Callable[[], Session], *, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self._sessions = session_factory
        self._clock = clock
        self._open: dict[tuple[int, datetime], list[int]] = defaultdict(lambda: [0, 0, 0])
        self._pending: list[tuple[str, list[UsageRow]]] = []

    def record(self, tenant_id: int, prompt_tokens: int, completion_tokens: int) -> None:
        counts = self._open[(tenant_id, minute_bucket(self._clock()))]
        counts[0] += 1
        counts[1] += prompt_tokens
        counts[2] += completion_tokens

    def _seal(self) -> None:
        if self._open:
            rows = [UsageRow(t, m, *c) for (t, m), c in self._open.items()]
            self._open = defaultdict(lambda: [0, 0, 0])
            self._pending.append((f"gw-{secrets.token_hex(12)}", rows))

    def _write(self, flush_id: str, rows: list[UsageRow]) -> None:
        with self._sessions() as session:
            record_usage(session, flush_id=flush_id, rows=rows)

    async def flush(self) -> int:
        """Write every sealed batch in order; stops at the first failure (retried next time)."""
        self._seal()
        written = 0
        while self._pending:
            flush_id, rows = self._pending[0]
            try:
                await anyio.to_thread.run_sync(self._write, flush_id, rows)
            except SQLAlchemyError:
                break
            self._pending.pop(0)
            written += len(rows)
        return written

    @property
    def backlog(self) -> int:
        return len(self._open) + sum(len(rows) for _, rows in self._pending)
