"""The circuit breaker of one replica: a pure state machine (the caller passes ``now``).

Two ways a replica fails, two ways back::

                 unreachable (dispatch or stats poll fails)
    closed ───────────────────────────────────────────────▶ open ──┐ stats probe answers
      ▲  ▲                                                          │ (after retry_at)
      │  └──────────────────────────────────────────────────────────┘ → closed
      │
      │          timeout (accepted a request, sent no first token)
      └──────── closed ─────────────────────────────────────▶ open, suspect
       served                                                  │ retry_at passed:
       (first token)                                           ▼ one request admitted
                             half_open (trial in flight) ◀─────┘  (start_trial)
                               ├─ first token → closed
                               ├─ timeout / unreachable → open, wait doubled (capped)
                               └─ ended without a verdict (client gone, refused) → open,
                                  trial available again at once

Invariants:

* A *suspect* breaker (a timeout since the last served request) is never closed by a stats
  probe: a hung replica's stats keep answering, so only a request that receives its first
  token proves it serves again (``served``). Suspicion ends only there.
* At most one trial request is in flight (``half_open``); others avoid the replica.
* The open period is ``min(max_open_s, open_s * 2 ** (failures - 1))``: it doubles per
  consecutive failure and resets when the replica serves. A timeout of an attempt that was
  dispatched before the breaker last opened is the same incident, not a new failure.
* A breaker that only saw connection failures behaves as before: the first successful
  stats probe after ``retry_at`` closes it.
* A timeout of an attempt dispatched *before* the replica last served a first token is
  overload, not a hang: the replica made progress while the attempt waited in its queue, so
  the breaker of a closed replica stays closed (the attempt itself is still cancelled and
  retried elsewhere or answered 504). Without this, one slow first token on a loaded pool's
  last replica refused every request of the pool for the open period.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(slots=True)
class Breaker:
    state: str = CLOSED
    failures: int = 0  # consecutive failures since the replica last served (or a probe closed it)
    retry_at: float = 0.0  # open: when a probe (or, suspect, a trial) may go
    suspect: bool = False  # a timeout since the replica last served
    opened_at: float = float("-inf")  # when the breaker last (re)opened
    served_at: float = float("-inf")  # when a request last received its first token here

    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    def _open(self, now: float, open_s: float, max_open_s: float) -> bool:
        opened = self.state == CLOSED
        self.failures += 1
        self.state = OPEN
        self.opened_at = now
        self.retry_at = now + min(max_open_s, open_s * 2 ** (self.failures - 1))
        return opened

    def fail(self, now: float, open_s: float, max_open_s: float) -> bool:
        """A connection failure (dispatch or stats poll); True when this opened a closed breaker."""
        return self._open(now, open_s, max_open_s)

    def time_out(self, now: float, dispatched_at: float, open_s: float, max_open_s: float) -> bool:
        """An attempt dispatched at ``dispatched_at`` got no first token in time.

        Marks the breaker suspect. Returns True when this opened a closed breaker. An attempt
        dispatched before the breaker last opened adds nothing (that incident is counted); one
        dispatched before a closed replica last served is overload and changes nothing."""
        if self.state == CLOSED and dispatched_at < self.served_at:
            return False
        self.suspect = True
        if self.state != CLOSED and dispatched_at < self.opened_at:
            return False
        return self._open(now, open_s, max_open_s)

    def probe_ok(self) -> bool:
        """The stats probe answered: closes an open breaker unless it is suspect.
        True when this closed it."""
        if self.state != OPEN or self.suspect:
            return False
        self.state, self.failures, self.retry_at = CLOSED, 0, 0.0
        return True

    def served(self, now: float = float("-inf")) -> bool:
        """A request received its first token from the replica at ``now``: it serves. True when
        this closed an open or half-open breaker."""
        reopened = self.state != CLOSED
        self.served_at = max(self.served_at, now)
        self.state, self.failures, self.retry_at, self.suspect = CLOSED, 0, 0.0, False
        return reopened

    def probe_due(self, now: float) -> bool:
        """Whether the poll loop should call the replica's stats now."""
        return self.state == CLOSED or now >= self.retry_at

    def trial_due(self, now: float) -> bool:
        """A suspect breaker whose open period is over and that has no trial in flight."""
        return self.state == OPEN and self.suspect and now >= self.retry_at

    def start_trial(self, now: float) -> bool:
        """Admit one request as the trial (``half_open``); False when no trial is due."""
        if not self.trial_due(now):
            return False
        self.state = HALF_OPEN
        return True

    def end_trial(self) -> None:
        """The trial ended without a verdict (no first token, no timeout, no connection
        failure): back to open with the trial available again at once."""
        if self.state == HALF_OPEN:
            self.state = OPEN

    def avoid(self, now: float) -> bool:
        """Whether requests must not go there even when no replica is closed: it timed out
        and its trial is not due yet or already running (sending one would wait the deadline)."""
        return self.suspect and self.state != CLOSED and not self.trial_due(now)
