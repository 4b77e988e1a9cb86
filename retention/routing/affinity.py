"""Affinity keys: a client-chosen key (``prompt_cache_key``) pins requests to a home replica.

OpenAI routes a request by a hash of its prompt's first ~256 tokens, which the client can
override with ``prompt_cache_key`` so that requests sharing the key — one conversation, one
agent — meet on one machine before they share a cached prefix. kvgate does the same inside
the kv-aware cost (``cost.py``)::

    key  = affinity_key(tenant, "conversation-42")      # 64-bit, salted with the tenant
    home = home_replica(key, candidates)                # weighted rendezvous over the pool

The home gets ``CostModel.affinity_credit`` blocks off its cost and wins ties; the load
band still overrules it (load above the band adds to the home's cost like to any other).

Invariants:

* the key depends only on (tenant, key string), never on process state, so every gateway
  replica maps a key to the same home;
* two tenants using the same key string get independent keys (the tenant is hashed in,
  length-prefixed so ``("ab", "c")`` and ``("a", "bc")`` differ);
* the home is the candidate with the highest weighted rendezvous score, so removing a
  replica moves only the keys whose home it was, and a replica of weight 2 is home to about
  twice the keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from retention.routing.cost import rendezvous
from retention.routing.types import Candidate, ReplicaId, RoutingError


def affinity_key(tenant: str | None, key: str) -> int:
    """The 64-bit affinity key of ``key`` for ``tenant`` (``None``: no tenant, e.g. a trace)."""
    if not isinstance(key, str):
        raise RoutingError(f"an affinity key must be a string, got {type(key).__name__}")
    owner = (tenant or "").encode()
    data = len(owner).to_bytes(4, "big") + owner + key.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"kvgate-affinity").digest(), "big")


def home_replica(key: int, candidates: Sequence[Candidate]) -> ReplicaId:
    """The candidate ``key`` belongs to: highest weighted rendezvous score, then lowest id."""
    if not candidates:
        raise RoutingError("no candidate replicas")
    return max(candidates, key=lambda c: (rendezvous(key, c.replica, c.weight), -c.replica)).replica
