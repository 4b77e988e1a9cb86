"""Belady's figure is the offline optimum of the documented single-tier model (exhaustive check)."""

from __future__ import annotations

import random
from functools import lru_cache
from itertools import combinations

import pytest

from retention.simulation.belady import ChainRequest, belady, chain_request

B = 4


def random_requests(rng: random.Random, count: int) -> list[ChainRequest]:
    out = []
    for _ in range(count):
        depth = rng.randint(1, 3)
        path = tuple(rng.randint(0, 1) for _ in range(depth))  # a small prefix tree
        keys = [hash(path[: i + 1]) for i in range(depth)]
        length = (depth - 1) * B + rng.randint(1, B)
        out.append(chain_request(keys, length, B))
    return out


def optimum(requests: list[ChainRequest], capacity: int) -> int:
    """Best hit tokens over every eviction choice (any superset of what is needed)."""

    @lru_cache(maxsize=None)
    def best(r: int, cache: frozenset) -> int:
        if r == len(requests):
            return 0
        req = requests[r]
        hits = 0
        while hits < req.matchable_blocks and req.keys[hits] in cache:
            hits += 1
        if req.total_blocks > capacity:
            return best(r + 1, cache)
        path = set(req.keys[:hits])
        evictable = sorted(cache - path, key=repr)
        need = len(cache) + req.total_blocks - hits - capacity
        top = 0
        for k in range(max(need, 0), len(evictable) + 1):
            for victims in combinations(evictable, k):
                after = (cache - set(victims)) | set(req.keys)
                top = max(top, best(r + 1, frozenset(after)))
        return hits * B + top

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_belady_matches_exhaustive_optimum(seed: int) -> None:
    rng = random.Random(seed)
    requests = random_requests(rng, rng.randint(3, 7))
    capacity = rng.randint(2, 5)
    assert belady(requests, capacity, B).hit_tokens == optimum(requests, capacity)


def test_belady_is_monotone_in_capacity() -> None:
    rng = random.Random(99)
    requests = random_requests(rng, 200)
    rates = [belady(requests, c, B).hit_tokens for c in range(3, 20)]
    assert rates == sorted(rates) and rates[-1] > rates[0]
