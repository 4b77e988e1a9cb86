"""The replica KV event ring: non-destructive reads, cursors, resync by snapshot."""

from __future__ import annotations

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
