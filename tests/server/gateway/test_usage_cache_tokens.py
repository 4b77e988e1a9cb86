"""Cache tokens in the usage path: the split the core bills, the journal's optional keys (an older
gateway's line still applies), the recorder's counts through a flush and through a replay.

Real files, real ``flock``, a real migrated SQLite registry (``test_usage_journal.registry``); the
registry's own round trip on both backends is in ``tests/tenants/test_usage.py``, the live
gateway's in ``test_usage_cache_e2e.py``.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
from types import SimpleNamespace

from sqlalchemy import select

from engines.contract import KvMetrics
from retention.policy.hint_quota import HintedPlan
from retention.policy.hints import TTL_1H_MS
from retention.types import RetentionPlan
from server.gateway.api import messages_render
from server.gateway.api.completions import Outcome, cache_usage, cached_tokens
from server.gateway.usage_journal import MAX_TOKENS, decode_lines, encode
from tenants.models import Usage
from tests.server.gateway.test_usage_journal import NOW, recorder, registry, totals
from tests.server.gateway.test_usage_journal_faults import MINUTE, line, orphan

TPB = 16
FIVE_MIN = 300_000


def cache_totals(factory) -> tuple[int, int, int]:  # type: ignore[no-untyped-def]
    with factory() as s:
        rows = s.scalars(select(Usage)).all()
    return (sum(r.cache_read_tokens for r in rows), sum(r.cache_write_5m_tokens for r in rows),
            sum(r.cache_write_1h_tokens for r in rows))


def job(total: int):  # type: ignore[no-untyped-def]
    """What cache_usage reads of a job: the prompt's length and the pool's tokens per block."""
    return SimpleNamespace(prompt=SimpleNamespace(total=total),
                           tenant=SimpleNamespace(pool=SimpleNamespace(tokens_per_block=TPB)))


def hinted(windows: list[int]) -> HintedPlan:
    return HintedPlan(RetentionPlan(()), hashes=tuple(range(len(windows))), windows_ms=tuple(windows))


# The split the core bills ---------------------------------------------------------------------
def test_the_billed_split_is_what_messages_reports_and_never_exceeds_the_prompt() -> None:
    """cache_usage is the Messages split (read, then 5m / 1h) and, read alone, the OpenAI figure;
    read + written never exceeds the prompt, whatever the reuse and the hinted prefix."""
    rng = random.Random(7)
    for _ in range(2000):
        total = rng.randint(1, 40 * TPB)
        full = total // TPB
        windows = [rng.choice((FIVE_MIN, TTL_1H_MS, 2 * TTL_1H_MS)) for _ in range(rng.randint(0, full))]
        outcome = Outcome(kv=KvMetrics(reused_blocks=rng.randint(0, full + 2)),
                          hinted=hinted(windows) if windows or rng.random() < 0.5 else None)
        j = job(total)
        read, five, hour = cache_usage(j, outcome)  # type: ignore[arg-type]
        assert read == cached_tokens(j, outcome)  # type: ignore[arg-type]  # the OpenAI path's cached_tokens
        shown = messages_render.usage(j, outcome)  # type: ignore[arg-type]
        assert (read, five, hour) == (shown["cache_read_input_tokens"],
                                      shown["cache_creation"]["ephemeral_5m_input_tokens"],
                                      shown["cache_creation"]["ephemeral_1h_input_tokens"])
        assert min(read, five, hour) >= 0 and read + five + hour <= total, (total, windows, outcome.kv)
    # a stream billed before its last response: the first response's metrics, as message_start says
    early = Outcome(first_kv=KvMetrics(reused_blocks=3), hinted=hinted([TTL_1H_MS] * 5))
    assert cache_usage(job(100), early) == (48, 0, 32)  # type: ignore[arg-type]
    assert cache_usage(job(100), Outcome()) == (0, 0, 0)  # type: ignore[arg-type]  # no engine response


# The journal's lines -------------------------------------------------------------------------
def test_cache_keys_are_written_only_when_not_zero() -> None:
    plain = encode(3, NOW, 100, 7)
    assert plain == line(3, 100, 7)  # byte for byte what an older gateway wrote
    assert json.loads(encode(3, NOW, 100, 7, 48)) == {"t": 3, "m": MINUTE, "p": 100, "c": 7, "r": 48}
    assert json.loads(encode(3, NOW, 100, 7, 0, 0, 64)) == {"t": 3, "m": MINUTE, "p": 100, "c": 7, "w1": 64}
    [row], skipped = decode_lines(io.BytesIO(encode(3, NOW, 100, 7, 16, 32, 48) + plain))
    assert skipped == 0
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (2, 200, 14)
    assert (row.cache_read_tokens, row.cache_write_5m_tokens, row.cache_write_1h_tokens) == (16, 32, 48)


def test_out_of_range_cache_counts_are_skipped_and_counted() -> None:
    good = encode(1, NOW, 100, 1, 16, 16, 16)
    bad = [json.dumps({"t": 1, "m": MINUTE, "p": 100, "c": 1, key: value}).encode() + b"\n"
           for key, value in (("r", -1), ("w5", MAX_TOKENS), ("w1", True), ("r", "16"), ("w5", 1.5), ("w1", None))]
    rows, skipped = decode_lines([good, *bad, good])
    assert skipped == len(bad)
    [row] = rows
    assert (row.requests, row.cache_read_tokens, row.cache_write_5m_tokens, row.cache_write_1h_tokens) == \
        (2, 32, 32, 32)


def test_an_older_gateways_journal_line_still_applies(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A segment a dead gateway of the previous version left (no cache keys) is adopted and applied,
    its cache counts 0, next to the lines of this version and a poisoned one (skipped, counted)."""
    _, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"
    orphan(journal_dir, "gw-old", line(tid, 100, 5) + line(tid, 40, 2))
    poisoned = json.dumps({"t": tid, "m": MINUTE, "p": 10, "c": 1, "r": -5}).encode() + b"\n"
    orphan(journal_dir, "gw-new", encode(tid, NOW, 200, 3, 96, 64, 32) + poisoned)

    async def scenario() -> None:
        heir = recorder(factory, journal_dir)
        assert heir.replayed == 2
        await heir.flush()
        heir.close()
        assert heir.stats()["unreadable_lines"] == 1

    asyncio.run(scenario())
    assert totals(factory) == (3, 340, 10)
    assert cache_totals(factory) == (96, 64, 32)  # the old lines read 0
    assert list(journal_dir.glob("usage-*")) == []  # applied, removed


# The recorder -------------------------------------------------------------------------------
def test_the_recorder_counts_cache_tokens_through_a_flush_and_a_replay(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, factory, tid = registry(tmp_path)
    journal_dir = tmp_path / "journal"

    async def scenario() -> None:
        live = recorder(factory, journal_dir)
        await live.record(tid, 100, 5, cache_read_tokens=48, cache_write_5m_tokens=32)
        await live.record(tid, 100, 5, 16, 0, 64)  # by position, as the core's sink passes them
        await live.record(tid, 10, 1)  # a caller that passes none: 0
        await live.flush()
        assert totals(factory) == (3, 210, 11) and cache_totals(factory) == (64, 32, 64)
        await live.record(tid, 50, 2, 32, 16, 0)  # only in the journal when the gateway dies
        live.close()
        heir = recorder(factory, journal_dir)
        assert heir.replayed == 1
        await heir.flush()
        heir.close()

    asyncio.run(scenario())
    assert totals(factory) == (4, 260, 13)
    assert cache_totals(factory) == (96, 48, 64)
