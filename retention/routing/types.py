"""Value types of the routing core: candidates, requests, prefix matches, scores, decisions.

Shared by every router (``router.py``), the indexes (``index.py``), the load tracker
(``load.py``) and the cost (``cost.py``), and by the two callers: the gateway
(``server/gateway/replicas/routing.py``) and the cluster simulator (``retention/simulation/cluster_sim.py``).

Replicas are named by the registry's integer id (``ReplicaSnapshot.id``): ids are stable
across gateway replicas, so ties broken by id (or by a hash of request and id) come out
the same in every gateway that sees the same state.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from retention.hashing import block_hashes
from retention.types import BlockHash

ReplicaId = int


class RoutingError(ValueError):
    """Misuse of the routing API (no candidates, bad weight, unknown request)."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load as the cost sees it.

    ``queued_prefill_tokens``: prompt tokens routed there and not yet prefilled (waiting or
    prefilling), after predicted reuse. ``active_blocks``: KV blocks held by its running
    requests (prompt + output reserve). ``running``: requests in flight (dispatched, not
    completed). ``recent_prefill_tokens``: prefill tokens dispatched there, exponentially
    decayed (half-life ``LoadTracker.half_life_s``): the replica's recent compute. Normally tracked by the router itself (``LoadTracker``); a caller that has
    better numbers (an engine's own queue) passes them in :class:`Candidate`.
    """

    queued_prefill_tokens: int = 0
    active_blocks: int = 0
    running: int = 0
    recent_prefill_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica the request may go to: healthy and ``active`` (the caller filters).

    ``weight`` >= 1 scales the replica's share: the cost divides by it, weighted random /
    round-robin / rendezvous hashing honour it. ``load`` overrides the router's own
    tracked load when given.
    """

    replica: ReplicaId
    weight: int = 1
    load: ReplicaLoad | None = None

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, int) or self.weight < 1:
            raise RoutingError(f"replica {self.replica}: weight must be an integer >= 1, got {self.weight!r}")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router needs to know about one request.

    ``hashes``: kvgate block hashes of the prompt's full blocks
    (``retention.hashing.block_hashes(prompt, tokens_per_block, salt=tenant salt)``), so a
    salted tenant's chain never meets another tenant's. ``prompt_tokens``: prompt length.
    ``output_tokens``: expected output (max tokens), for the KV blocks the request will hold.
    ``session_key``: optional conversation key for the ``session`` router (default: the
    affinity key, else the first block hash, else the request id).
    ``affinity_key``: the client's key for requests that belong together
    (``affinity.affinity_key(tenant, prompt_cache_key)``): kv-aware credits its home replica
    and breaks ties by it; ``session`` sticks to it.
    """

    request_id: Hashable
    hashes: tuple[BlockHash, ...]
    prompt_tokens: int
    output_tokens: int = 0
    session_key: int | None = None
    affinity_key: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.hashes, tuple):
            object.__setattr__(self, "hashes", tuple(self.hashes))
        if self.prompt_tokens < 1 or self.output_tokens < 0:
            raise RoutingError("prompt_tokens must be >= 1 and output_tokens >= 0")

    @classmethod
    def from_tokens(
        cls,
        request_id: Hashable,
        prompt: Sequence[int] | np.ndarray,
        *,
        tokens_per_block: int,
        salt: str | None,
        output_tokens: int = 0,
        extra_key: bytes = b"",
        session_key: int | None = None,
        affinity_key: int | None = None,
    ) -> RouteRequest:
        """Hash ``prompt`` exactly as the engine's pool will (same salt, same extra key)."""
        hashes = block_hashes(prompt, tokens_per_block, salt=salt, extra_key=extra_key)
        return cls(request_id, tuple(hashes), len(prompt), output_tokens, session_key, affinity_key)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Longest prefix of a request's chain that a replica holds, split by tier.

    A chain: counting stops at the first miss. ``gpu_blocks`` + ``host_blocks`` = matched
    blocks; a host block is onboarded (copied back) on reuse, so it is worth less.

    ``pending_blocks``: blocks past that prefix which requests in flight on the replica
    are computing now (the router dispatched them; the engine stores them when they
    finish), so the prefix will be there soon.
    """

    gpu_blocks: int = 0
    host_blocks: int = 0
    pending_blocks: int = 0

    @property
    def blocks(self) -> int:
        """Blocks held now (GPU + host), excluding pending ones."""
        return self.gpu_blocks + self.host_blocks


NO_MATCH = PrefixMatch()


@dataclass(frozen=True, slots=True)
class ReplicaScore:
    """One candidate's terms of the cost (``cost.py``), for logs, metrics and tests."""

    replica: ReplicaId
    match: PrefixMatch
    prefill_blocks: float  # this request's blocks to compute after reuse (host, pending credited)
    queued_prefill_blocks: float  # prefill already queued on the replica
    decode_blocks: float  # KV blocks of its running requests + this request's
    excess_load: float  # load above the least-loaded candidate beyond the balance slack
    cost: float


@dataclass(frozen=True, slots=True)
class Decision:
    """The router's choice. ``scores`` is empty for routers that do not score (random, ...)."""

    replica: ReplicaId
    router: str
    match: PrefixMatch = NO_MATCH  # predicted reuse on the chosen replica
    scores: tuple[ReplicaScore, ...] = ()
