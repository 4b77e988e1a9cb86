"""The gateway's routing settings (``routing.py`` reads them; ``server/settings.py`` fills them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.contract import EngineRequest
from retention.routing import CostModel


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Gateway routing settings.

    ``router``: ``kv-aware`` (default) | ``round-robin`` | ``session`` | ``random``.
    ``cost``: weights of the kv-aware cost (``retention/routing/cost.py``). ``retries``:
    extra attempts on another replica for a request that failed before its first token.
    ``breaker_open_s`` / ``breaker_max_open_s``: a failed replica is probed again after
    ``open_s``, doubling per failed probe up to the maximum; a replica that timed out is not
    closed by its probe but gets one trial request per open period (``breaker.py``). ``stats_timeout_s``: a replica
    whose stats call takes longer has stopped answering. ``poll_wait_s``: how long one round of
    the poll loop waits for its replicas' stats before summing what has landed; each replica's
    poll runs on its own and a later answer is applied when it lands (so a replica that never
    answers delays only itself, never the others' events, probes or pools).

    ``first_token_timeout_s`` (0 = none): how long one attempt may wait for its first token
    before it is cancelled, counted as the replica's failure and retried elsewhere (a replica
    that accepts requests but never answers, whose stats may still answer). When the engine
    does not stream (a non-streamed answer without stop strings comes in one message at the
    end) the first token cannot be seen, so that attempt's deadline is the whole answer's:
    ``first_token_timeout_s + max_new_tokens * answer_timeout_per_token_s``.

    ``inter_token_timeout_s`` (None = the first-token deadline, 0 = none): how long a streaming
    attempt may wait for its next engine message once it has had its first. On expiry the call
    is cancelled, the replica's breaker counts a timeout, and the attempt fails with
    :class:`EngineStalled`. Why the first-token deadline by default: a request the engine
    pauses mid-answer (preempted when its KV blocks run short) waits to be scheduled again as
    a new request waits for its first token, and recomputes its prefill when it is; a healthy
    gap between tokens is milliseconds, so the same bound only ends streams that stopped.
    """

    router: str = "kv-aware"
    cost: CostModel = field(default_factory=CostModel)
    retries: int = 1
    breaker_open_s: float = 0.5
    breaker_max_open_s: float = 10.0
    stats_timeout_s: float = 5.0
    poll_wait_s: float = 0.25
    first_token_timeout_s: float = 30.0
    answer_timeout_per_token_s: float = 0.5
    inter_token_timeout_s: float | None = None

    def first_response_wait(self, request: EngineRequest) -> float | None:
        """Seconds an attempt of ``request`` may wait for its first engine message (None: forever)."""
        if self.first_token_timeout_s <= 0:
            return None
        if request.streaming:
            return self.first_token_timeout_s
        return self.first_token_timeout_s + request.max_new_tokens * self.answer_timeout_per_token_s

    def stall_wait(self) -> float | None:
        """Seconds a streaming attempt may wait for its next engine message after its first (None: forever)."""
        limit = self.first_token_timeout_s if self.inter_token_timeout_s is None else self.inter_token_timeout_s
        return limit if limit > 0 else None
