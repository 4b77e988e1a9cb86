"""Belady's offline optimum (MIN) for the simulator's single-tier prefix-cache model.

The model (the one ``kvgate simulate --hold none`` runs the pool in):

* one tier of ``C`` blocks of ``B`` tokens; requests are served one at a time in
  timestamp order and release their blocks before the next one arrives;
* request ``r`` has ``total_r = ceil(len_r / B)`` blocks, of which ``full_r = len_r // B``
  are full; only the first ``match_r = (len_r - 1) // B`` can be hits (the pool never
  matches the last prompt token — TensorRT-LLM ``WindowBlockManager::addSequence``);
* its hits are the longest prefix of its first ``match_r`` blocks present in the cache;
  while it runs, all ``total_r`` blocks are resident (a request with ``total_r > C`` is
  rejected and changes nothing); afterwards its ``full_r`` full blocks are cached;
* hit rate = hit tokens / prompt tokens, hit tokens = hit blocks × ``B``.

MIN evicts, on demand, the cached block whose next use (next request whose matchable
prefix contains it) is farthest, deepest first on ties. A parent is used whenever its
child is, so its next use is never later than the child's; with the depth tie-break the
cache stays prefix-closed and MIN's block hits are exactly prefix hits. MIN maximises
hits among all demand-paging policies for this model (the classic exchange argument),
so it is the ceiling for every policy run on one tier of ``C`` blocks.
``tests/retention/test_belady.py`` checks it against exhaustive search on small traces.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

NEVER = 1 << 62


@dataclass(frozen=True, slots=True)
class ChainRequest:
    """A request reduced to what the model needs: chained keys of its full blocks."""

    keys: tuple[int, ...]  # one key per full block, chained (equal key = equal prefix)
    total_blocks: int
    matchable_blocks: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class BeladyResult:
    capacity_blocks: int
    hit_tokens: int
    prompt_tokens: int
    rejected: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def chain_request(keys: Sequence[int], prompt_tokens: int, tokens_per_block: int) -> ChainRequest:
    full = prompt_tokens // tokens_per_block
    return ChainRequest(
        keys=tuple(keys[:full]),
        total_blocks=-(-prompt_tokens // tokens_per_block),
        matchable_blocks=(prompt_tokens - 1) // tokens_per_block,
        prompt_tokens=prompt_tokens,
    )


def next_uses(requests: Sequence[ChainRequest]) -> list[list[int]]:
    """For each request and full block: index of the next request that can hit it (NEVER if none)."""
    upcoming: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for r in range(len(requests) - 1, -1, -1):
        req = requests[r]
        out[r] = [upcoming.get(key, NEVER) for key in req.keys]
        for key in req.keys[: req.matchable_blocks]:
            upcoming[key] = r
    return out


def belady(requests: Sequence[ChainRequest], capacity_blocks: int, tokens_per_block: int) -> BeladyResult:
    """Hit tokens of MIN at ``capacity_blocks`` (see the module docstring for the model)."""
    nxt = next_uses(requests)
    cache: dict[int, tuple[int, int]] = {}  # key -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key), lazily invalidated
    hit_tokens = prompt_tokens = rejected = 0
    for r, req in enumerate(requests):
        prompt_tokens += req.prompt_tokens
        hits = 0
        for key in req.keys[: req.matchable_blocks]:
            if key not in cache:
                break
            hits += 1
        if req.total_blocks > capacity_blocks:
            rejected += 1
            # Nothing moves, but the cached blocks this request could use are now "used".
            for i, key in enumerate(req.keys[: req.matchable_blocks]):
                if key in cache:
                    _touch(cache, heap, key, nxt[r][i], i)
            continue
        hit_tokens += hits * tokens_per_block
        path = set(req.keys[:hits])
        overflow = len(cache) + req.total_blocks - hits - capacity_blocks
        kept: list[tuple[int, int, int]] = []
        while overflow > 0:
            entry = heapq.heappop(heap)
            key = entry[2]
            if cache.get(key) != (-entry[0], -entry[1]):
                continue  # stale
            if key in path:
                kept.append(entry)
                continue
            del cache[key]
            overflow -= 1
        for entry in kept:
            heapq.heappush(heap, entry)
        for i, key in enumerate(req.keys):
            _touch(cache, heap, key, nxt[r][i], i)
    return BeladyResult(capacity_blocks, hit_tokens, prompt_tokens, rejected)


def _touch(cache: dict[int, tuple[int, int]], heap: list, key: int, next_use: int, depth: int) -> None:
    if cache.get(key) != (next_use, depth):
        cache[key] = (next_use, depth)
        heapq.heappush(heap, (-next_use, -depth, key))
