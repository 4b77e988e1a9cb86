"""The replica KV event ring: non-destructive reads, cursors, resync by snapshot."""

from __future__ import annotations

import dataclasses
import json

from engines.pool_stats import PoolStatsReport, TierStats
from engines.kv_events import GPU, HOST, MOVED, REMOVED, STORED, KvEventLog, KvEventsReport, PoolEventFeed, apply_report
from retention.hashing import block_hashes
from retention.pool import BlockPool, PoolConfig


def _log(capacity: int = 8) -> tuple[KvEventLog, dict[int, int]]:
    truth: dict[int, int] = {}
    return KvEventLog(lambda: dict(truth), capacity=capacity), truth


def test_two_pollers_each_see_every_event_once() -> None:
    log, truth = _log()
    mirrors = [{}, {}]
    cursors = [0, 0]
    steps = [(STORED, (1, 2, 3), GPU), (MOVED, (2,), HOST), (REMOVED, (1,), GPU), (STORED, (4,), HOST)]
    for kind, hashes, tier in steps:
        log.append(kind, hashes, tier)
        for h in hashes:
            if kind == REMOVED:
                truth.pop(h)
            else:
                truth[h] = tier
        for i in range(2):
            report = log.report(cursors[i])
            apply_report(mirrors[i], report)
            cursors[i] = report.next_seq
    assert mirrors[0] == mirrors[1] == truth == {2: HOST, 3: GPU, 4: HOST}
    # polling again returns nothing new, and never a snapshot
    again = log.report(cursors[0])
    assert again.events == [] and again.snapshot is None


def test_cursor_off_the_ring_or_invalidated_gets_a_snapshot() -> None:
    log, truth = _log(capacity=2)
    for h in range(1, 6):
        log.append(STORED, (h,), GPU)
        truth[h] = GPU
    assert log.report(0).snapshot == truth  # first poll
    assert log.report(2).snapshot == truth  # seq 2 fell off a ring of 2
    tail = log.report(4)
    assert tail.snapshot is None and [e.seq for e in tail.events] == [4, 5]
    cursor = log.next_seq  # a poller that had seen everything before the loss
    log.invalidate()
    assert log.report(4).snapshot == truth and log.report(cursor).snapshot == truth
    resynced = log.report(0)
    assert log.report(resynced.next_seq).snapshot is None
    assert log.report(log.next_seq + 7).snapshot == truth  # a cursor from another epoch


def test_report_round_trips_through_the_stats_json() -> None:
    log, truth = _log()
    log.append(STORED, (2**64 - 1, 7), HOST)
    truth.update({2**64 - 1: HOST, 7: HOST})
    report = PoolStatsReport(16, TierStats(4, 4, 0), TierStats(0, 0, 0), kv_events=log.report(0))
    back = PoolStatsReport.from_json(report.to_json())
    assert back.kv_events == report.kv_events
    assert back.kv_events.snapshot == truth
    plain = PoolStatsReport.from_json(PoolStatsReport(16, TierStats(4, 4, 0), TierStats(0, 0, 0)).to_json())
    assert plain.kv_events is None
    assert KvEventsReport.from_dict(KvEventsReport.unsupported().to_dict()).supported is False


def test_pool_feed_mirrors_the_pool_in_kvgate_hash_space() -> None:
    pool = BlockPool(PoolConfig(primary_blocks=6, secondary_blocks=4, tokens_per_block=4))
    log = KvEventLog(lambda: {h: int(b.tier) for h, b in pool.cached_blocks().items()})
    feed = PoolEventFeed(log)
    mirror: dict[int, int] = {}
    cursor = 0
    prompts = [list(range(i, i + 12)) for i in (0, 100, 200, 0, 300)]
    for n, tokens in enumerate(prompts):
        salt = "tenant-b" if n == 1 else None
        assert pool.allocate(n, tokens, salt=salt, tenant=None, now=float(n)) is not None
        pool.release(n, tokens, now=float(n))
        feed.feed(pool.take_events())
        report = log.report(cursor)
        apply_report(mirror, report)
        cursor = report.next_seq
        assert mirror == {h: int(b.tier) for h, b in pool.cached_blocks().items()}
    # the hashes are the gateway's own: a prompt's block hashes (salt included) are found
    ours = {h for n, p in enumerate(prompts) for h in block_hashes(p, 4, salt="tenant-b" if n == 1 else None)}
    assert mirror and set(mirror) <= ours
    assert block_hashes(prompts[4], 4)[0] in mirror
    assert set(block_hashes(prompts[1], 4, salt="tenant-b")).isdisjoint(block_hashes(prompts[1], 4))
    assert HOST in mirror.values()  # something was offloaded and reported as moved


def test_every_record_after_an_invalidation_reaches_the_poller() -> None:
    """The producer lost events: its pollers resync by snapshot, and from that snapshot's cursor on
    each poll returns exactly the records appended since (the ring holds no record from before the
    loss whose place the skipped sequence number would shift)."""
    log, truth = _log(capacity=100)
    mirror: dict[int, int] = {}
    cursor = 0

    def poll() -> list[int]:
        nonlocal cursor
        report = log.report(cursor)
        apply_report(mirror, report)
        cursor = report.next_seq
        return [e.seq for e in report.events]

    def change(kind: str, h: int) -> None:
        log.append(kind, (h,), GPU)
        if kind == REMOVED:
            truth.pop(h)
        else:
            truth[h] = GPU

    poll()
    change(STORED, 1)
    change(STORED, 2)
    poll()
    log.invalidate()
    assert log.report(cursor).snapshot == truth  # the cursor from before the loss resyncs
    poll()
    change(STORED, 3)
    assert poll() == [cursor - 1] and mirror == truth
    change(STORED, 4)
    change(STORED, 5)
    change(REMOVED, 1)
    assert len(poll()) == 3 and mirror == truth == {2: GPU, 3: GPU, 4: GPU, 5: GPU}
    for _ in range(3):  # and again, after further losses
        log.invalidate()
        poll()
        change(STORED, 10 + cursor)
        assert poll() == [cursor - 1] and mirror == truth


def test_a_record_of_a_kind_this_reader_does_not_know_asks_for_a_resync() -> None:
    """A newer engine's event kind cannot be applied: the report says resync (the poller asks for
    a snapshot) instead of failing the whole stats answer."""
    data = {"epoch": "e", "next_seq": 9, "supported": True, "snapshot": None,
            "events": [[7, STORED, [1, 2], GPU], [8, "pinned", [2], GPU]]}
    report = KvEventsReport.from_dict(data)
    assert report.resync and report.events == [] and report.snapshot is None and report.next_seq == 0
    known = KvEventsReport.from_dict({**data, "events": data["events"][:1], "next_seq": 8})
    assert not known.resync and [e.seq for e in known.events] == [7]


def test_stats_json_with_fields_of_a_newer_engine_still_parses() -> None:
    report = PoolStatsReport(16, TierStats(4, 3, 1), TierStats(2, 2, 0), reused_blocks=5, tenants={"1": [1, 0]})
    data = json.loads(report.to_json())
    data["preempted_requests"] = 3
    data["primary"]["pinned_blocks"] = 1
    back = PoolStatsReport.from_json(json.dumps(data))
    assert back.unknown_fields == ("preempted_requests", "primary.pinned_blocks")  # named for the poller's log
    assert dataclasses.replace(back, unknown_fields=()) == report
