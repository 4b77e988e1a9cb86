"""The usage report bills prompt caching as the answers report it: the live stack (gateway over
HTTP, its usage journal, the reference engine, a SQLite registry) and the admin API's
``GET /tenants/{slug}/usage``, for a Messages client's ``cache_control`` and a repeated chat
completion."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest

from tenants import retention_classes
from tests.server.gateway.stack import ACTOR, MODEL, Stack
from tests.server.gateway.test_messages_e2e import GREEDY
from tests.server.gateway.test_messages_e2e import client as messages_client
from tests.server.gateway.test_openai_e2e import client as openai_client
from tests.server.gateway.test_openai_e2e import system_prompt

pytestmark = pytest.mark.slow

CACHE = ("cache_read_tokens", "cache_write_5m_tokens", "cache_write_1h_tokens")


def usage_after(stack: Stack, slug: str, requests: int) -> dict:
    """The tenant's usage report once ``requests`` answered requests are in the registry (the
    stack flushes every 0.5 s): its totals, and its per-minute rows summed, which must agree."""
    admin = httpx.Client(base_url=stack.gateway.base_url + "/admin/v1",
                         headers={"Authorization": f"Bearer {stack.admin_token}"})
    deadline = time.monotonic() + 15
    while True:
        body = admin.get(f"/tenants/{slug}/usage").json()
        if body["total"]["requests"] >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    total = body["total"]
    assert total["requests"] == requests, body
    assert {k: sum(i[k] for i in body["items"]) for k in total} == total
    assert sum(total[k] for k in CACHE) <= total["prompt_tokens"]
    return total


def hinted_tenant(stack: Stack) -> tuple[str, str]:
    """(slug, key) of a tenant on the shared pool whose class honours hints up to 1 h at priority 35
    (as test_messages_e2e.hinted_key: its hints lengthen durations only)."""
    name = "uc-" + secrets.token_hex(4)
    with stack.session_factory() as session:
        retention_classes.create_class(session, actor=ACTOR, now=stack.now(), name=name, system_priority=35,
                                       context_priority=35, turn_priority=35, decode_priority=35,
                                       hints_enabled=True, hint_max_ttl_ms=3_600_000, hint_max_priority=35,
                                       hint_quota_fraction=1.0)
    return name, stack.add_tenant(name, retention_class=name, kv_quota_fraction=1.0)


def test_messages_cache_control_is_billed_as_written_then_read(stack: Stack) -> None:
    slug, key = hinted_tenant(stack)
    api = messages_client(stack, key)
    system = [{"type": "text", "text": system_prompt(secrets.token_hex(4)) * 2, "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": "Capital of Italy?"}]
    first = api.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, system=system, messages=ask).usage
    billed = usage_after(stack, slug, 1)
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 100
    assert billed["prompt_tokens"] == first.input_tokens + first.cache_creation_input_tokens
    assert (billed["cache_read_tokens"], billed["cache_write_5m_tokens"], billed["cache_write_1h_tokens"]) == \
        (0, first.cache_creation.ephemeral_5m_input_tokens, 0)

    second = api.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, system=system, messages=ask).usage
    after = usage_after(stack, slug, 2)
    assert second.cache_read_input_tokens > 0  # the blocks the first call left
    assert after["cache_read_tokens"] - billed["cache_read_tokens"] == second.cache_read_input_tokens
    assert after["cache_write_5m_tokens"] - billed["cache_write_5m_tokens"] == \
        second.cache_creation.ephemeral_5m_input_tokens < first.cache_creation_input_tokens

    # kept for an hour, streamed: the 1 h column, the split of the stream's final usage
    hour = [{**system[0], "text": system_prompt(secrets.token_hex(4)) * 2, "cache_control": {"type": "ephemeral",
                                                                                              "ttl": "1h"}}]
    with api.messages.stream(model=MODEL, max_tokens=4, extra_body=GREEDY, system=hour, messages=ask) as stream:
        streamed = stream.get_final_message().usage
    last = usage_after(stack, slug, 3)
    assert streamed.cache_creation.ephemeral_1h_input_tokens > 100
    assert last["cache_write_1h_tokens"] == streamed.cache_creation.ephemeral_1h_input_tokens
    assert last["cache_write_5m_tokens"] == after["cache_write_5m_tokens"]
    assert last["cache_read_tokens"] - after["cache_read_tokens"] == streamed.cache_read_input_tokens


def test_a_repeated_chat_completion_is_billed_as_read_from_cache(stack: Stack) -> None:
    slug = "ucc-" + secrets.token_hex(4)
    api = openai_client(stack, stack.add_tenant(slug))
    messages = [{"role": "system", "content": system_prompt(secrets.token_hex(4))},
                {"role": "user", "content": "Capital of Peru?"}]
    usages = [api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).usage
              for _ in range(2)]
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)  # streamed: the usage chunk, last
    total = usage_after(stack, slug, 3)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0
    assert total["prompt_tokens"] == sum(u.prompt_tokens for u in usages)
    assert total["cache_read_tokens"] == sum(cached)
    assert total["cache_write_5m_tokens"] == total["cache_write_1h_tokens"] == 0  # no hint: nothing kept under one
