"""GPU pools' tokenizers from a checkpoint directory, built here with `tokenizers` (no network)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engines.hf_tokenizer import load_hf_tokenizer, load_spec_tokenizer
from engines.tokenizer import TokenizerLoadError
from server.gateway.api.prompting import ChatPrompter

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def checkpoint(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["You are a helpful assistant.", "What is the capital of France?", "Paris is."] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}))
    return tmp_path


def test_loads_template_eos_and_specials(checkpoint) -> None:
    tok = load_hf_tokenizer(checkpoint)
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.token_to_id("<|endoftext|>") in tok.stop_token_ids
    text = tok.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_start|>")  # specials in text are parsed as specials
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_gateway_segments_work_on_an_hf_tokenizer(checkpoint) -> None:
    prompt = ChatPrompter(load_hf_tokenizer(checkpoint)).chat([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Paris is."},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "What is the capital of France?"},
    ])
    assert 0 < prompt.system_end < prompt.context_end < prompt.total


def test_missing_files_are_clear_errors(tmp_path, checkpoint) -> None:
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        load_hf_tokenizer(tmp_path / "nowhere")
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(TokenizerLoadError, match="chat template"):
        load_hf_tokenizer(checkpoint)


def test_spec_tokenizer_is_found_under_the_tokenizer_root(checkpoint, tmp_path, monkeypatch) -> None:
    spec = "llama-3.1-8b-instruct-fp8kv"
    with pytest.raises(TokenizerLoadError, match=spec):
        load_spec_tokenizer(spec)
    root = tmp_path / "root"
    (root / spec).mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / spec / name).write_bytes((checkpoint / name).read_bytes())
    monkeypatch.setenv("KVGATE_TOKENIZER_ROOT", str(root))
    assert load_spec_tokenizer(spec).eos_token == "<|im_end|>"
