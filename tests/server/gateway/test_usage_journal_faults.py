"""The usage journal and recorder when things go wrong: the registry away or refusing a batch,
poisoned or torn journal lines, a low descriptor limit, a full disk, a creation race, a
record after close, a registry URL spelled differently.

Real files, real ``flock``, a real migrated registry (SQLite; PostgreSQL at 127.0.0.1:5432 where
the database itself refuses a value). A gateway's death is its recorder closed without a flush
(``close`` releases the locks as the kernel does for a killed process).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy.exc import OperationalError

import server.gateway.usage_journal as uj
from server.gateway.observe.metrics import GatewayMetrics
from server.gateway.usage import QUARANTINE_AFTER, UsageRecorder
from server.gateway.usage_journal import UsageJournal, decode_lines, registry_fingerprint
from tenants import migrate, pools, retention_classes, tenant
from tenants.db import make_session_factory
from tenants.models import Usage
from tests.server.gateway.test_usage_journal import NOW, recorder, registry, totals

MINUTE = int(NOW.timestamp()) // 60
ROOT = Path(__file__).resolve().parents[3]


def line(tid: int, p: int, c: int = 0, m: int = MINUTE) -> bytes:
    return json.dumps({"t": tid, "m": m, "p": p, "c": c}, separators=(",", ":")).encode() + b"\n"


def orphan(directory: Path, flush_id: str, data: bytes, fp: str = "reg") -> Path:
    """A segment a dead gateway left (nobody holds its lock)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"usage-{fp}-{flush_id}.jsonl"
    path.write_bytes(data)
    return path


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def down():
    raise OperationalError("INSERT", {}, Exception("connection refused"))


# The registry away ------------------------------------------------------------------------------
def test_an_outage_keeps_one_segment_open_and_is_reported_not_one_fd_per_flush(tmp_path, caplog) -> None:
    """No second batch is sealed while one is pending: the open batch and its one segment grow;
    the failures are counted and warned of once (rate-limited); all of it lands after the outage."""
    _, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"
    state = {"down": True}

    def sessions():
        return down() if state["down"] else factory()

    async def scenario() -> None:
        rec = recorder(sessions, journal_dir)
        base = open_fds()
        with caplog.at_level(logging.WARNING, logger="kvgate.gateway.usage"):
            for i in range(50):  # fifty flush intervals, one request each
                await rec.record(tid, 10, 1)
                assert await rec.flush() == 0
        assert len(list(journal_dir.iterdir())) <= 2  # the sealed batch's segment and the open one
        assert open_fds() - base <= 2
        stats = rec.stats()
        assert stats["pending_segments"] <= 2 and stats["pending_batches"] == 1
        assert stats["flush_failures"] == 50 and stats["backlog_rows"] == 2 and stats["quarantined_batches"] == 0
        warnings = [r for r in caplog.records if "usage flush failed" in r.getMessage()]
        assert len(warnings) == 1 and "connection refused" in warnings[0].getMessage()
        state["down"] = False
        assert await rec.flush() == 2  # the kept batch, then the open one sealed and written
        assert totals(factory) == (50, 500, 50)
        assert list(journal_dir.iterdir()) == [] and rec.stats()["pending_segments"] == 0
        rec.close()

    asyncio.run(scenario())


def test_the_usage_figures_are_exported(tmp_path) -> None:
    _, factory, tid = registry(tmp_path)

    async def scenario() -> str:
        rec = recorder(down, tmp_path / "journal")
        for _ in range(3):
            await rec.record(tid, 10, 1)
            await rec.flush()
        metrics_registry = CollectorRegistry()
        GatewayMetrics(metrics_registry).watch_usage(rec.stats)
        text = generate_latest(metrics_registry).decode()
        rec.close()
        return text

    text = asyncio.run(scenario())
    for sample in ("kvgate_usage_backlog_rows 2.0", "kvgate_usage_pending_segments 2.0", "kvgate_usage_pending_batches 1.0",
                   "kvgate_usage_flush_failures_total 3.0", "kvgate_usage_quarantined_batches_total 0.0",
                   "kvgate_usage_unreadable_lines_total 0.0", "kvgate_usage_foreign_segments 0.0"):
        assert sample in text.splitlines(), sample


def test_a_restart_with_many_segments_adopts_them_in_chunks_under_a_low_fd_limit(tmp_path) -> None:
    """150 segments left by dead gateways, a gateway started with 64 descriptors: it starts, and
    applies every one of them in one flush."""
    url, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"
    for i in range(150):
        orphan(journal_dir, f"gw-{i:024x}", line(tid, 10, 1))
    code = textwrap.dedent(f"""
        import asyncio, resource, sys
        sys.path.insert(0, {str(ROOT)!r})
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from pathlib import Path
        from server.gateway.usage import UsageRecorder
        from server.gateway.usage_journal import UsageJournal
        from tenants.db import make_engine, make_session_factory
        rec = UsageRecorder(make_session_factory(make_engine({url!r})),
                            journal=UsageJournal(Path({str(journal_dir)!r}), registry="reg"))
        print("started", rec.replayed)
        print("written", asyncio.run(rec.flush()), rec.replayed, rec.flush_failures)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["started", "32", "written", "150", "150", "0"]
    assert totals(factory) == (150, 1500, 150)
    assert list(journal_dir.iterdir()) == []


def test_a_segment_that_cannot_be_opened_now_is_left_for_later(tmp_path, monkeypatch, caplog) -> None:
    _, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"
    stuck = orphan(journal_dir, "gw-" + "a" * 24, line(tid, 7))
    orphan(journal_dir, "gw-" + "b" * 24, line(tid, 5))
    real_open = os.open

    def refusing(path, *args, **kwargs):
        if Path(path) == stuck:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(uj.os, "open", refusing)

    async def scenario() -> None:
        with caplog.at_level(logging.WARNING, logger="kvgate.gateway.usage"):
            rec = recorder(factory, journal_dir)
        assert rec.replayed == 1 and rec._journal.orphans_left
        assert any("could not be adopted now" in r.getMessage() for r in caplog.records)
        await rec.flush()
        assert totals(factory)[1] == 5
        monkeypatch.setattr(uj.os, "open", real_open)  # the disk answers again
        await rec.flush()  # the next flush adopts what was left
        assert totals(factory)[1] == 12 and rec.replayed == 2
        assert list(journal_dir.iterdir()) == []
        rec.close()

    asyncio.run(scenario())


# A batch the registry refuses for good ----------------------------------------------------------
def test_poisoned_lines_are_skipped_and_counted_not_raised(tmp_path) -> None:
    tid = 3
    poisoned = [b'{"t":3,"m":1e20,"p":1,"c":1}\n', b'{"t":3,"m":99999999999999,"p":1,"c":1}\n',
                line(tid, 10**19), line(tid, 1, -1), line(tid, 2**53), line(0, 1), line(2**40, 1),
                b'{"t":true,"m":%d,"p":1,"c":1}\n' % MINUTE, b'{"t":3,"m":%d,"p":1.5,"c":1}\n' % MINUTE,
                b'{"t":"3","m":%d,"p":1,"c":1}\n' % MINUTE, b"[" * 100_000 + b"\n", b"[1,2]\n", b"\xff\n"]
    for bad in poisoned:
        assert decode_lines([bad]) == ([], 1), bad[:60]  # skipped, and counted
    rows, skipped = decode_lines([line(tid, 4, 1), *poisoned, line(tid, 2**53 - 1)])
    assert skipped == len(poisoned)
    assert [(r.tenant_id, r.requests, r.prompt_tokens, r.completion_tokens) for r in rows] == [(tid, 2, 2**53 + 3, 1)]

    _, factory, real_tid = registry(tmp_path)  # a dead gateway's segment with such a line: the gateway starts
    journal_dir = tmp_path / "journal"
    orphan(journal_dir, "gw-" + "c" * 24, line(real_tid, 10) + b'{"t":1,"m":1e20,"p":1,"c":1}\n' + line(real_tid, 5))

    async def scenario() -> None:
        rec = recorder(factory, journal_dir)
        assert rec.replayed == 1 and rec.stats()["unreadable_lines"] == 1
        await rec.flush()
        assert totals(factory) == (2, 15, 0)
        rec.close()

    asyncio.run(scenario())


def test_replay_keeps_one_row_per_tenant_and_minute() -> None:
    data = b"".join(line(1 + i % 5, 100, 3, MINUTE + i % 2) for i in range(10_000))
    rows, skipped = decode_lines(io.BytesIO(data))
    assert skipped == 0
    assert len(rows) == 10  # 5 tenants x 2 minutes, not 10,000 objects
    assert sum(r.requests for r in rows) == 10_000 and sum(r.prompt_tokens for r in rows) == 1_000_000


def pg_registry(stack):
    """A fresh PostgreSQL schema migrated and holding tenant ``acme`` (skipped if unreachable)."""
    from tests.tenants.fixtures import drop_pg_schema, new_pg_schema, pg_engine, postgres_reachable

    if not postgres_reachable():
        pytest.skip("PostgreSQL at 127.0.0.1:5432 is unreachable")
    schema = new_pg_schema()
    engine = pg_engine(schema)
    stack.callback(drop_pg_schema, schema)
    stack.callback(engine.dispose)
    with engine.begin() as conn:
        migrate.upgrade(connection=conn)
    factory = make_session_factory(engine)
    with factory() as s:
        pools.create_pool(s, actor="t", now=NOW, name="p", model_name="m", triton_url="127.0.0.1:1",
                          engine_spec="reference-smollm2", tokens_per_block=16, primary_blocks=64,
                          secondary_blocks=0, secondary_offload_min_priority=30)
    with factory() as s:
        retention_classes.create_class(s, actor="t", now=NOW, name="c", system_priority=90, context_priority=60,
                                       turn_priority=40, decode_priority=20)
    with factory() as s:
        tid = tenant.create_tenant(s, actor="t", now=NOW, slug="acme", display_name="Acme", pool="p",
                                   retention_class="c").id
    return factory, tid


@pytest.mark.parametrize("backend,poison", [("sqlite", "flush_id"), ("postgresql", "flush_id"),
                                            ("postgresql", "bigint_overflow")])
def test_a_refused_batch_is_quarantined_and_later_batches_go_on(tmp_path, backend, poison, caplog) -> None:
    """A dead gateway's segment the registry will never accept (a flush id too long to store, a
    counter the increment would push past BIGINT): every later batch is still written, and after
    QUARANTINE_AFTER refusals the segment is moved to quarantine/, logged and counted."""
    import contextlib

    with contextlib.ExitStack() as stack:
        if backend == "sqlite":
            _, factory, tid = registry(tmp_path)
        else:
            factory, tid = pg_registry(stack)
        journal_dir = tmp_path / "journal"
        earlier = datetime.fromtimestamp((MINUTE + 10) * 60, UTC)
        if poison == "flush_id":
            name = "gw-" + "f" * 200  # record_usage refuses it: flush ids are 1-128 chars
            bad = orphan(journal_dir, name, line(tid, 9, 0, MINUTE + 10))
        else:
            with factory() as s:  # the registry's counter for that minute is near the top of BIGINT
                s.add(Usage(tenant_id=tid, minute=earlier, requests=1, prompt_tokens=2**63 - 10, completion_tokens=0))
                s.commit()
            bad = orphan(journal_dir, "gw-" + "e" * 24, line(tid, 100, 0, MINUTE + 10))

        async def scenario() -> UsageRecorder:
            rec = recorder(factory, journal_dir)
            assert rec.replayed == 1
            with caplog.at_level(logging.WARNING, logger="kvgate.gateway.usage"):
                for i in range(QUARANTINE_AFTER):
                    await rec.record(tid, 100, 10)
                    await rec.flush()
                    await rec.flush()  # the open batch waits while the refused one is pending; not longer
                    assert totals(factory)[0] - (1 if poison == "bigint_overflow" else 0) == i + 1
            return rec

        rec = asyncio.run(scenario())
        assert rec.quarantined == 1 and rec.stats()["quarantined_batches"] == 1 and rec.flush_failures == 0
        assert not bad.exists() and (journal_dir / "quarantine" / bad.name).read_bytes().startswith(b'{"t":')
        assert [p.name for p in journal_dir.iterdir()] == ["quarantine"]
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and "moved to" in r.getMessage()]
        assert len(errors) == 1
        rec.close()
        again = recorder(factory, journal_dir)  # never replayed again
        assert again.replayed == 0
        again.close()


# The registry URL ------------------------------------------------------------------------------
def test_the_fingerprint_names_the_database_not_how_it_is_reached(tmp_path, caplog) -> None:
    base = "postgresql://kvgate@db.internal:5432/kvgate"
    same = [base, "postgresql://kvgate@db.internal/kvgate", "postgresql+psycopg://other:pw@db.internal:5432/kvgate",
            "postgresql://kvgate@DB.Internal:5432/kvgate", f"{base}?sslmode=require",
            f"{base}?connect_timeout=10&application_name=gw&keepalives=1"]
    assert {registry_fingerprint(u) for u in same} == {registry_fingerprint(base)}
    for other in ("postgresql://kvgate@db.internal:5432/kvgate2", "postgresql://kvgate@db.internal:5433/kvgate",
                  "postgresql://kvgate@db2.internal:5432/kvgate", f"{base}?options=-csearch_path%3Dtenant_b",
                  "sqlite:////var/lib/kvgate/kvgate.db"):
        assert registry_fingerprint(other) != registry_fingerprint(base), other
    assert registry_fingerprint("sqlite:///./kv.db?timeout=5") == registry_fingerprint("sqlite:///./kv.db")
    # The documented form (explicit default port, no options) hashes as before: an upgraded
    # gateway replays what the previous version left.
    documented = "postgresql+psycopg://kvgate:secret@kvgate-postgres:5432/kvgate"
    assert registry_fingerprint(documented) == hashlib.sha256(b"postgresql|kvgate-postgres|5432|kvgate|[]").hexdigest()[:12]

    journal_dir = tmp_path / "journal"  # another fingerprint's segments: counted and warned of at start
    orphan(journal_dir, "gw-" + "d" * 24, line(1, 1), fp="0123456789ab")
    with caplog.at_level(logging.WARNING, logger="kvgate.gateway.usage"):
        rec = recorder(lambda: None, journal_dir)
    assert rec.replayed == 0 and rec.stats()["foreign_segments"] == 1
    assert any("another registry fingerprint" in r.getMessage() for r in caplog.records)
    rec.close()


# Writes ---------------------------------------------------------------------------------------------
def test_a_torn_group_does_not_swallow_the_next_acknowledged_line(tmp_path, monkeypatch) -> None:
    """A short write on a full disk fails its group; the next group starts on a new line, so
    the acknowledged request after it is replayed."""
    journal = UsageJournal(tmp_path / "journal", registry="reg")
    real_write, calls = os.write, {"n": 0}

    def disk_full_once(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data)[:12])  # what fit
        raise OSError(errno.ENOSPC, "No space left on device")

    async def scenario() -> None:
        segment = journal.new_segment()
        await journal.append(segment, line(1, 10))
        monkeypatch.setattr(uj.os, "write", disk_full_once)
        with pytest.raises(OSError, match="usage journal write failed"):
            await journal.append(segment, line(1, 20))
        monkeypatch.setattr(uj.os, "write", real_write)  # space freed
        await journal.append(segment, line(1, 30))
        rows, skipped = decode_lines(segment.path.read_bytes().splitlines(keepends=True))
        assert (rows[0].requests, rows[0].prompt_tokens, skipped) == (2, 40, 1)
        journal.close([segment])

    asyncio.run(scenario())


def test_a_new_segment_is_never_seen_unlocked_by_a_starting_gateway(tmp_path, monkeypatch) -> None:
    """A gateway starting between another's create and lock must not adopt (and delete) the file."""
    journal_dir = tmp_path / "journal"
    real_flock = uj.fcntl.flock
    seen: list = []

    def flock_after_b_starts(fd, op):
        monkeypatch.setattr(uj.fcntl, "flock", real_flock)
        seen.append(UsageJournal(journal_dir, registry="reg").adopt_orphans())  # gateway B starts now
        return real_flock(fd, op)

    async def scenario() -> None:
        a = recorder(lambda: None, journal_dir)
        monkeypatch.setattr(uj.fcntl, "flock", flock_after_b_starts)
        for _ in range(3):
            await a.record(1, 100, 10)  # acknowledged durable
        assert seen == [[]]
        assert a._segment.path.exists() and os.fstat(a._segment.fd).st_nlink == 1
        a.close()  # A dies
        c = recorder(lambda: None, journal_dir)
        assert c.replayed == 1 and [r.requests for b in c._pending for r in b.rows] == [3]
        c.close()

    asyncio.run(scenario())


def test_a_segment_whose_lock_fails_is_closed_and_removed(tmp_path, monkeypatch) -> None:
    journal = UsageJournal(tmp_path / "journal", registry="reg")
    journal.directory.mkdir(parents=True)
    before = open_fds()

    def no_lock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(uj.fcntl, "flock", no_lock)
    with pytest.raises(OSError):
        journal.new_segment()
    assert open_fds() == before and list(journal.directory.iterdir()) == []


def test_a_crashed_creations_temporary_is_swept_once_stale(tmp_path) -> None:
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    stale, fresh = journal_dir / ".usage-reg-gw-1.jsonl.new", journal_dir / ".usage-reg-gw-2.jsonl.new"
    stale.write_bytes(b"")
    fresh.write_bytes(b"")
    os.utime(stale, (0, 0))
    UsageJournal(journal_dir, registry="reg").adopt_orphans()
    assert sorted(p.name for p in journal_dir.iterdir()) == [fresh.name]


def test_usage_recorded_after_close_is_not_acknowledged(tmp_path, caplog) -> None:
    """A request ending during the final flush is journalled (replayed next start); one ending
    after close is neither journalled nor acknowledged as durable, and says so."""
    journal_dir = tmp_path / "journal"

    async def scenario() -> None:
        rec = recorder(down, journal_dir)
        await rec.record(1, 10, 1)
        await rec.flush()
        await rec.record(1, 20, 2)
        rec.close()
        assert rec._segment is None
        with caplog.at_level(logging.ERROR, logger="kvgate.gateway.usage"):
            assert rec.record(1, 30, 3) is None
        assert any("after the recorder closed" in r.getMessage() for r in caplog.records)
        journal = UsageJournal(journal_dir, registry="reg")  # the journal itself refuses after close
        segment = journal.new_segment()
        journal.close([segment])
        with pytest.raises(OSError):
            journal.append(segment, line(1, 1))
        with pytest.raises(OSError):
            journal.new_segment()
        heir = recorder(lambda: None, journal_dir)
        assert sorted(r.prompt_tokens for b in heir._pending for r in b.rows) == [10, 20]
        heir.close()

    asyncio.run(scenario())


def test_a_queued_line_of_a_closed_segment_fails_its_waiter(tmp_path) -> None:
    journal = UsageJournal(tmp_path / "journal", registry="reg")

    async def scenario() -> None:
        segment = journal.new_segment()
        segment.close()  # closed with a line still to come (not applied: not discarded)
        with pytest.raises(OSError, match="usage journal write failed"):
            await journal.append(segment, line(1, 1))
        applied = journal.new_segment()
        await journal.append(applied, line(1, 1))
        journal.discard(applied)
        await journal.append(applied, line(1, 2))  # applied already: its row is in the committed batch
        journal.close([])

    asyncio.run(scenario())



def test_the_serving_app_exports_the_usage_figures(tmp_path) -> None:
    """The gateway wires the recorder's figures into its own metrics registry (what /metrics serves)."""
    from server.serving import build_serving_app
    from server.settings import Settings
    from tests.server.gateway.stack import PEPPER

    url, _, _ = registry(tmp_path)
    app = build_serving_app(Settings(database_url=url, admin_tokens=["ci:" + "x" * 40], key_pepper=PEPPER,
                                     trace_dir=tmp_path / "traces"))
    text = generate_latest(app.state.gateway.metrics.registry).decode()  # type: ignore[attr-defined]
    assert "kvgate_usage_backlog_rows 0.0" in text.splitlines()
    assert "kvgate_usage_flush_failures_total 0.0" in text.splitlines()
