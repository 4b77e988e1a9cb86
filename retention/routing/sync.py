"""Gateways that share what they dispatch: every gateway's routing hooks, applied by its peers.

Behind one load balancer each gateway replica runs its own router. KV events reach all of
them (every gateway polls every engine), so their indexes agree; but load and the blocks
*pending* on a replica (computed by requests in flight, not yet stored) come from a
router's own hooks, so each gateway sees only its share. Two turns of one conversation
that cross gateways then miss each other's in-flight prefix, and the load band bounds
half the traffic. Dynamo meets the same problem with ``--router-replica-sync`` (router
replicas publish and subscribe to active-sequence lifecycle events;
``docs/components/router/router-operations.md``, "Active Block Replica Synchronization").
kvgate does the same: each gateway publishes its hooks as :class:`Notice` s and applies its
peers' to its own router through the same hooks, keyed ``(gateway, request id)``::

    own request:  route ─► on_dispatch ─► publish DISPATCH (replica, hashes, tokens, predicted reuse)
                  first token ─► on_prefill_done ─► publish FIRST_TOKEN
                  end ─► on_complete ─► publish COMPLETE
    peer notice:  PeerLoads.apply ─► the same hook on this gateway's router
    heartbeat:    every gateway publishes one per pool every ``lease_s / 3``, naming its requests in
                  flight there and which of them are past their first token; a peer's request the
                  heartbeat does not name is over (its COMPLETE was lost) and leaves the load, one
                  it names as decoding leaves the queued prefill (its FIRST_TOKEN was lost); a peer
                  silent for ``lease_s`` is gone (crashed, partitioned): PeerLoads.expire completes
                  its requests

Invariants: a peer's request is in this router's load at most once, between its DISPATCH
and its COMPLETE, the first heartbeat of its gateway that does not name it, or its gateway's
expiry; notices of this gateway itself are ignored; duplicates and a COMPLETE without a
DISPATCH are no-ops (the hooks are idempotent). So, as long as each gateway's notices arrive in
the order it sent them (one publisher per gateway, one channel per pool), a notice lost or
replayed leaves load (running or queued prefill) behind for at most one heartbeat period, and a
gateway gone for at most the lease. A notice is bounded in size, block hashes, token counts and
replica id (the constants below): one past a bound is refused like any malformed one, and
``dispatch_notice`` keeps this gateway's own within them. Pure: the transport (``server/gateway/replicas/peer_sync.py``) and the clock belong to the
caller.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from retention.routing.router import Router
from retention.routing.types import Decision, PrefixMatch, RouteRequest, RoutingError

NoticeKind = Literal["dispatch", "first_token", "complete", "heartbeat"]
KINDS: tuple[str, ...] = ("dispatch", "first_token", "complete", "heartbeat")

# Bounds of a notice, so that one message (a peer's bug, or anything else on the channel) costs a
# gateway a bounded time and cannot skew its load beyond a few half-lives of recent prefill:
MAX_NOTICE_HASHES = 2**16  # block hashes of a dispatch: a 2M-token prompt at the pools' default 32 tokens
# per block; a longer prompt's notice carries its first MAX_NOTICE_HASHES (``dispatch_notice``), so
# peers see only the rest of it as not pending. Parsed and applied in ~25 ms.
MAX_NOTICE_TOKENS = 2**24  # prompt and output tokens (and reused blocks, each at least a token): above
# any model's context window (the longest are ~10M tokens) and the API's max_tokens (1M)
MAX_REPLICA_ID = 2**31 - 1  # replicas are the registry's ids, INTEGER columns (tenants.common.MAX_ID)
MAX_NOTICE_BYTES = 2 * 2**20  # refused before parsing: holds the largest dispatch (MAX_NOTICE_HASHES
# 64-bit hashes of at most 21 characters each, ~1.4 MB) and a heartbeat naming ~50,000 requests in
# flight on one gateway in one pool (a 16-character id named twice, ~38 bytes each); parsing the worst
# message of this size (small numbers) takes ~50 ms


@dataclass(frozen=True, slots=True)
class Notice:
    """One routing hook of gateway ``gateway`` (or its heartbeat), as its peers apply it.

    ``reused_blocks`` is the reuse the dispatching router predicted (held + pending blocks on
    the chosen replica), so a peer counts the same queued prefill as the dispatcher
    (``Router.on_dispatch`` reads only that sum of the match). ``in_flight``: a heartbeat's
    request ids of its gateway in flight in the pool when it was sent; None (a heartbeat that
    names none, as a gateway of an earlier version sends): liveness only, nothing is ended.
    ``decoding``: those of them past their first token (None: not said, as an earlier version's
    heartbeat; nothing is marked).
    """

    gateway: str
    kind: NoticeKind
    request_id: str = ""
    replica: int = 0
    hashes: tuple[int, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    reused_blocks: int = 0
    in_flight: tuple[str, ...] | None = None
    decoding: tuple[str, ...] | None = None

    def encode(self) -> bytes:
        """Compact JSON (a list, in field order): what travels between gateways."""
        if self.kind == "dispatch":
            body: list = [self.gateway, self.kind, self.request_id, self.replica, list(self.hashes),
                          self.prompt_tokens, self.output_tokens, self.reused_blocks]
        elif self.kind == "heartbeat":
            body = [self.gateway, self.kind]
            if self.in_flight is not None:
                body.append(list(self.in_flight))
                if self.decoding is not None:
                    body.append(list(self.decoding))
        else:
            body = [self.gateway, self.kind, self.request_id]
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> Notice:
        """Parse :meth:`encode`'s output; anything else raises :class:`RoutingError`, as does a
        notice past the bounds above (a message over ``MAX_NOTICE_BYTES`` is not parsed)."""
        if len(data) > MAX_NOTICE_BYTES:
            raise RoutingError(f"malformed routing notice: {len(data)} bytes, at most {MAX_NOTICE_BYTES}")
        try:
            body = json.loads(data)
            gateway, kind = str(body[0]), body[1]
            if kind not in KINDS:
                raise ValueError(f"unknown kind {kind!r}")
            if kind == "heartbeat":
                if len(body) == 2:
                    return cls(gateway, kind)
                # elements past these are a later version's: ignored, as this version's are by earlier ones
                if not all(isinstance(ids, list) for ids in body[2:4]):
                    raise ValueError("a heartbeat names its requests in flight, then those decoding, in lists")
                decoding = tuple(str(rid) for rid in body[3]) if len(body) >= 4 else None
                return cls(gateway, kind, in_flight=tuple(str(rid) for rid in body[2]), decoding=decoding)
            if kind != "dispatch":
                return cls(gateway, kind, str(body[2]))
            _, _, rid, replica, hashes, prompt, output, reused = body
            if not isinstance(hashes, list) or len(hashes) > MAX_NOTICE_HASHES:
                raise ValueError(f"a dispatch names at most {MAX_NOTICE_HASHES} block hashes, in a list")
            ints = (replica, prompt, output, reused, *hashes)
            if any(isinstance(v, bool) or not isinstance(v, int) for v in ints):
                raise ValueError("replica, token counts and hashes must be integers")
            if not 0 <= replica <= MAX_REPLICA_ID:
                raise ValueError(f"replica must be in [0, {MAX_REPLICA_ID}]")
            if not (1 <= prompt <= MAX_NOTICE_TOKENS and 0 <= output <= MAX_NOTICE_TOKENS
                    and 0 <= reused <= MAX_NOTICE_TOKENS):
                raise ValueError(f"prompt tokens must be in [1, {MAX_NOTICE_TOKENS}], output tokens and "
                                 f"reused blocks in [0, {MAX_NOTICE_TOKENS}]")
            return cls(gateway, kind, str(rid), replica, tuple(hashes), prompt, output, reused)
        # JSONDecodeError is a ValueError; RecursionError: nesting deeper than the parser (or str) goes
        except (ValueError, TypeError, IndexError, KeyError, RecursionError) as exc:
            raise RoutingError(f"malformed routing notice: {type(exc).__name__}: {str(exc)[:200]}") from None


def dispatch_notice(gateway: str, request: RouteRequest, decision: Decision) -> Notice:
    """The notice of ``request`` dispatched as ``decision`` says (the dispatcher's own hook), within
    the bounds its peers accept: the first ``MAX_NOTICE_HASHES`` block hashes, counts at most
    ``MAX_NOTICE_TOKENS``."""
    match = decision.match
    return Notice(gateway, "dispatch", str(request.request_id), decision.replica,
                  tuple(int(h) for h in request.hashes[:MAX_NOTICE_HASHES]),
                  min(request.prompt_tokens, MAX_NOTICE_TOKENS), min(request.output_tokens, MAX_NOTICE_TOKENS),
                  min(match.blocks + match.pending_blocks, MAX_NOTICE_TOKENS))


@dataclass(slots=True)
class _Peer:
    last_seen: float
    requests: set[str] = field(default_factory=set)


class PeerLoads:
    """Applies peers' notices to ``router`` (module docstring); ``gateway`` is this gateway's id."""

    __slots__ = ("_peers", "gateway", "lease_s", "router")

    def __init__(self, router: Router, gateway: str, *, lease_s: float = 15.0) -> None:
        if not lease_s > 0:
            raise RoutingError("lease_s must be > 0")
        self.router = router
        self.gateway = gateway
        self.lease_s = lease_s
        self._peers: dict[str, _Peer] = {}

    def reset(self, router: Router) -> None:
        """Apply to ``router`` from now on (the pool switched routers: the new one holds no peer load)."""
        self.router = router
        for peer in self._peers.values():
            peer.requests.clear()

    def peers(self) -> list[str]:
        """The peers heard from within the lease, by id (safe to call from another thread)."""
        return sorted(list(self._peers))

    def in_flight(self) -> int:
        """Peers' requests counted in this router's load now (a replica forgotten since drops its
        requests from the load, not from the peer's set; safe to call from another thread)."""
        loads = self.router.loads
        return sum(1 for g, p in list(self._peers.items()) for rid in list(p.requests) if (g, rid) in loads)

    def apply(self, notice: Notice, *, now: float) -> None:
        """Apply one peer notice (this gateway's own are ignored)."""
        if notice.gateway == self.gateway:
            return
        peer = self._peers.get(notice.gateway)
        if peer is None:
            peer = self._peers[notice.gateway] = _Peer(now)
        peer.last_seen = max(peer.last_seen, now)
        if notice.kind == "heartbeat":  # what it does not name is over: its COMPLETE was lost
            if notice.in_flight is None:
                return
            for rid in peer.requests - set(notice.in_flight):
                self.router.on_complete((notice.gateway, rid), now=now)
                peer.requests.discard(rid)
            for rid in notice.decoding or ():  # past its first token: its FIRST_TOKEN may have been lost
                if rid in peer.requests:
                    self.router.on_prefill_done((notice.gateway, rid), now=now)
            return
        key: Hashable = (notice.gateway, notice.request_id)
        router = self.router
        if notice.kind == "dispatch":
            if notice.request_id in peer.requests:
                if router.loads.replica_of(key) == notice.replica:
                    return  # a replayed dispatch
                router.on_complete(key, now=now)  # a retry elsewhere whose COMPLETE was lost
            request = RouteRequest(key, notice.hashes, notice.prompt_tokens, notice.output_tokens)
            decision = Decision(notice.replica, router.name, PrefixMatch(gpu_blocks=notice.reused_blocks))
            router.on_dispatch(request, decision, now=now)
            peer.requests.add(notice.request_id)
        elif notice.kind == "first_token":
            router.on_prefill_done(key, now=now)
        else:
            router.on_complete(key, now=now)
            peer.requests.discard(notice.request_id)

    def apply_all(self, notices: Iterable[Notice], *, now: float) -> None:
        for notice in notices:
            self.apply(notice, now=now)

    def expire(self, *, now: float) -> list[str]:
        """Forget peers silent for ``lease_s``: their requests leave the load. Returns their ids."""
        gone = [g for g, p in self._peers.items() if now - p.last_seen > self.lease_s]
        for gateway in gone:
            for rid in self._peers.pop(gateway).requests:
                self.router.on_complete((gateway, rid), now=now)
        return gone


__all__ = ["KINDS", "MAX_NOTICE_BYTES", "MAX_NOTICE_HASHES", "MAX_NOTICE_TOKENS", "MAX_REPLICA_ID", "Notice",
           "NoticeKind", "PeerLoads", "dispatch_notice"]
