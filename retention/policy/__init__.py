"""Retention policy: what priority and duration each block of a request gets, and for whom.

    hints.py       dialect-neutral cache hints a client sends (breakpoints, TTLs, cache keys)
    planner.py     a tenant's retention class + the request's segments -> RetentionPlan
    adaptive.py    priority bands from measured reuse statistics
    protect.py     the protect candidate: a live subset of conversations held at high priority
    selection.py   choosing among candidates (static, bands, protect) by a shadow duel
    quota.py       per-tenant shares of the GPU tier

Policies only produce plans; the pool (``retention.pool``) applies them.
"""
