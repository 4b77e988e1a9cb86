"""Routers by name: the one place that knows every router (``router.py``, ``tuning.py``)."""

from __future__ import annotations

import random
from typing import Literal

from retention.routing.cost import CostModel
from retention.routing.router import (
    IndexFactory,
    KvAwareRouter,
    RandomRouter,
    RoundRobinRouter,
    Router,
    SessionRouter,
)
from retention.routing.tuning import BandTuning, SelfTuningRouter
from retention.routing.types import RoutingError

RouterName = Literal["random", "round-robin", "session", "kv-aware", "kv-adaptive"]
ROUTER_NAMES: tuple[str, ...] = ("random", "round-robin", "session", "kv-aware", "kv-adaptive")


def make_router(
    name: str,
    *,
    tokens_per_block: int,
    cost: CostModel = CostModel(),
    index_factory: IndexFactory | None = None,
    rng: random.Random | None = None,
    half_life_s: float = 60.0,
    tuning: BandTuning | None = None,
) -> Router:
    """A router by name (``random | round-robin | session | kv-aware | kv-adaptive``).

    ``half_life_s``: decay of the recent-prefill load signal (``LoadTracker``). ``tuning``:
    the self-tuning band's knobs (``kv-adaptive`` only; default ``BandTuning()``).
    """
    common = {"tokens_per_block": tokens_per_block, "rng": rng, "half_life_s": half_life_s}
    if name == "random":
        return RandomRouter(**common)
    if name == "round-robin":
        return RoundRobinRouter(**common)
    if name == "session":
        return SessionRouter(**common)
    if name == "kv-aware":
        return KvAwareRouter(cost=cost, index_factory=index_factory, **common)
    if name == "kv-adaptive":
        return SelfTuningRouter(cost=cost, tuning=tuning or BandTuning(), index_factory=index_factory, **common)
    raise RoutingError(f"unknown router {name!r}; choose one of {', '.join(ROUTER_NAMES)}")


__all__ = ["ROUTER_NAMES", "RouterName", "make_router"]
