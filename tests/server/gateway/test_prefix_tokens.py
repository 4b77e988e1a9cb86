"""The per-tenant cache of tokenized system segments (server/gateway/api/prefix_cache.py):
a prompt's token ids are identical with and without it, with SmolLM2's real tokenizer and
chat template; hits are per tenant, content-invalidated and bounded."""

from __future__ import annotations

import pytest

from engines.tokenizer import load_gguf_tokenizer
from server.gateway.api.prefix_cache import PrefixTokens
from server.gateway.api.prompting import ChatPrompter, prepare_chat
from server.gateway.api.tools import render_messages

SYSTEM = " ".join(f"Rule {i}: answer about harbour {i * 7 % 31} in one sentence, never in lists." for i in range(60))
TOOLS = [{"name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer()


def conversations() -> list[list[dict]]:
    return [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which ships dock at pier 4?"}],
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And at pier 5?"},
         {"role": "assistant", "content": "The ferries."}, {"role": "user", "content": "Thanks, and pier 6?"}],
        [{"role": "system", "content": SYSTEM + " Also: be terse."}, {"role": "user", "content": "Pier 7?"}],
        render_messages([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Porto?"}],
                        TOOLS),
        [{"role": "user", "content": "No system prompt at all."}],
    ]


@pytest.mark.parametrize("marks", [(), (1,), (1, 2)])
def test_input_ids_are_identical_with_and_without_the_cache(tokenizer, marks):
    prompter = ChatPrompter(tokenizer)
    for messages in conversations():
        if marks and max(marks) > len(messages):
            continue
        plain = prepare_chat(tokenizer, messages, marks=marks)
        for _ in range(2):  # a miss, then a hit
            cached = prompter.chat(messages, marks, scope="t1")
            assert cached == plain
    assert prompter.prefixes.hits > 0


def test_a_repeated_system_prompt_is_tokenized_once_per_tenant(tokenizer):
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return tokenizer.encode(text)

    prompter = ChatPrompter(tokenizer)
    prompter.prefixes = PrefixTokens(encode)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Pier 1?"}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Pier 2?"}]
    a = prompter.chat(first, scope="t1")
    b = prompter.chat(second, scope="t1")
    assert len(calls) == 1 and prompter.prefixes.hits == 1
    assert a.input_ids[:a.system_end] == b.input_ids[:b.system_end]
    prompter.chat(second, scope="t2")  # another tenant: its own entry, never the first tenant's
    assert len(calls) == 2 and prompter.prefixes.hits == 1
    changed = [{"role": "system", "content": SYSTEM + " New rule."}, {"role": "user", "content": "Pier 2?"}]
    c = prompter.chat(changed, scope="t1")  # content changed: a miss, and the new text's tokens
    assert len(calls) == 3
    assert c == prepare_chat(tokenizer, changed)
    prompter.chat(second)  # no scope: no cache
    assert len(calls) == 3 and prompter.prefixes.hits == 1


def test_the_cache_is_bounded_least_recently_used_first(tokenizer):
    texts = [f"{i} " + "x" * 600 for i in range(4)]
    cache = PrefixTokens(tokenizer.encode, max_entries=2, min_chars=512)
    for text in texts[:2]:
        cache.encode("t", text)
    cache.encode("t", texts[0])  # texts[1] is now the least recently used
    cache.encode("t", texts[2])
    assert len(cache) == 2 and cache.hits == 1
    cache.encode("t", texts[0])
    assert cache.hits == 2
    cache.encode("t", texts[1])  # evicted: a miss
    assert cache.hits == 2 and cache.misses == 4
    by_chars = PrefixTokens(tokenizer.encode, max_chars=1300, min_chars=512)
    for text in texts:
        assert list(by_chars.encode("t", text)) == tokenizer.encode(text)
    assert len(by_chars) == 2
    short = PrefixTokens(tokenizer.encode, min_chars=512)
    short.encode("t", "too short to keep")
    assert len(short) == 0
