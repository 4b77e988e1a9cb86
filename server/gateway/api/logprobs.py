"""Engine log probabilities → OpenAI's two ``logprobs`` shapes.

Chat (``choices[].logprobs``)::

    {"content": [{"token": "Hello", "logprob": -0.1, "bytes": [72, ...],
                  "top_logprobs": [{"token": ..., "logprob": ..., "bytes": [...]}, ...]}, ...]}

Completions (``choices[].logprobs``)::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...] | null,
     "text_offset": [...]}

A token's ``bytes`` are its exact bytes (a byte-level BPE token may hold part of a UTF-8
character, so its ``token`` text can contain U+FFFD while ``bytes`` stays exact). The
values are the engine's: ``log_softmax`` of the raw logits (engines/contract.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.contract import TokenLogProbs
from engines.tokenizer import ChatTokenizer


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


class TokenTexts:
    """Token id → (text, bytes), cached per tokenizer (one instance per prompter)."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = _byte_decoder()
        self._specials = set(tokenizer.special_tokens.values())
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self._tokenizer.tokenizer.id_to_token(int(token_id)) or ""
            if token_id in self._specials or any(ch not in self._decoder for ch in piece):
                raw = piece.encode("utf-8")
            else:
                raw = bytes(self._decoder[ch] for ch in piece)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return hit


def chat_entries(texts: TokenTexts, ids: Sequence[int], probs: Sequence[TokenLogProbs]) -> list[dict]:
    out = []
    for token, lp in zip(ids, probs):
        text, raw = texts.get(token)
        top = []
        for alt, value in lp.top:
            alt_text, alt_raw = texts.get(alt)
            top.append({"token": alt_text, "logprob": value, "bytes": list(alt_raw)})
        out.append({"token": text, "logprob": lp.logprob, "bytes": list(raw), "top_logprobs": top})
    return out


def completion_block(texts: TokenTexts, ids: Sequence[int], probs: Sequence[TokenLogProbs], *, offset: int,
                     with_top: bool) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for token, lp in zip(ids, probs):
        text, _ = texts.get(token)
        tokens.append(text)
        values.append(lp.logprob)
        offsets.append(offset)
        offset += len(text)
        if with_top:
            tops.append({texts.get(alt)[0]: value for alt, value in lp.top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if with_top else None,
            "text_offset": offsets}


def merge_completion_blocks(blocks: Sequence[dict]) -> dict:
    merged: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": None, "text_offset": []}
    for block in blocks:
        merged["tokens"] += block["tokens"]
        merged["token_logprobs"] += block["token_logprobs"]
        merged["text_offset"] += block["text_offset"]
        if block["top_logprobs"] is not None:
            merged["top_logprobs"] = (merged["top_logprobs"] or []) + block["top_logprobs"]
    return merged
