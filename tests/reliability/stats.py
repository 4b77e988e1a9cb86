"""Two-sample statistics for the timing-oracle tests (numpy only, no SciPy).

The tests compare two populations measured *interleaved* (one random order, so machine
noise from other processes hits both alike) with rank statistics, which a few huge
outliers from a busy shared machine cannot move:

* :func:`mann_whitney` - the U test (two-sided p, normal approximation with tie
  correction; fine for n >= 20 per side);
* :func:`hodges_lehmann` - the shift estimate (median of all pairwise differences),
  i.e. "how much slower is B than A", in the samples' unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Comparison:
    n_a: int
    n_b: int
    median_a: float
    median_b: float
    shift: float  # Hodges-Lehmann estimate of B - A
    p_value: float  # two-sided Mann-Whitney

    def as_dict(self, unit_scale: float = 1.0, digits: int = 3) -> dict[str, float | int]:
        return {"n": min(self.n_a, self.n_b), "median_a": round(self.median_a * unit_scale, digits),
                "median_b": round(self.median_b * unit_scale, digits),
                "shift_b_minus_a": round(self.shift * unit_scale, digits), "p_value": round(self.p_value, 4)}


def _ranks(values: np.ndarray) -> tuple[np.ndarray, float]:
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), dtype=float)
    sorted_values = values[order]
    i = 0
    tie_term = 0.0
    while i < len(values):
        j = i
        while j + 1 < len(values) and sorted_values[j + 1] == sorted_values[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        t = j - i + 1
        tie_term += t ** 3 - t
        i = j + 1
    return ranks, tie_term


def mann_whitney(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided p-value that ``a`` and ``b`` come from the same distribution."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    n1, n2 = len(a), len(b)
    ranks, tie_term = _ranks(np.concatenate([a, b]))
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12.0 * ((n + 1) - tie_term / (n * (n - 1))))
    if sigma == 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2.0) - 0.5) / sigma
    return float(math.erfc(max(z, 0.0) / math.sqrt(2.0)))


def hodges_lehmann(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.median(np.subtract.outer(b, a)))


def compare(a, b) -> Comparison:
    a, b = np.asarray(a, float), np.asarray(b, float)
    return Comparison(len(a), len(b), float(np.median(a)), float(np.median(b)), hodges_lehmann(a, b),
                      mann_whitney(a, b))
