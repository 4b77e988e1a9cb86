"""The Triton model reports TensorRT-LLM's KV events in kvgate's block-hash space.

Against the executor double (tests/engines/triton/fake_trtllm.py), whose block hash is
its own (like the real one, unrelated to kvgate's): the gateway must see kvgate hashes.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np

import engines.contract as contract
import engines.response_tensors as response_tensors
from engines.contract import EngineRequest, SamplingParams, encode_request
from engines.pool_stats import PoolStatsReport
from engines.kv_events import GPU, HOST, apply_report
from engines.trtllm.block_key import trt_root_hash
from engines.trtllm.kv_event_translator import KvEventTranslator
from retention.hashing import block_hashes
from retention.types import RetentionPlan
from tests.engines.triton.conftest import make_harness

PROMPT = tuple(range(100, 100 + 80))  # 2 full blocks of 32 + 16 tokens
OTHER = tuple(range(500, 500 + 64))


def send(h, ids, salt, tenant):
    tensors = encode_request(EngineRequest(input_ids=ids, max_new_tokens=4, end_id=None, streaming=False,
                                           sampling=SamplingParams(), retention=RetentionPlan(), cache_salt=salt,
                                           tenant_id=tenant))
    sender = h.send(tensors)
    assert sender.finished.is_set()


def poll(h, since):
    sender = h.send({contract.KV_STATS.name: np.array([True]),
                     contract.KV_EVENTS_SINCE.name: np.array([since], np.uint64)})
    [(response, _)] = sender.responses
    return PoolStatsReport.from_json(response.tensors()[response_tensors.KV_CACHE_STATS.name][0]).kv_events


def test_stored_offloaded_and_removed_blocks_arrive_as_kvgate_hashes(harness):
    send(harness, PROMPT, "a", "tenant-a")
    send(harness, OTHER, "b", "tenant-b")
    send(harness, PROMPT, "a", "tenant-a")  # reuse: nothing new stored
    mirror: dict[int, int] = {}
    first = poll(harness, 0)
    assert first.supported and first.snapshot is not None
    apply_report(mirror, first)
    a, b = block_hashes(PROMPT, 32, salt="a"), block_hashes(OTHER, 32, salt="b")
    assert mirror == {a[0]: GPU, a[1]: GPU, b[0]: GPU, b[1]: GPU}
    assert not set(mirror) & set(harness.executor.tree)  # never TensorRT-LLM's own hashes

    # TensorRT-LLM hashes in storing order: two full blocks and the partial one stored at release
    # (kvgate reports full blocks only)
    trt_a = [h for h, blk in harness.model.ledger._blocks.items() if blk.tenant == "tenant-a"]
    trt_b = [h for h, blk in harness.model.ledger._blocks.items() if blk.tenant == "tenant-b"]
    assert len(trt_a) == len(trt_b) == 3
    harness.executor.offload(trt_a[1])
    harness.executor.evict(trt_b[1])  # and its partial child (freeChildren)
    later = poll(harness, first.next_seq)
    assert later.snapshot is None and [e.kind for e in later.events] == ["moved", "removed"]
    apply_report(mirror, later)
    assert mirror == {a[0]: GPU, a[1]: HOST, b[0]: GPU}
    # a second poller starting now gets the same state from a snapshot
    assert poll(harness, 0).snapshot == mirror


def test_orchestrator_mode_reports_no_events(tmp_path, monkeypatch):
    h = make_harness(tmp_path, monkeypatch, spec_name="llama-3.1-70b-instruct-fp8-tp8")
    try:
        send(h, PROMPT, "a", "tenant-a")
        report = poll(h, 0)
        assert report is not None and not report.supported  # the gateway falls back to approximate routing
    finally:
        h.model.finalize()


class _Tok:
    def __init__(self, token_id):
        self.token_id = token_id


class _Block:
    def __init__(self, block_hash, tokens, cache_level=0):
        self.block_hash, self.tokens, self.cache_level = block_hash, [_Tok(t) for t in tokens], cache_level


class _Stored:
    def __init__(self, parent_hash, blocks):
        self.parent_hash, self.blocks = parent_hash, blocks


class _Event:
    def __init__(self, event_id, data):
        self.event_id, self.data = event_id, data


def test_unknown_roots_and_parents_are_not_reported_and_gaps_force_a_resync():
    t = KvEventTranslator(tokens_per_block=4)
    t.apply([_Event(1, _Stored(None, [_Block(11, [1, 2, 3, 4])]))])  # no request expected this root
    t.apply([_Event(2, _Stored(77, [_Block(12, [5, 6, 7, 8])]))])  # parent never seen
    assert t.log.report(0).snapshot == {}
    t.note_request("s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    t.apply([_Event(3, _Stored(None, [_Block(21, [1, 2, 3, 4]), _Block(22, [5, 6, 7, 8])]))])  # not s's root hash
    assert t.log.report(0).snapshot == {} and t.unmatched_roots == 2
    t.apply([_Event(4, _Stored(None, [_Block(trt_root_hash([1, 2, 3, 4], "s"), [1, 2, 3, 4]), _Block(22, [5, 6, 7, 8])]))])
    expected = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, salt="s")
    cursor = t.log.next_seq
    assert t.log.report(0).snapshot == {expected[0]: GPU, expected[1]: GPU}
    t.apply([_Event(6, _Stored(22, [_Block(23, [9, 10, 11, 12])]))])  # event 5 was lost
    # pollers resync from a snapshot; a block stored under a prefix cached before the gap still
    # translates (TensorRT-LLM sends nothing for the reused prefix, so forgetting it would be for good)
    third = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, salt="s")[2]
    assert t.log.report(cursor).snapshot == {expected[0]: GPU, expected[1]: GPU, third: GPU}


# --- attribution of roots to salts (TensorRT-LLM mixes cacheSaltID into the root's block hash) ----

HEADER = tuple(range(900, 932))  # one full block every tenant's prompt starts with (a chat-template header)
A = HEADER + tuple(range(1000, 1040))  # 72 tokens: two full blocks for kvgate
B = HEADER + tuple(range(2000, 2040))


def submit(h, ids, salt, tenant):
    """Hand a request to the model without pumping: it waits for the next iteration."""
    tensors = encode_request(EngineRequest(input_ids=ids, max_new_tokens=4, end_id=None, streaming=False,
                                           sampling=SamplingParams(), retention=RetentionPlan(), cache_salt=salt,
                                           tenant_id=tenant))
    h.model.execute([h.pb.InferenceRequest(tensors)])


def salted(ids, salt):
    return set(block_hashes(ids, 32, salt=salt))


def test_a_reused_root_never_lends_its_salt_to_another_tenants_chain(harness):
    # Before: the reused request stayed pending with the header's tokens (a reused root emits no stored
    # event) and tenant-b's fresh root, same header, was filed under salt a.
    send(harness, A, "a", "tenant-a")
    harness.executor.auto_run = False
    submit(harness, A, "a", "tenant-a")  # reuses a's root: no stored event for it
    submit(harness, B, "b", "tenant-b")  # same first block, other salt: a fresh root, stored
    while harness.executor.active:
        harness.executor.step()
    harness.model.pump(timedelta(0))
    mirror: dict[int, int] = {}
    apply_report(mirror, poll(harness, 0))
    assert set(mirror) == salted(A, "a") | salted(B, "b")
    tenants = harness.model.ledger.tenants()
    assert tenants == {"tenant-a": [3, 0], "tenant-b": [3, 0]}  # two full blocks + the partial one each


def test_events_later_than_their_request_are_translated_under_their_own_salt(tmp_path, monkeypatch):
    # The event manager's worker hands an iteration's events over after its responses (event_lag):
    # the model has forgotten the finished request when they arrive. Before: the late root went to the
    # next pending request with the same header — tenant-b's — and a's chain was filed under salt b.
    h = make_harness(tmp_path, monkeypatch, event_lag=2)
    try:
        send(h, A, "a", "tenant-a")
        assert h.model.kv_events.log.report(0).snapshot == {}  # not arrived yet
        submit(h, B, "b", "tenant-b")
        mirror: dict[int, int] = {}
        for _ in range(4):  # each stats poll drains the event manager once
            report = poll(h, 0)
        apply_report(mirror, report)
        assert set(mirror) == salted(A, "a") | salted(B, "b")
        assert h.model.ledger.tenants() == {"tenant-a": [3, 0], "tenant-b": [3, 0]}
    finally:
        h.model.finalize()


def test_a_build_whose_block_hash_differs_is_reported_once_and_misattributes_nothing(tmp_path, monkeypatch, caplog):
    from tests.engines.triton import fake_block_manager

    real = fake_block_manager.block_key_hash
    monkeypatch.setattr(fake_block_manager, "block_key_hash", lambda tokens, parent, salt: real(tokens, parent, salt) ^ 1)
    h = make_harness(tmp_path, monkeypatch)
    try:
        for i in range(33):
            send(h, tuple(range(3000 + 40 * i, 3000 + 40 * i + 40)), "a", "tenant-a")
        poll(h, 0)
        assert poll(h, 0).snapshot == {}  # nothing reported rather than anything under a guessed salt
        assert h.model.ledger.tenants() == {}
        errors = [r for r in caplog.records if "block hash differs" in r.getMessage()]
        assert len(errors) == 1
    finally:
        h.model.finalize()
