"""Two usage flushes of one recorder never overlap: each batch is written, then dropped, once.

The gateway flushes from two places at once: the start-up task that applies what a dead
gateway's journal left, and the flush loop (``GatewayServices.start``); the stop flushes
too. With a slow registry the second flush must wait for the first, not write the first's
batch again and then drop a batch nobody wrote (or pop from an empty list).

Real SQLite registry, real journal files; the registry is held still by a gate in front of
its session factory, so the interleaving is the same on every run.
"""

from __future__ import annotations

import asyncio
import threading

from sqlalchemy.exc import OperationalError

from server.gateway.usage import UsageRecorder
from tests.server.gateway.test_usage_journal import NOW, record_all, recorder, registry, totals


class Gate:
    """A session factory whose sessions wait for ``open`` (in the flush's worker thread);
    ``entered`` counts the flushes that reached the registry."""

    def __init__(self, factory) -> None:
        self._factory = factory
        self._open = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            self.entered += 1
        self._open.wait(30)
        return self._factory()

    def open(self) -> None:
        self._open.set()


async def _until(predicate, what: str) -> None:
    for _ in range(600):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(what)


def test_a_flush_started_during_a_slow_flush_waits_for_it(tmp_path) -> None:
    _, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"
    dead = recorder(factory, journal_dir)  # a dead gateway's segment: 3 requests
    asyncio.run(record_all(dead, tid, 3))
    dead.close()
    gate = Gate(factory)

    async def main() -> UsageRecorder:
        rec = recorder(gate, journal_dir)  # the restarted gateway adopts it
        assert rec.replayed == 1
        replay = asyncio.create_task(rec.flush())  # services.start(): the dead gateway's journal, at once
        await _until(lambda: gate.entered == 1, "the replay reached the registry")
        await record_all(rec, tid, 2)  # traffic meanwhile
        loop_flush = asyncio.create_task(rec.flush())  # the flush loop's turn comes while the replay waits
        await asyncio.sleep(0.2)
        assert gate.entered == 1  # it waits for the replay instead of writing the replay's batch again
        gate.open()
        results = await asyncio.gather(replay, loop_flush, return_exceptions=True)
        assert not [r for r in results if isinstance(r, BaseException)], results
        # Rows written: the replay, the dead gateway's 3 journal lines (one tenant, one minute: one
        # row), then, nothing being pending any more, the new batch (one row); the loop finds
        # nothing left. Each batch once: two registry writes in all.
        assert results == [2, 0]
        assert gate.entered == 2
        return rec

    rec = asyncio.run(main())
    # 3 requests from the dead gateway + 2 new ones (prompt 10 + i, completion i each): no more, no less.
    assert totals(factory) == (5, sum(10 + i for i in range(3)) + sum(10 + i for i in range(2)),
                               sum(range(3)) + sum(range(2)))
    assert rec.backlog == 0
    assert list(journal_dir.iterdir()) == []  # both segments applied, removed
    rec.close()


def test_a_failed_write_keeps_exactly_its_batch_for_the_next_flush(tmp_path) -> None:
    """A write that fails leaves its batch first in line with its flush id and its rows; what is
    recorded meanwhile joins the open batch (no second batch is sealed while one is pending);
    the next flush writes the kept batch, then seals and writes the open one, once each."""
    _, factory, tid = registry(tmp_path)
    state = {"fail": True}

    def flaky():
        if state["fail"]:
            raise OperationalError("INSERT", {}, Exception("registry away"))
        return factory()

    async def main() -> None:
        rec = UsageRecorder(flaky, clock=lambda: NOW)
        rec.record(tid, 10, 1)
        assert await rec.flush() == 0  # away: kept
        (first,) = rec._pending
        rows = list(first.rows)
        rec.record(tid, 20, 2)
        assert await rec.flush() == 0
        assert rec._pending == [first] and first.rows == rows  # the sent batch never changes
        assert rec.backlog == 2 and rec.flush_failures == 2
        state["fail"] = False
        assert await asyncio.gather(rec.flush(), rec.flush()) in ([2, 0], [0, 2])
        assert rec.backlog == 0

    asyncio.run(main())
    assert totals(factory) == (2, 30, 3)
