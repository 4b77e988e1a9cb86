"""How the chaos run measures a lowered concurrency limit (``bench/reliability/chaos.py``).

The product's promise (``server/gateway/fresh_admission.py``): every admission decided more
than one auth TTL after a limit change uses the new limit; requests admitted before run to
their end (never preempted). At the engines a call's arrival is not its admission (a loaded
gateway can take seconds from the one to the other), so counting every call in flight at
arrivals after the bound also counts calls admitted under the old limit. Hence two views:
the engines' (calls in flight at arrivals, from the proxies' records, also once every call
that reached the engines before the bound has ended) and Redis' (the tenant's leases, which
every gateway's admission decides on, sampled when a lease granted after the bound appears).
"""

from __future__ import annotations

import math
import threading
import time


def max_at_arrivals(calls: list, *, after: float) -> int:
    """The most calls of one tenant in flight at the engines at the arrival of any call that
    arrived after ``after`` (the call itself included). What the lowered limit governs: a
    gateway that applies it admits a request only while fewer than the limit are running;
    requests admitted under the old limit are not preempted and may still be running."""
    worst = 0
    for call in calls:
        if call.arrived <= after:
            continue
        running = sum(1 for c in calls
                      if c.arrived <= call.arrived and (c.ended is None or c.ended > call.arrived))
        worst = max(worst, running)
    return worst


def max_after_drained(calls: list, *, bound: float) -> int:
    """:func:`max_at_arrivals` from the moment every call that reached the engine by ``bound``
    has ended (a call never ended: nothing after it counts)."""
    drained = max([bound] + [c.ended if c.ended is not None else math.inf for c in calls if c.arrived <= bound])
    return max_at_arrivals(calls, after=drained)


def breakdown(calls: list, *, changed: float, bound_s: float) -> dict:
    """At the arrival (after the bound) where most calls ran: when, relative to the change, it
    was, and the running calls by arrival: before the change, within the bound, after it."""
    after = changed + bound_s
    worst, at = 0, None
    for call in calls:
        if call.arrived <= after:
            continue
        running = [c for c in calls if c.arrived <= call.arrived and (c.ended is None or c.ended > call.arrived)]
        if len(running) > worst:
            worst, at = len(running), (call.arrived, running)
    if at is None:
        return {}
    instant, running = at
    return {"instant_s_after_change": round(instant - changed, 2),
            "arrived_before_change": sum(1 for c in running if c.arrived <= changed),
            "arrived_within_bound": sum(1 for c in running if changed < c.arrived <= after),
            "arrived_after_bound": sum(1 for c in running if c.arrived > after),
            "never_ended": sum(1 for c in running if c.ended is None),
            "oldest_age_s": round(instant - min(c.arrived for c in running), 2)}


class LeaseSampler:
    """Samples one tenant's admission leases in Redis (the sorted set the gateways share)
    every 20 ms on a thread of its own, from the limit change on."""

    def __init__(self, slug: str, changed: float, namespace: str = "kvgate") -> None:
        self._key = f"{namespace}:adm:{{{slug}}}:leases"
        self._changed = changed
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.samples: list[tuple[float, frozenset]] = []

    def start(self) -> LeaseSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        import redis

        client = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=2)
        while not self._halt.is_set():
            try:
                members = frozenset(client.zrangebyscore(self._key, time.time(), "+inf"))
            except redis.RedisError:
                members = None
            if members is not None:
                self.samples.append((time.monotonic() - self._changed, members))
            self._halt.wait(0.02)

    def stop(self, *, bound_s: float) -> dict:
        self._halt.set()
        self._thread.join(5)
        seen: set = set()
        most_after, most_at_new, new_after = 0, 0, 0
        previous = -math.inf
        for t, members in self.samples:
            new = members - seen
            seen |= members
            if t > bound_s:
                most_after = max(most_after, len(members))
            if previous > bound_s:  # a lease first seen now was granted after the previous sample
                if new:
                    new_after += len(new)
                    most_at_new = max(most_at_new, len(members))
            previous = t
        return {"samples": len(self.samples), "max_held_after_bound": most_after,
                "max_held_when_granted_after_bound": most_at_new, "granted_after_bound": new_after}


