"""Routing sync between gateways (``retention/routing/sync.py``): notices and peers' load."""

from __future__ import annotations

import pytest

from retention.routing import (
    Candidate,
    KvAwareRouter,
    Notice,
    PeerLoads,
    PreciseIndex,
    RouteRequest,
    RoutingError,
    dispatch_notice,
    make_router,
)
from retention.routing.sync import KINDS

BPT = 4
CANDIDATES = [Candidate(0), Candidate(1), Candidate(2)]


def request(rid: str, hashes: tuple[int, ...], prompt: int | None = None) -> RouteRequest:
    return RouteRequest(rid, hashes, prompt if prompt is not None else len(hashes) * BPT + 1, 8)


def test_notices_round_trip_and_malformed_ones_are_refused() -> None:
    notices = [
        Notice("g1", "dispatch", "req-1", 2, (11, -5, 2**63 - 1), 130, 16, 3),
        Notice("g1", "first_token", "req-1"),
        Notice("g1", "complete", "req-1"),
        Notice("g1", "heartbeat"),
        Notice("g1", "heartbeat", in_flight=()),
        Notice("g1", "heartbeat", in_flight=("req-2", "req-3")),
        Notice("g1", "heartbeat", in_flight=("req-2", "req-3"), decoding=("req-3",)),
    ]
    assert {n.kind for n in notices} == set(KINDS)
    assert Notice.decode(b'["g1","heartbeat",[]]') == Notice("g1", "heartbeat", in_flight=())
    assert Notice.decode(b'["g1","heartbeat"]') == Notice("g1", "heartbeat")  # an earlier version's: liveness only
    assert Notice.decode(b'["g1","heartbeat",["r"]]') == Notice("g1", "heartbeat", in_flight=("r",))  # no decoding said
    later = Notice.decode(b'["g1","heartbeat",["r"],["r"],{"a later version": 1}]')  # what it adds is ignored
    assert later == Notice("g1", "heartbeat", in_flight=("r",), decoding=("r",))
    for notice in notices:
        assert Notice.decode(notice.encode()) == notice
        assert Notice.decode(notice.encode().decode()) == notice
    for bad in (b"", b"{}", b"not json", b'["g1"]', b'["g1","evicted","r"]', b'["g1","dispatch","r",1]',
                b'["g1","dispatch","r","1",[],1,1,0]', b'["g1","dispatch","r",1,[1.5],1,1,0]',
                b'["g1","dispatch","r",true,[],1,1,0]', b'["g1","heartbeat","r"]',
                b'["g1","heartbeat",["r"],"r"]',
                b'["g1","dispatch","r",1,[],0,1,0]', b'["g1","dispatch","r",-1,[],5,1,0]',
                b'["g1","dispatch","r",1,[],5,-1,0]', b'["g1","dispatch","r",1,[],5,1,-2]'):
        with pytest.raises(RoutingError, match="malformed routing notice"):
            Notice.decode(bad)


def test_a_peers_request_counts_in_load_until_it_completes_and_pending_until_the_next_report() -> None:
    router = KvAwareRouter(tokens_per_block=BPT)
    peers = PeerLoads(router, "me")
    hashes = (1, 2, 3, 4)
    router.apply_events(1, [], now=0.0)  # replica 1 reports its KV events
    peers.apply(Notice("peer", "dispatch", "a", 1, hashes, 17, 8, 1), now=0.0)
    load = router.loads.load(1, now=0.0)
    assert (load.running, load.queued_prefill_tokens) == (1, 17 - 1 * BPT)
    assert router.match(1, hashes, now=0.0).pending_blocks == 4  # the prefix it computes there
    assert router.match(0, hashes, now=0.0).pending_blocks == 0
    assert peers.in_flight() == 1 and peers.peers() == ["peer"]
    peers.apply(Notice("peer", "dispatch", "a", 1, hashes, 17, 8, 1), now=0.1)  # replayed: counted once
    assert router.loads.load(1, now=0.1).running == 1
    peers.apply(Notice("peer", "first_token", "a"), now=0.2)
    assert router.loads.load(1, now=0.2).queued_prefill_tokens == 0 and router.loads.load(1, now=0.2).running == 1
    peers.apply(Notice("peer", "complete", "a"), now=0.3)
    assert router.loads.load(1, now=0.3).running == 0
    assert router.match(1, hashes, now=0.3).pending_blocks == 4  # until the replica's next report shows it
    router.apply_events(1, [], now=0.35)
    assert router.match(1, hashes, now=0.35).pending_blocks == 0
    assert peers.in_flight() == 0
    peers.apply(Notice("peer", "complete", "a"), now=0.4)  # a second completion changes nothing
    peers.apply(Notice("peer", "complete", "never-dispatched"), now=0.4)
    assert router.loads.load(1, now=0.4).running == 0
    # this gateway's own notices come back through the channel: ignored (its hooks ran already)
    peers.apply(Notice("me", "dispatch", "b", 2, hashes, 17, 8, 0), now=0.5)
    assert router.loads.load(2, now=0.5).running == 0


def test_a_silent_peer_expires_and_its_load_leaves() -> None:
    router = KvAwareRouter(tokens_per_block=BPT)
    peers = PeerLoads(router, "me", lease_s=10.0)
    peers.apply(Notice("lost", "dispatch", "a", 0, (1, 2), 9, 8, 0), now=0.0)
    peers.apply(Notice("alive", "dispatch", "b", 1, (3, 4), 9, 8, 0), now=0.0)
    peers.apply(Notice("alive", "heartbeat", in_flight=("b",)), now=8.0)
    assert peers.expire(now=9.0) == []
    assert peers.expire(now=10.5) == ["lost"]
    assert router.loads.load(0, now=10.5).running == 0
    router.apply_events(0, [], now=10.6)  # what it computed there shows in the replica's next report
    assert router.match(0, (1, 2), now=10.6).pending_blocks == 0
    assert router.loads.load(1, now=10.5).running == 1 and peers.peers() == ["alive"]
    # back after the expiry (a partition healed): its later notices count again
    peers.apply(Notice("lost", "dispatch", "c", 0, (5,), 5, 8, 0), now=11.0)
    assert router.loads.load(0, now=11.0).running == 1
    peers.reset(KvAwareRouter(tokens_per_block=BPT))  # the pool switched routers: no peer load carried over
    assert peers.in_flight() == 0 and peers.router.loads.load(0, now=11.0).running == 0
    with pytest.raises(RoutingError):
        PeerLoads(router, "me", lease_s=0)


def test_a_heartbeat_ends_the_requests_it_does_not_name() -> None:
    """A COMPLETE lost on the way (queue full, a reconnect): the peer's next heartbeat, sent after
    it in the same ordered stream, no longer names the request, so its load and pending blocks go."""
    router = KvAwareRouter(tokens_per_block=BPT)
    peers = PeerLoads(router, "me")
    peers.apply(Notice("peer", "dispatch", "lost", 0, (1, 2), 9, 8, 0), now=0.0)
    peers.apply(Notice("peer", "dispatch", "live", 1, (3, 4), 9, 8, 0), now=0.0)
    peers.apply(Notice("peer", "heartbeat", in_flight=("live", "unknown")), now=5.0)
    assert router.loads.load(0, now=5.0).running == 0
    router.apply_events(0, [], now=5.0)  # replica 0's next report: its pending blocks settle
    assert router.match(0, (1, 2), now=5.0).pending_blocks == 0
    assert router.loads.load(1, now=5.0).running == 1 and peers.in_flight() == 1
    peers.apply(Notice("peer", "heartbeat"), now=7.0)  # names nothing (an earlier version's): liveness only
    assert router.loads.load(1, now=7.0).running == 1
    peers.apply(Notice("peer", "heartbeat", in_flight=()), now=10.0)  # nothing in flight any more
    assert router.loads.load(1, now=10.0).running == 0 and peers.in_flight() == 0


def test_a_heartbeat_repairs_a_lost_first_token() -> None:
    """A FIRST_TOKEN lost on the way: the peer's next heartbeat names the request as decoding, so
    its prompt leaves the replica's queued prefill (it still runs until it completes)."""
    router = KvAwareRouter(tokens_per_block=BPT)
    peers = PeerLoads(router, "me")
    peers.apply(Notice("peer", "dispatch", "a", 0, (1, 2), 9, 8, 0), now=0.0)
    peers.apply(Notice("peer", "dispatch", "b", 0, (3, 4), 9, 8, 0), now=0.0)
    assert router.loads.load(0, now=0.0).queued_prefill_tokens == 18
    peers.apply(Notice("peer", "heartbeat", in_flight=("a", "b")), now=1.0)  # an earlier version's: says nothing
    assert router.loads.load(0, now=1.0).queued_prefill_tokens == 18
    peers.apply(Notice("peer", "heartbeat", in_flight=("a", "b"), decoding=("a", "gone")), now=5.0)
    load = router.loads.load(0, now=5.0)
    assert (load.running, load.queued_prefill_tokens) == (2, 9)
    peers.apply(Notice("peer", "first_token", "a"), now=5.1)  # late or replayed: changes nothing
    peers.apply(Notice("peer", "heartbeat", in_flight=("a", "b"), decoding=("a",)), now=6.0)
    assert router.loads.load(0, now=6.0).queued_prefill_tokens == 9


def test_a_retry_moves_the_peers_request_even_when_its_completion_was_lost() -> None:
    router = KvAwareRouter(tokens_per_block=BPT)
    peers = PeerLoads(router, "me")
    # the gateway's retry order: dispatch on 0, complete (it failed there), dispatch on 1
    for notice in (Notice("peer", "dispatch", "r", 0, (1, 2), 9, 8, 0), Notice("peer", "complete", "r"),
                   Notice("peer", "dispatch", "r", 1, (1, 2), 9, 8, 0)):
        peers.apply(notice, now=0.0)
    assert [router.loads.load(i, now=0.0).running for i in (0, 1)] == [0, 1]
    # the same retry with its COMPLETE lost: the second dispatch names another replica, so it moves
    peers.apply(Notice("peer", "dispatch", "s", 0, (5, 6), 9, 8, 0), now=1.0)
    peers.apply(Notice("peer", "dispatch", "s", 2, (5, 6), 9, 8, 0), now=1.0)
    assert [router.loads.load(i, now=1.0).running for i in (0, 1, 2)] == [0, 1, 1]
    router.apply_events(0, [], now=1.0)  # replica 0's next report shows what the failed try left there
    assert router.match(0, (5, 6), now=1.0).pending_blocks == 0 and router.match(2, (5, 6), now=1.0).pending_blocks == 2
    # a forgotten replica's requests leave the load, and the gauge, though the peer still names them
    router.forget_replica(2)
    assert peers.in_flight() == 1


def test_synced_gateways_choose_as_one_router() -> None:
    """Two gateways, alternate requests, each applying the other's notices at once, choose as one
    router seeing every request; two unsynced ones do not (each balances its half)."""
    # one shared first block, every request still in flight: the load band spreads them, and a
    # gateway that sees only its half of the load spreads later
    shared = [(100, 200 + i) for i in range(40)]

    def place(synced: bool | None) -> list[int]:
        count = 1 if synced is None else 2
        routers = [make_router("kv-aware", tokens_per_block=BPT) for _ in range(count)]
        links = [PeerLoads(r, f"g{i}") for i, r in enumerate(routers)]
        for r in routers:
            for replica in range(3):
                r.set_index(replica, PreciseIndex())
        choices = []
        for i, hashes in enumerate(shared):
            g = i % count
            rq = request(f"r{i}", hashes, prompt=200)
            decision = routers[g].route(rq, CANDIDATES, now=float(i))
            routers[g].on_dispatch(rq, decision, now=float(i))
            notices = [dispatch_notice(f"g{g}", rq, decision)]
            if i % 4 == 3:  # some requests end along the way: first token, then completion
                routers[g].on_prefill_done(rq.request_id, now=float(i))
                routers[g].on_complete(rq.request_id, now=float(i))
                notices += [Notice(f"g{g}", "first_token", rq.request_id), Notice(f"g{g}", "complete", rq.request_id)]
            if synced:
                for link in links:
                    link.apply_all(notices, now=float(i))
                # the hook state itself is one router's: every gateway sees the same load everywhere
                assert len({tuple(r.load(c.replica, now=float(i)) for c in CANDIDATES) for r in routers}) == 1
            choices.append(decision.replica)
        return choices

    one = place(None)
    assert place(True) == one
    assert place(False) != one
    assert dispatch_notice("g", request("x", (1, 2)), make_router("random", tokens_per_block=BPT).route(
        request("x", (1, 2)), CANDIDATES, now=0.0)).reused_blocks == 0


def test_a_notice_past_its_bounds_or_nested_too_deep_is_refused() -> None:
    """What a peer's bug (or anything else on the channel) could send: each refused as malformed,
    never an exception of another kind, never a load beyond a notice's bounds."""
    nested = b"[" * 100_000 + b"]" * 100_000  # deeper than the parser recurses
    for bad in (nested, b'["g1","heartbeat",[' + b"[" * 100_000 + b"]" * 100_000 + b"]]",
                b'["g1","dispatch","r",1,[1],' + str(10**30).encode() + b',4,0]',  # prompt tokens
                b'["g1","dispatch","r",1,[1],5,' + str(10**30).encode() + b',0]',  # output tokens
                b'["g1","dispatch","r",1,[1],5,4,' + str(10**30).encode() + b"]",  # reused blocks
                b'["g1","dispatch","r",' + str(10**30).encode() + b",[1],5,4,0]",  # a phantom replica
                b'["g1","dispatch","r",' + str(2**31).encode() + b",[1],5,4,0]",  # past the registry's ids
                b'["g1","dispatch","r",1,"12",5,4,0]'):  # hashes not a list
        with pytest.raises(RoutingError, match="malformed routing notice"):
            Notice.decode(bad)
    at_bounds = Notice("g1", "dispatch", "r", 2**31 - 1, (1,), 2**24, 2**24, 2**24)
    assert Notice.decode(at_bounds.encode()) == at_bounds
    with pytest.raises(RoutingError, match="malformed routing notice"):
        Notice.decode(Notice("g1", "dispatch", "r", 1, tuple(range(2**16 + 1)), 2**20, 4, 0).encode())
    assert len(Notice.decode(Notice("g1", "dispatch", "r", 1, tuple(range(2**16)), 2**20, 4, 0).encode()).hashes) == 2**16


def test_an_oversize_message_is_refused_before_it_is_parsed(monkeypatch) -> None:
    from retention.routing import sync

    # a valid heartbeat, only too big: 2 MiB and more
    raw = Notice("g1", "heartbeat", in_flight=tuple(f"{i:016x}" for i in range(120_000))).encode()
    assert len(raw) > 2 * 2**20

    def parse(_data):
        raise AssertionError("parsed")

    monkeypatch.setattr(sync.json, "loads", parse)
    with pytest.raises(RoutingError, match="malformed routing notice"):
        Notice.decode(raw)


def test_a_huge_prompt_cannot_skew_recent_load_for_long() -> None:
    router = KvAwareRouter(tokens_per_block=BPT)
    peers = PeerLoads(router, "me")
    with pytest.raises(RoutingError):
        peers.apply(Notice.decode(Notice("g1", "dispatch", "x", 1, (1,), 10**30, 4, 0).encode()), now=0.0)
    peers.apply(Notice.decode(Notice("g1", "dispatch", "x", 1, (1,), 2**24, 4, 0).encode()), now=0.0)
    peers.apply(Notice.decode(Notice("g1", "complete", "x").encode()), now=0.0)
    assert router.loads.load(1, now=3600.0).recent_prefill_tokens < 1.0  # the largest allowed, an hour later


def test_a_dispatch_notice_stays_within_the_bounds_its_peers_accept() -> None:
    """A prompt longer than a notice carries: its first blocks and its counts, capped, still reach peers."""
    long = RouteRequest("long", tuple(range(2**16 + 10)), 2**25, 2**25)
    decision = make_router("random", tokens_per_block=BPT).route(long, CANDIDATES, now=0.0)
    notice = Notice.decode(dispatch_notice("g", long, decision).encode())
    assert notice.hashes == tuple(range(2**16))
    assert (notice.prompt_tokens, notice.output_tokens) == (2**24, 2**24)
