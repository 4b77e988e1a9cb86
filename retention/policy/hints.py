"""What a client says it will send again: cache hints, as the gateway's dialects parse them.

A hint is *intent*, never authority. The dialects (OpenAI chat/completions, Anthropic
Messages, OpenAI Responses) turn their own fields into one :class:`CacheHints`; the
planner then maps it onto TensorRT-LLM's per-range retention, bounded by the tenant's
retention class (whether hints are honoured at all, the longest TTL, the highest
priority, the share of the tenant's KV quota hinted blocks may hold).

    Anthropic  cache_control {"type": "ephemeral", "ttl": "5m" | "1h"} on a block
               → Breakpoint(token_end = first token after that block, ttl_ms)
    OpenAI     prompt_cache_retention "in_memory" | "24h"  → CacheHints.retention
               prompt_cache_key                            → CacheHints.cache_key

    tokens   0 ───── bp[0].token_end ───── bp[1].token_end ───── total
             |  kept for bp[0].ttl  |  kept for bp[1].ttl   | (no hint)

A breakpoint marks the *prefix* ``[0, token_end)``: the tokens before an earlier
breakpoint are covered by that breakpoint too (a later, longer TTL extends them).

Invariant: a constructed :class:`CacheHints` is valid (at most four breakpoints, sorted
by strictly increasing ``token_end > 0``, each TTL > 0); ``__post_init__`` refuses
anything else with a :class:`~retention.types.RetentionPlanError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from retention.types import RetentionPlanError

MAX_BREAKPOINTS = 4  # Anthropic's limit per request ("up to 4 cache breakpoints")
TTL_5M_MS = 5 * 60 * 1000
TTL_1H_MS = 60 * 60 * 1000
TTL_24H_MS = 24 * TTL_1H_MS

PromptCacheRetention = Literal["in_memory", "24h"]


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """Keep the prompt prefix ``[0, token_end)`` for ``ttl_ms`` after its last use."""

    token_end: int
    ttl_ms: int

    def __post_init__(self) -> None:
        for name in ("token_end", "ttl_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise RetentionPlanError(f"breakpoint {name} must be an integer > 0, got {value!r}", field=name)


@dataclass(frozen=True, slots=True)
class CacheHints:
    """One request's cache intent, dialect-neutral. Empty hints change nothing."""

    breakpoints: tuple[Breakpoint, ...] = ()
    cache_key: str | None = None
    retention: PromptCacheRetention | None = None

    def __post_init__(self) -> None:
        if len(self.breakpoints) > MAX_BREAKPOINTS:
            raise RetentionPlanError(
                f"at most {MAX_BREAKPOINTS} cache breakpoints per request, got {len(self.breakpoints)}",
                field="breakpoints")
        ends = [b.token_end for b in self.breakpoints]
        if any(b <= a for a, b in zip(ends, ends[1:])):
            raise RetentionPlanError(f"breakpoints must have strictly increasing token_end, got {ends}",
                                     field="breakpoints")
        if self.retention not in (None, "in_memory", "24h"):
            raise RetentionPlanError(f"retention must be 'in_memory' or '24h', got {self.retention!r}",
                                     field="retention")
        if self.cache_key is not None and not isinstance(self.cache_key, str):
            raise RetentionPlanError("cache_key must be a string", field="cache_key")

    @property
    def empty(self) -> bool:
        return not self.breakpoints and self.cache_key is None and self.retention is None

    @property
    def hinted_tokens(self) -> int:
        """How many leading prompt tokens some breakpoint covers (0 without breakpoints)."""
        return self.breakpoints[-1].token_end if self.breakpoints else 0
