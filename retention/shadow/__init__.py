"""Sampled shadow pools (DESIGN §9): estimate what capacities and policies would buy, online.

* :mod:`~retention.shadow.sampling` — the fixed hash slice (SHARDS spatial sampling);
* :mod:`~retention.shadow.pool` — :class:`ShadowPool`, the real block pool on the slice;
* :mod:`~retention.shadow.curve` — :class:`MissRatioCurve`, shadows at several capacities;
* :mod:`~retention.shadow.duel` — :class:`PolicyDuel`, candidate policies side by side with
  hysteresis (set dueling), the selection ``adaptive`` runs.

Pure like the rest of ``retention/``: callers pass hashes, plans and ``now``.
"""

from retention.shadow.curve import CurvePoint, MissRatioCurve
from retention.shadow.pool import ShadowCounts, ShadowOutcome, ShadowPool
from retention.shadow.sampling import HashSample

__all__ = ["CurvePoint", "HashSample", "MissRatioCurve", "ShadowCounts", "ShadowOutcome", "ShadowPool"]
