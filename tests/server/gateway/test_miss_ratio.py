"""Online miss-ratio curves on a live gateway (the stack samples every block: rate 1.0).

With every block kept, a shadow at the pool's own size is the pool's cache model, so the
figures can be checked by hand: a fresh salted tenant sends the same prompt twice; its
first request hits nothing, its second hits every full block of the prompt, so its
estimated prompt-token hit rate is ``full_blocks × tokens_per_block / (2 × prompt_tokens)``
at every capacity that holds the prompt.
"""

from __future__ import annotations

import secrets
import time

import httpx

from tests.server.gateway.stack import Stack
from tests.server.gateway.test_openai_e2e import client, metric, system_prompt


def test_curves_estimate_a_repeated_prompt_exactly(stack: Stack) -> None:
    slug = "mrc-" + secrets.token_hex(3)
    key = stack.add_tenant(slug, kv_quota_fraction=1.0)
    messages = [{"role": "system", "content": system_prompt(slug)}, {"role": "user", "content": "Capital of Peru?"}]
    usages = []
    for _ in range(2):
        done = client(stack, key).chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                                          max_tokens=2, temperature=0)
        usages.append(done.usage.prompt_tokens)
    assert usages[0] == usages[1]
    prompt = usages[0]
    full = prompt // stack.tokens_per_block
    expected = full * stack.tokens_per_block / (2 * prompt)

    deadline = time.monotonic() + 15  # the tenant's slug appears with the next registry poll
    while metric(stack, "kvgate_tenant_mrc_hit_rate", tenant=slug, gpu="1x", host="1x") == 0.0:
        assert time.monotonic() < deadline, "no per-tenant miss-ratio series"
        time.sleep(0.3)
    for gpu in ("0.5x", "1x", "2x", "4x"):
        assert abs(metric(stack, "kvgate_tenant_mrc_hit_rate", tenant=slug, gpu=gpu, host="1x") - expected) < 1e-9
    # GPU alone holds the prompt, so the host tier adds nothing for this tenant.
    assert abs(metric(stack, "kvgate_tenant_mrc_hit_rate", tenant=slug, gpu="1x", host="0x") - expected) < 1e-9
    # Pool-wide points exist for every capacity, with their sizes.
    assert metric(stack, "kvgate_mrc_blocks", pool="reference", gpu="2x", host="1x", tier="primary") == 512
    assert metric(stack, "kvgate_mrc_blocks", pool="reference", gpu="1x", host="0x", tier="secondary") == 0
    assert 0.0 < metric(stack, "kvgate_mrc_hit_rate", pool="reference", gpu="4x", host="1x") <= 1.0
    # Each estimate carries its jackknife standard error (the prompt's blocks span several groups).
    text = httpx.get(stack.gateway.base_url + "/metrics").text
    errors = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kvgate_mrc_hit_rate_stderr{") and 'pool="reference"' in line]
    assert len(errors) == 6 and all(0.0 <= e < 0.5 for e in errors), errors
