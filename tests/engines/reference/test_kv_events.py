"""The reference engine reports its KV events in kvgate's hash space, to several pollers."""

from __future__ import annotations

from engines.kv_events import apply_report
from retention.hashing import block_hashes
from tests.engines.reference.conftest import FP8_CONFIG
from tests.engines.reference.helpers import chat_ids, document, infer, make_request, stats, unique_salt

TPB = FP8_CONFIG["tokens_per_block"]


def _engine_cached(server) -> dict[int, int]:
    with server.engine._lock:  # the engine's own lock: a consistent view of its pool
        return server.engine._cached_tiers()


def test_two_pollers_mirror_the_pool_and_match_the_gateway_hashes(fp8_server, tokenizer):
    mirrors: list[dict[int, int]] = [{}, {}]
    cursors = [0, 0]

    def poll(i: int) -> None:
        report = stats(fp8_server.url, cursors[i]).kv_events
        assert report is not None and report.supported
        apply_report(mirrors[i], report)
        cursors[i] = report.next_seq

    poll(0)
    salt = unique_salt()
    ids = chat_ids(tokenizer, document("events-a", 5))
    infer(fp8_server.url, make_request(ids, 2, salt=salt))
    poll(0)
    poll(1)  # first poll of the second gateway: a snapshot
    infer(fp8_server.url, make_request(chat_ids(tokenizer, document("events-b", 5)), 2, salt=unique_salt()))
    poll(0)
    poll(1)
    assert mirrors[0] == mirrors[1] == _engine_cached(fp8_server)
    # the prompt's leading blocks, hashed the way the gateway hashes them, are reported cached
    expected = block_hashes(ids, TPB, salt=salt)[:2]
    assert all(h in mirrors[0] for h in expected)
    assert not any(h in mirrors[0] for h in block_hashes(ids, TPB, salt=unique_salt())[:2])
    # a plain stats call carries no events
    assert stats(fp8_server.url).kv_events is None
