"""Guided decoding for the reference engine with xgrammar (the library TensorRT-LLM's
``GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR`` uses), over the model's own tokenizer.

One :class:`GrammarCompiler` per engine holds the tokenizer info (the GGUF's byte-level
BPE vocabulary, ``VocabType.BYTE_LEVEL``) and caches compiled grammars by their source,
so a JSON schema is compiled once however many requests send it. Each guided sequence
owns a ``GrammarMatcher`` that the engine advances with every accepted token; the
sampler asks it for the next-token bitmask and applies it to the logits row.

Guide types map like TensorRT-LLM's xgrammar backend (``tensorrt_llm/_torch/pyexecutor/
grammar_matcher.py``): ``json`` -> the builtin JSON grammar (or a schema when text is
given), ``json_schema`` -> ``compile_json_schema``, ``regex`` -> ``compile_regex``,
``ebnf_grammar`` -> ``compile_grammar``.

Invariant: :meth:`GrammarCache.compile` either returns a compiled grammar or raises
``ContractError`` naming ``guided_decoding_guide``; a bad guide never reaches the step loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from engines.contract import GUIDE, ContractError, Guide
from engines.refusals import guide_does_not_compile
from engines.tokenizer import ChatTokenizer


def _xgrammar():
    # Imported on first use: xgrammar imports transformers (~3 s), which an engine that never
    # sees a guide should not pay at start-up.
    import xgrammar

    return xgrammar


class GrammarCache:
    """Compiles guides for one tokenizer; thread-safe (compiles run off the event loop)."""

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int, *, max_entries: int = 256,
                 cache_limit_bytes: int = 64 << 20) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache_limit_bytes = cache_limit_bytes
        self._compiler: Any = None
        self._lock = threading.Lock()
        # Compiled grammars by guide, least recently used first (xgrammar's own cache also
        # keys by source, but returns a new wrapper per call and needs the compile call).
        self._compiled: OrderedDict[Guide, Any] = OrderedDict()
        self._max_entries = max_entries
        self.compiles = 0  # cache misses

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                vocab = self._tokenizer.tokenizer.get_vocab(with_added_tokens=True)
                encoded = [""] * self._vocab_size
                for token, index in vocab.items():
                    if index < self._vocab_size:
                        encoded[index] = token
                info = xgr.TokenizerInfo(
                    encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=self._vocab_size,
                    stop_token_ids=sorted(self._tokenizer.stop_token_ids), add_prefix_space=False,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                     cache_limit_bytes=self._cache_limit_bytes)
            return self._compiler

    def compile(self, guide: Guide) -> Any:
        with self._lock:
            hit = self._compiled.get(guide)
            if hit is not None:
                self._compiled.move_to_end(guide)
                return hit
        compiled = self._compile(guide)
        with self._lock:
            self.compiles += 1
            self._compiled[guide] = compiled
            while len(self._compiled) > self._max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, guide: Guide) -> Any:
        compiler = self._get_compiler()
        try:
            if guide.kind == "json" and not guide.text:
                return compiler.compile_builtin_json_grammar()
            if guide.kind in ("json", "json_schema"):
                return compiler.compile_json_schema(guide.text, any_whitespace=False, strict_mode=True)
            if guide.kind == "regex":
                return compiler.compile_regex(guide.text)
            if guide.kind == "ebnf_grammar":
                return compiler.compile_grammar(guide.text)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the parser's message
            raise ContractError(guide_does_not_compile(guide.kind, exc), tensor=GUIDE.name) from exc
        raise ContractError(f"unknown guide type {guide.kind!r}", tensor=GUIDE.name)

    def matcher(self, compiled: Any, end_id: int | None) -> Any:
        """A fresh matcher; it accepts ``end_id`` (or the tokenizer's stop tokens) once the guide is complete."""
        xgr = _xgrammar()
        stops = [end_id] if end_id is not None else None
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stops)


def token_bitmask(rows: int, vocab_size: int) -> Any:
    return _xgrammar().allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: Any, bitmask: Any, indices: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf in the rows ``indices`` (in place)."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=indices)
