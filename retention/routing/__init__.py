"""Routing core (pure): which replica of a pool serves a request.

``types`` (candidates, requests, matches, decisions), ``affinity`` (client keys and
stored conversations' roots → home replica), ``index`` (per-replica block
indexes: precise from KV events, approximate from routing decisions), ``load``
(in-flight load per replica), ``cost`` (expected prefill after reuse + load, softmax
choice), ``router`` (one interface: random, round-robin, session, kv-aware), ``tuning``
(``kv-adaptive``: kv-aware whose load band follows the measured imbalance), ``factory``
(``make_router``: every router by name) and ``sync`` (gateways applying one another's
dispatches). Callers:
the gateway (``server/gateway/replicas/routing.py``) and ``retention/simulation/cluster_sim.py``. See
docs/architecture.md, "Routing".
"""

from retention.routing.affinity import ConversationRoots, affinity_key, conversation_key, home_replica
from retention.routing.cost import CostModel, choose, rendezvous
from retention.routing.index import ApproximateIndex, BlockIndex, CapacityModel, PreciseIndex
from retention.routing.load import LoadTracker
from retention.routing.sync import Notice, PeerLoads, dispatch_notice
from retention.routing.factory import ROUTER_NAMES, make_router
from retention.routing.router import (
    KvAwareRouter,
    RandomRouter,
    RoundRobinRouter,
    Router,
    SessionRouter,
    approximate_indexes,
)
from retention.routing.tuning import BandController, BandTuning, SelfTuningRouter
from retention.routing.types import (
    NO_MATCH,
    Candidate,
    Decision,
    PrefixMatch,
    ReplicaId,
    ReplicaLoad,
    ReplicaScore,
    RouteRequest,
    RoutingError,
)

__all__ = [
    "NO_MATCH", "ROUTER_NAMES", "ApproximateIndex", "BandController", "BandTuning", "BlockIndex", "Candidate", "CapacityModel", "ConversationRoots", "CostModel",
    "Decision", "KvAwareRouter", "LoadTracker", "Notice", "PeerLoads", "PreciseIndex", "PrefixMatch",
    "RandomRouter", "ReplicaId", "ReplicaLoad", "ReplicaScore", "RoundRobinRouter", "RouteRequest", "Router",
    "RoutingError", "SelfTuningRouter", "SessionRouter", "affinity_key", "approximate_indexes", "conversation_key", "home_replica", "choose", "dispatch_notice", "make_router", "rendezvous",
]
