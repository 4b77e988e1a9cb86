"""Affinity keys: a client-chosen key (``prompt_cache_key``) pins requests to a home replica.

OpenAI routes a request by a hash of its prompt's first ~256 tokens, which the client can
override with ``prompt_cache_key`` so that requests sharing the key — one conversation, one
agent — meet on one machine before they share a cached prefix. kvgate does the same inside
the kv-aware cost (``cost.py``)::

    key  = affinity_key(tenant, "conversation-42")      # 64-bit, salted with the tenant
    home = home_replica(key, candidates)                # weighted rendezvous over the pool

The home gets ``CostModel.affinity_credit`` blocks off its cost and wins ties; the load
band still overrules it (load above the band adds to the home's cost like to any other).

A stored conversation (OpenAI Responses ``previous_response_id`` chains) without a client key
is keyed by its root response's id, as the gateway keys it (``conversation_key`` in
``server/gateway/api/responses_convert.py``: the client's ``prompt_cache_key`` wins, else
``kvgate-conversation:<root id>``; ``server/gateway/responses_routes.py`` takes the root from
the stored chain, or the request's own id when it starts a stored conversation).
:class:`ConversationRoots` mirrors that rule for callers that see only request lines (the
cluster simulator)::

    roots = ConversationRoots()
    text  = roots.key(tenant, cache_key=None, response_id="r2", previous_response_id="r1", store=True)
    # "kvgate-conversation:r1" if r1 started the chain: every turn meets on one home replica

Invariants:

* the key depends only on (tenant, key string), never on process state, so every gateway
  replica maps a key to the same home;
* two tenants using the same key string get independent keys (the tenant is hashed in,
  length-prefixed so ``("ab", "c")`` and ``("a", "bc")`` differ);
* the home is the candidate with the highest weighted rendezvous score, so removing a
  replica moves only the keys whose home it was, and a replica of weight 2 is home to about
  twice the keys;
* every turn of one stored conversation gets the same key string (its root's), whatever the
  turn, so long as each turn continues a response the roots have seen stored.
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


CONVERSATION_KEY_PREFIX = "kvgate-conversation:"


def conversation_key(root_id: str | None) -> str | None:
    """The affinity key of a stored conversation: its root response's id. Every turn of one
    conversation carries it, so the router sends them to one home replica (and the turns of
    different conversations spread), even where the cached prefix is gone. Namespaced so that
    it cannot equal a client's own ``prompt_cache_key`` by accident. The gateway's Responses
    route (``server/gateway/api/responses_convert.py``) and the routing simulator both use it."""
    return None if root_id is None else f"{CONVERSATION_KEY_PREFIX}{root_id}"


class ConversationRoots:
    """The root of every stored response seen, per tenant: what the gateway's response store
    answers for a chain (``server/gateway/response_store.py``, ``chain(...).root_id``).

    A response continuing one the roots never saw stored (a trace cut mid-conversation, a
    response stored before the replay) takes the id it continues as its root: the chain as far
    as seen, so its later turns still share one key. State grows with the stored responses
    seen (one entry each); deletions are not modelled (a deleted response is not continued).
    """

    __slots__ = ("_roots",)

    def __init__(self) -> None:
        self._roots: dict[tuple[str | None, str], str] = {}

    def root(self, tenant: str | None, *, response_id: str | None, previous_response_id: str | None,
             store: bool) -> str | None:
        """The request's conversation root (None: not a conversation); records a stored response."""
        if previous_response_id is not None:
            root: str | None = self._roots.get((tenant, previous_response_id), previous_response_id)
        else:
            root = response_id if store else None  # a new stored conversation starts here
        if store and response_id is not None and root is not None:
            self._roots[(tenant, response_id)] = root
        return root

    def key(self, tenant: str | None, *, cache_key: str | None, response_id: str | None,
            previous_response_id: str | None, store: bool) -> str | None:
        """The request's affinity key string, the gateway's rule: the client's ``cache_key`` when
        it sends one, else its conversation's root key, else None. Records the response either way."""
        root = self.root(tenant, response_id=response_id, previous_response_id=previous_response_id, store=store)
        return cache_key if cache_key is not None else conversation_key(root)
