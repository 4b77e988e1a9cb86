"""Building blocks shared by the workload generators: id space, trace lines, samplers.

Every generator works in whole trace blocks (``block_size`` tokens per hash id, 512 like
Mooncake): a prompt is a list of hash ids whose last block may be partial. Equal ids mean
equal tokens (``retention/trace.py`` synthesises the tokens), so a shared prefix is simply
a shared leading run of ids. All randomness comes from one ``random.Random(seed)`` per
trace, so a (spec, seed) pair always yields the same lines.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

MAX_ID = 2**31 - 1  # trace hash ids are int32 (retention/trace.py)


@dataclass(slots=True)
class IdSpace:
    """Hands out fresh hash ids; ids below ``start`` are free for fixed shared content."""

    next_id: int = 0

    def fresh(self, count: int) -> list[int]:
        if self.next_id + count > MAX_ID:
            raise ValueError("trace hash ids exhausted (2^31)")
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids


def prompt_line(
    at_s: float,
    ids: Sequence[int],
    *,
    block_size: int,
    tail_tokens: int,
    output_tokens: int,
    tenant: str | None = None,
    system_blocks: int | None = None,
    context_blocks: int | None = None,
    cache_key: str | None = None,
) -> dict:
    """One Mooncake line: ``ids`` full blocks except the last, which holds ``tail_tokens`` (1..B).

    ``cache_key``: the conversation's ``prompt_cache_key`` (what a client sends to keep a
    conversation's requests together; the router's affinity key).
    """
    if not 1 <= tail_tokens <= block_size:
        raise ValueError("tail_tokens must be within [1, block_size]")
    line: dict = {
        "timestamp": round(at_s * 1000.0, 3),
        "input_length": (len(ids) - 1) * block_size + tail_tokens,
        "output_length": output_tokens,
        "hash_ids": list(ids),
    }
    if tenant is not None:
        line["tenant"] = tenant
    if system_blocks is not None:
        line["system_tokens"] = system_blocks * block_size
    if context_blocks is not None:
        line["context_tokens"] = context_blocks * block_size
    if cache_key is not None:
        line["prompt_cache_key"] = cache_key
    return line


def respond(line: dict, response_id: str, previous: str | None, *, tools: bool) -> dict:
    """``line`` as an OpenAI Responses request: it produces the stored response ``response_id``,
    continues ``previous`` (if any) and offers tools or not (``retention/trace.py``)."""
    line["response_id"] = response_id
    if previous is not None:
        line["previous_response_id"] = previous
    line["store"] = True
    line["offers_tools"] = tools
    return line


def deletions(at_s: float, response_ids: Sequence[str], tenant: str | None = None) -> list[dict]:
    """``delete_response`` event lines for ``response_ids`` at ``at_s`` (``retention/trace.py``)."""
    out = []
    for response_id in response_ids:
        line: dict = {"timestamp": round(at_s * 1000.0, 3), "op": "delete_response", "response_id": response_id}
        if tenant is not None:
            line["tenant"] = tenant
        out.append(line)
    return out


def partial(rng: random.Random, block_size: int) -> int:
    """Tokens in a prompt's last block: the new message fills part of it (B/4 .. B)."""
    return block_size // 4 + rng.randrange(block_size - block_size // 4) + 1 if block_size >= 4 else block_size


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    """A lognormal draw with the given median (``exp(mu)``) and shape ``sigma``."""
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


class Zipf:
    """Draws ranks 0..n-1 with P(rank k) ∝ 1 / (k + 1)^s (inverse CDF over precomputed weights)."""

    def __init__(self, n: int, s: float) -> None:
        if n < 1 or s < 0:
            raise ValueError("Zipf needs n >= 1 and s >= 0")
        total = 0.0
        self._cdf: list[float] = []
        for k in range(n):
            total += 1.0 / (k + 1) ** s
            self._cdf.append(total)

    def draw(self, rng: random.Random) -> int:
        return min(bisect.bisect_left(self._cdf, rng.random() * self._cdf[-1]), len(self._cdf) - 1)


def weighted_choice(rng: random.Random, values: Sequence[int], weights: Sequence[float]) -> int:
    return rng.choices(values, weights=weights, k=1)[0]


def finish(lines: list[dict]) -> list[dict]:
    """Sorted by timestamp (stable: equal times keep generation order)."""
    lines.sort(key=lambda line: line["timestamp"])
    return lines


def phased(first: list[dict], second: list[dict], *, gap_s: float = 1.0) -> list[dict]:
    """``first`` then ``second``: a workload that changes character half-way.

    ``second`` is shifted to start ``gap_s`` after ``first`` ends, and its hash ids are
    offset past every id of ``first`` so the phases share no blocks.
    """
    end_ms = max((line["timestamp"] for line in first), default=0.0)
    offset = 1 + max((max(line["hash_ids"]) for line in first if line.get("hash_ids")), default=-1)
    shifted = []
    for line in second:
        moved = dict(line)
        moved["timestamp"] = round(line["timestamp"] + end_ms + gap_s * 1000.0, 3)
        if "hash_ids" in line:  # event lines (``op``) carry none
            moved["hash_ids"] = [h + offset for h in line["hash_ids"]]
        if max(moved.get("hash_ids", ()), default=0) > MAX_ID:
            raise ValueError("trace hash ids exhausted (2^31)")
        shifted.append(moved)
    return [dict(line) for line in first] + shifted
