"""Tokenizers for GPU pools: a Hugging Face checkpoint directory's ``tokenizer.json`` +
``tokenizer_config.json`` (chat template, BOS/EOS), read offline with ``tokenizers``.

The gateway resolves a pool's tokenizer from its engine spec (``engines/specs/*.yaml``):
``model.tokenizer`` or ``model.checkpoint_path`` if it is a directory, else
``$KVGATE_TOKENIZER_ROOT/<spec name>/`` (where the engine builder leaves the
checkpoint's tokenizer files, see ``build/engine_builder.sh``). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer

from engines.tokenizer import ChatTokenizer, TokenizerLoadError

_STOP_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "</s>")


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return str(value.get("content", ""))
    return str(value or "")


def load_hf_tokenizer(directory: str | Path) -> ChatTokenizer:
    """Build a :class:`ChatTokenizer` from a checkpoint directory (no network)."""
    root = Path(directory)
    tokenizer_file, config_file = root / "tokenizer.json", root / "tokenizer_config.json"
    if not tokenizer_file.is_file():
        raise TokenizerLoadError(f"{tokenizer_file} not found")
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    template_file = root / "chat_template.jinja"
    if not template and template_file.is_file():
        template = template_file.read_text()
    if not template:
        raise TokenizerLoadError(f"{root} has no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    eos = _token_text(config.get("eos_token"))
    eos_id = tokenizer.token_to_id(eos) if eos else None
    if eos_id is None:
        raise TokenizerLoadError(f"{root}: eos_token {eos!r} is not in the vocabulary")
    stops = {eos_id} | {specials[name] for name in _STOP_NAMES if name in specials}
    return ChatTokenizer(
        tokenizer=tokenizer, chat_template=str(template), eos_token_id=eos_id, stop_token_ids=frozenset(stops),
        special_tokens=specials, bos_token=_token_text(config.get("bos_token")), eos_token=eos,
    )


def spec_tokenizer_dirs(spec_name: str) -> list[Path]:
    """Where a spec's tokenizer may live, in the order tried."""
    from engines.spec import load_bundled_spec

    spec = load_bundled_spec(spec_name)
    candidates = [spec.model.tokenizer, spec.model.checkpoint_path]
    dirs = [Path(c) for c in candidates if c and Path(c).is_dir()]
    root = os.environ.get("KVGATE_TOKENIZER_ROOT")
    if root:
        dirs.append(Path(root) / spec_name)
    return dirs


def load_spec_tokenizer(spec_name: str) -> ChatTokenizer:
    tried = spec_tokenizer_dirs(spec_name)
    for directory in tried:
        if (directory / "tokenizer.json").is_file():
            return load_hf_tokenizer(directory)
    where = ", ".join(str(d) for d in tried) or "no candidate directory (set KVGATE_TOKENIZER_ROOT)"
    raise TokenizerLoadError(f"no tokenizer.json for engine spec {spec_name!r}; looked in: {where}")
