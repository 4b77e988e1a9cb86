"""Tokenized prompt prefixes (system prompt, tool definitions) kept per tenant.

An agent or a RAG chat resends the same long system segment every turn; tokenizing it is
most of the gateway's per-request CPU for long prompts (~3 ms for 2,000 tokens of
SmolLM2's BPE here). :func:`server.gateway.api.prompting.prepare_chat` tokenizes each
segment's text on its own, so a segment's token ids are a function of its text alone and
can be reused verbatim: a hit returns exactly what ``encode(text)`` would. The prompter's
``encode`` is :meth:`engines.tokenizer.ChatTokenizer.encode_prompt`, and a segment's text is its
shielded rendering (a special token's text a client wrote is a placeholder, fixed per
tokenizer): the text still names its ids alone, and a text without a placeholder tokenizes as
the tokenizer's own ``encode``.

Invariants:

* content-invalidated: the key is the segment's full text, so a changed system prompt (or
  tool list) is a miss, never a stale hit;
* per tenant: the key also holds the tenant's scope, so no tenant's latency can reveal
  whether another tenant sent the same text (a shared cache would be a timing side
  channel);
* bounded: at most ``max_entries`` entries and ``max_chars`` characters of keys in all,
  least recently used first out; texts shorter than ``min_chars`` are not kept (their
  tokenization costs about what the lookup does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class PrefixTokens:
    """An LRU of ``(scope, text) -> token ids`` in front of one tokenizer's ``encode``."""

    __slots__ = ("_encode", "_entries", "_chars", "max_entries", "max_chars", "min_chars", "hits", "misses")

    def __init__(self, encode: Callable[[str], list[int]], *, max_entries: int = 1024,
                 max_chars: int = 16_000_000, min_chars: int = 64) -> None:
        self._encode = encode
        self._entries: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.min_chars = min_chars
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, scope: str, text: str) -> tuple[int, ...] | list[int]:
        """``encode(text)``, from the cache when ``scope`` tokenized the same text before."""
        if len(text) < self.min_chars or len(text) > self.max_chars:
            return self._encode(text)
        key = (scope, text)
        ids = self._entries.get(key)
        if ids is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return ids
        self.misses += 1
        ids = tuple(self._encode(text))
        self._entries[key] = ids
        self._chars += len(text)
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            (_, old), _ = self._entries.popitem(last=False)
            self._chars -= len(old)
        return ids
