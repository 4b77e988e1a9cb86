"""Rolling the host tier out and back: the SLO guard and the pilot split (pure, pass ``now``).

* :mod:`retention.rollout.guard` — per-pool state machine: a sliding window of request
  latencies, *trips* when the p99 budget is broken for a whole window, *restores* after a
  cool-down with hysteresis (or by an admin action).
* :mod:`retention.rollout.pilot` — which tenants of a pool get the host tier in pilot mode
  (a stable hash split) and both arms' latency and hit quality side by side.

The plan transformation that rolls the tier back is ``retention.policy.planner.roll_back_host_tier``.
"""

from retention.rollout.guard import GuardError, GuardState, GuardTransition, Observation, SloBudget, SloGuard
from retention.rollout.pilot import ARMS, PilotReport, pilot_arm

__all__ = ["ARMS", "GuardError", "GuardState", "GuardTransition", "Observation", "PilotReport", "SloBudget",
           "SloGuard", "pilot_arm"]
