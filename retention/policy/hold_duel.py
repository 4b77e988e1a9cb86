"""Set dueling for the conversation hold: hold only while holding measurably pays, judged on what the gateway sees.

DIP (Qureshi et al., ISCA '07) dedicates a few cache sets to each of two insertion
policies and lets the others follow whichever leader misses less. A KV pool has no sets,
but a gateway has *conversations*: each stored conversation falls, by a salted hash of its
root response id (and tenant), into one of three groups::

    u = blake2b(salt, tenant, root) / 2^64 ∈ [0, 1)
    u < share             → "always": its requests are always held (the hold of conversation.py)
    share ≤ u < 2 × share → "never":  never held
    otherwise             → follower: held iff the followers' current arm is "always"

Requests with no conversation (tools offered outside a stored chain) are followers.

**Signal.** A continuation (a request whose ``previous_response_id`` is a live stored response)
reports, when it completes, its cached-token share: usage ``cached_tokens`` / prompt tokens
(the pool's per-request hit in the simulator, the engine's reused blocks in the gateway).
Each leader set keeps decayed sums (decay per observation of that set, ``half_life``
observations)::

    cached[g] ← cached[g] · d + cached_tokens,  prompt[g] ← prompt[g] · d + prompt_tokens,  d = 2^(-1/half_life)
    share[g] = cached[g] / prompt[g]

**Decision.** The followers start on ``never`` (no evidence, no hold: the engine's own LRU);
they move to the other arm when both sets hold ``min_observations`` decayed observations
and the other arm's share leads the current one's by ``margin`` for ``patience``
observations in a row (hysteresis, as :class:`retention.shadow.duel.PolicyDuel` switches).

**What it measures, and what it cannot.** DIP's leader sets are disjoint slices of the
cache; here the leader sets share one pool and one priority order with the followers, so
a leader's share includes its *private* gain: held ``always`` leaders outrank every unheld
block, unheld ``never`` leaders are outranked by every held one. The contest measures "is
it better to be held than not", not "is the pool better off if everybody is held", and it
leans towards holding: on ``agent-loop`` (seed 0, GPU 2 %) the always-leaders find 73 % of
their continuations' prompt cached against the never-leaders' 62 %, the followers hold, and
the pool ends about a point below plain LRU (``bench/retention/conversation.py`` states the figures).
Alternating the arm for the whole pool in time (epochs, an unbiased comparison) was tried
and costs more than it finds: holding in some epochs and not in others put chat 2.4 points
below LRU (a prefix held in one epoch outranks the next epoch's unheld ones). So the duel
bounds the hold's harm to what the private-gain bias lets through; it is not a proof of
"no harm".

Pure and deterministic: no clock, no randomness but the salted hash. Memory: O(1) per ledger.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

Group = Literal["always", "never", "follower"]
ARMS: tuple[Group, Group] = ("never", "always")  # index 0, the incumbent: no hold


@dataclass(frozen=True, slots=True)
class HoldDuelConfig:
    # Each leader set's share of conversations. The generated families have a few hundred
    # conversations, so the sets are larger than DIP's 1/32: 1/8 each (~45 runs per set on
    # agent-loop's 30 minutes).
    leader_share: float = 0.125
    salt: str = "kvgate-hold-duel"
    half_life: float = 256.0  # observations of a leader set
    min_observations: float = 48.0  # decayed observations in *each* set before any switch
    margin: float = 0.01  # share points the other arm's leaders must lead by (the decision's noise bound)
    patience: int = 16  # observations in a row with that lead

    def __post_init__(self) -> None:
        if not 0.0 < self.leader_share <= 0.5:
            raise ValueError("leader_share must be within (0, 0.5]")
        if self.half_life <= 0 or self.min_observations < 0 or self.margin < 0 or self.patience < 0:
            raise ValueError("half_life > 0; min_observations, margin, patience >= 0")


@dataclass(slots=True)
class _Score:
    cached: float = 0.0
    prompt: float = 0.0
    observations: float = 0.0

    @property
    def share(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0

    def add(self, cached_tokens: int, prompt_tokens: int, decay: float) -> None:
        self.cached = self.cached * decay + min(cached_tokens, prompt_tokens)
        self.prompt = self.prompt * decay + prompt_tokens
        self.observations = self.observations * decay + 1.0


@dataclass(slots=True)
class HoldDuel:
    """The followers' arm, decided by the ``always`` and ``never`` leader sets' cached shares."""

    config: HoldDuelConfig = HoldDuelConfig()
    current: int = 0  # index in ARMS the followers apply
    switches: int = 0
    streak: int = 0
    scores: dict[str, _Score] = field(default_factory=lambda: {"always": _Score(), "never": _Score()})
    _decay: float = field(init=False)

    def __post_init__(self) -> None:
        self._decay = 2.0 ** (-1.0 / self.config.half_life)

    def group(self, tenant: str, root: str | None) -> Group:
        """The conversation's set: by a salted hash of its root response id; no root, a follower."""
        if root is None:
            return "follower"
        digest = hashlib.blake2b(f"{self.config.salt}\0{tenant}\0{root}".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "big") / 2.0**64
        share = self.config.leader_share
        return "always" if u < share else "never" if u < 2 * share else "follower"

    @property
    def arm(self) -> Group:
        """The arm the followers apply now."""
        return ARMS[self.current]

    def holds(self, group: Group | None) -> bool:
        """Whether a request of ``group`` is held now (``None``: a follower)."""
        if group in ("always", "never"):
            return group == "always"
        return self.arm == "always"

    def observe(self, group: Group | None, cached_tokens: int, prompt_tokens: int, *, continuation: bool) -> None:
        """A request was served with ``cached_tokens`` of ``prompt_tokens`` from cache; only a leader
        set's continuations count (a follower measures the arm in force, not the contest)."""
        if not continuation or group not in self.scores or prompt_tokens <= 0:
            return
        self.scores[group].add(cached_tokens, prompt_tokens, self._decay)
        cfg = self.config
        ready = all(x.observations >= cfg.min_observations for x in self.scores.values())
        other = 1 - self.current
        lead = self.scores[ARMS[other]].share - self.scores[ARMS[self.current]].share
        if ready and lead >= cfg.margin:
            self.streak += 1
            if self.streak >= cfg.patience:
                self.current, self.streak = other, 0
                self.switches += 1
        else:
            self.streak = 0

    def standings(self) -> dict[str, float]:
        """Each leader set's decayed cached share (for metrics and the bench)."""
        return {name: score.share for name, score in self.scores.items()}


__all__ = ["ARMS", "Group", "HoldDuel", "HoldDuelConfig"]
