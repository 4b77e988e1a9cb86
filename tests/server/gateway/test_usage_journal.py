"""The usage journal: what a dead gateway recorded is replayed once, never twice, never a live one's.

Real files, real ``flock``, a real migrated SQLite registry. A gateway's death is its
recorder being dropped without a flush (``close`` releases the locks as the kernel does
for a killed process); the SIGKILL of a real ``kvgate serve`` is in
``tests/reliability/test_data_safety.py``.
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime

import pytest
from sqlalchemy import func, select

from server.gateway.usage import UsageRecorder
from server.gateway.usage_journal import UsageJournal, registry_fingerprint
from tenants import migrate, pools, record_usage, retention_classes, tenant
from tenants.db import make_engine, make_session_factory
from tenants.models import Usage, UsageFlush

NOW = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)


def registry(tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    migrate.upgrade(url=url)
    factory = make_session_factory(make_engine(url))
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
    return url, factory, tid


def totals(factory) -> tuple[int, int, int]:
    with factory() as s:
        row = s.execute(select(func.coalesce(func.sum(Usage.requests), 0), func.coalesce(func.sum(Usage.prompt_tokens), 0),
                               func.coalesce(func.sum(Usage.completion_tokens), 0))).one()
    return int(row[0]), int(row[1]), int(row[2])


def recorder(factory, directory, fp="reg") -> UsageRecorder:
    return UsageRecorder(factory, clock=lambda: NOW, journal=UsageJournal(directory, registry=fp))


async def record_all(rec: UsageRecorder, tid: int, n: int) -> None:
    await asyncio.gather(*(rec.record(tid, 10 + i, i) for i in range(n)))


def test_a_dead_gateways_usage_is_replayed_once(tmp_path) -> None:
    _, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"

    async def scenario() -> None:
        dead = recorder(factory, journal_dir)
        await record_all(dead, tid, 20)
        await dead.flush()  # batch 1 reaches the registry, its segment goes
        await record_all(dead, tid, 7)  # batch 2 only in the journal
        assert totals(factory) == (20, sum(10 + i for i in range(20)), sum(range(20)))
        dead.close()  # the process dies: its locks go, its files stay
        assert len(list(journal_dir.iterdir())) == 1
        heir = recorder(factory, journal_dir)
        assert heir.replayed == 1
        await heir.flush()
        assert totals(factory) == (27, sum(10 + i for i in range(20)) + sum(10 + i for i in range(7)),
                                   sum(range(20)) + sum(range(7)))
        assert list(journal_dir.iterdir()) == []  # applied, removed
        heir.close()

    asyncio.run(scenario())


def test_a_segment_applied_before_the_crash_is_not_counted_again(tmp_path) -> None:
    _, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"

    async def scenario() -> None:
        dead = recorder(factory, journal_dir)
        await record_all(dead, tid, 5)
        dead._seal()
        batch = dead._pending[0]
        with factory() as s:  # committed ... and the process died before removing the file
            assert record_usage(s, flush_id=batch.flush_id, rows=batch.rows)
        dead.close()
        heir = recorder(factory, journal_dir)
        assert heir.replayed == 1
        await heir.flush()
        assert totals(factory)[0] == 5  # not 10: the flush id was applied already
        with factory() as s:
            assert s.scalar(select(func.count()).select_from(UsageFlush)) == 1
        assert list(journal_dir.iterdir()) == []
        heir.close()

    asyncio.run(scenario())


def test_a_live_gateways_segments_and_other_registries_are_left_alone(tmp_path) -> None:
    _, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"

    async def scenario() -> None:
        live = recorder(factory, journal_dir)
        await record_all(live, tid, 3)
        other = recorder(factory, journal_dir, fp="other-registry")
        await record_all(other, tid, 2)
        other.close()  # dead, but of another registry
        second = recorder(factory, journal_dir)  # a second gateway on the same directory
        assert second.replayed == 0
        await second.flush()
        assert totals(factory)[0] == 0
        await live.flush()
        assert totals(factory)[0] == 3
        second.close()
        live.close()
        assert [p.name.startswith("usage-other-registry-") for p in journal_dir.iterdir()] == [True]

    asyncio.run(scenario())


def test_a_torn_last_line_is_skipped(tmp_path) -> None:
    _, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"

    async def scenario() -> None:
        dead = recorder(factory, journal_dir)
        await record_all(dead, tid, 4)
        dead.close()
        (segment,) = journal_dir.iterdir()
        with open(segment, "ab") as f:
            f.write(b'{"t":%d,"m":29' % tid)  # a write the kill interrupted
        heir = recorder(factory, journal_dir)
        await heir.flush()
        assert totals(factory) == (4, 46, 6)
        heir.close()

    asyncio.run(scenario())


def test_group_commit_fsyncs_once_for_many_concurrent_records(tmp_path) -> None:
    _, factory, tid = registry(tmp_path)

    async def scenario() -> None:
        rec = recorder(factory, tmp_path / "journal")
        await record_all(rec, tid, 200)
        assert 1 <= rec._journal.fsyncs <= 2  # 200 requests, one or two groups
        await rec.flush()
        assert totals(factory)[0] == 200
        rec.close()

    asyncio.run(scenario())


def test_registry_fingerprint_ignores_credentials_and_tells_schemas_apart(tmp_path) -> None:
    a = registry_fingerprint("postgresql://u:p@db:5432/kv")
    assert a == registry_fingerprint("postgresql://other:secret@db:5432/kv")
    assert a != registry_fingerprint("postgresql://u:p@db:5432/kv2")
    assert a != registry_fingerprint("postgresql://u:p@db:5432/kv?options=-csearch_path%3Dx")
    assert registry_fingerprint("sqlite:///./kvgate.db") != registry_fingerprint(f"sqlite:///{tmp_path}/kvgate.db")


def test_an_unwritable_journal_never_fails_the_answer(tmp_path) -> None:
    _, factory, tid = registry(tmp_path)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the journal directory should be")

    async def scenario() -> None:
        rec = UsageRecorder(factory, clock=lambda: NOW, journal=UsageJournal(tmp_path / "journal", registry="reg"))
        rec._journal.directory = blocked  # the volume went away after the start
        assert rec.record(tid, 5, 1) is None  # counted in memory, no error for the request
        await rec.flush()
        assert totals(factory) == (1, 5, 1)
        rec.close()

    asyncio.run(scenario())


def test_lines_arriving_during_a_write_are_the_next_group_of_the_same_drain(tmp_path) -> None:
    """The writer thread takes what queued while it wrote as its next group itself: two
    fsyncs for one request then fifty, every line on disk before its request is told."""
    import threading

    journal = UsageJournal(tmp_path / "journal", registry="reg")
    writing, release = threading.Event(), threading.Event()
    real = journal._write_groups

    def slow_first(groups) -> None:
        if not writing.is_set():
            writing.set()
            release.wait(5)
        real(groups)

    journal._write_groups = slow_first

    async def scenario() -> None:
        segment = journal.new_segment()
        first = journal.append(segment, b'{"t":1,"m":1,"p":1,"c":0}\n')
        while not writing.is_set():
            await asyncio.sleep(0.001)
        rest = [journal.append(segment, b'{"t":1,"m":1,"p":2,"c":0}\n') for _ in range(50)]
        release.set()
        await asyncio.gather(first, *rest)
        assert journal.fsyncs == 2
        assert len(segment.path.read_bytes().splitlines()) == 51
        journal.close([segment])

    asyncio.run(scenario())


def test_a_failed_write_fails_its_group_only_and_the_next_group_is_written(tmp_path) -> None:
    journal = UsageJournal(tmp_path / "journal", registry="reg")

    async def scenario() -> None:
        broken = journal.new_segment()
        os.close(broken.fd)  # the descriptor is gone: os.write fails (EBADF)
        failed = journal.append(broken, b'{"t":1,"m":1,"p":1,"c":0}\n')
        with pytest.raises(OSError, match="usage journal write failed"):
            await failed
        broken.fd = -1
        good = journal.new_segment()
        await journal.append(good, b'{"t":1,"m":1,"p":3,"c":0}\n')
        assert good.path.read_bytes() == b'{"t":1,"m":1,"p":3,"c":0}\n'
        journal.close([good])

    asyncio.run(scenario())


def served_journal(tmp_path, url, factory, sync: str | None) -> UsageJournal:
    """The journal ``kvgate serve`` builds from its settings (``sync``: KVGATE_USAGE_JOURNAL_SYNC; None: unset)."""
    from server.serving import build_serving_app
    from server.settings import Settings

    settings = Settings(database_url=url, admin_tokens=["ci:journal-test-admin-token-0123"],
                        key_pepper="journal-test-pepper-0123456789abcdef", usage_journal_dir=tmp_path / "journal",
                        trace_dir=tmp_path / "traces", **({} if sync is None else {"usage_journal_sync": sync}))
    app = build_serving_app(settings, session_factory=factory, tokenizer_for=lambda pool: None)
    return app.state.gateway.usage._journal


@pytest.mark.parametrize("sync", [None, "fsync", "write"])
def test_the_sync_setting_decides_whether_a_group_is_fsynced(tmp_path, monkeypatch, sync) -> None:
    """``fsync`` (the default): each group fsyncs its segment, a new segment its directory once,
    as always. ``write``: no fsync at all, and each line is readable by another open when its
    append returns (so a SIGKILL, which leaves the page cache alone, loses nothing)."""
    url, factory, _ = registry(tmp_path)
    journal = served_journal(tmp_path, url, factory, sync)
    calls: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)

    async def scenario() -> None:
        first, second = journal.new_segment(), journal.new_segment()
        lines = [b'{"t":1,"m":1,"p":%d,"c":0}\n' % i for i in range(3)]
        for i, line in enumerate(lines):
            await journal.append(first, line)
            with open(first.path, "rb") as other:  # another open: what the kernel holds for the file
                assert other.read() == b"".join(lines[:i + 1])
        await journal.append(second, lines[0])
        assert second.path.read_bytes() == lines[0]
        on_first, on_second = calls.count(first.fd), calls.count(second.fd)
        others = len(calls) - on_first - on_second
        if sync == "write":
            assert calls == []
        else:  # one fsync per group on the segment, one on the directory per new segment
            assert (on_first, on_second, others) == (3, 1, 2)
        assert journal.fsyncs == 4  # group commits done, in either mode
        journal.close([first, second])

    asyncio.run(scenario())
