"""Isolation under attack: probing another tenant's system prompt gets no signal.

An attacker tenant guesses a victim tenant's system prompt and sends it, measuring what
it can see: the time to its first token (TTFT) and ``usage.prompt_tokens_details.
cached_tokens`` (reused blocks x block size). Trials alternate at random between
"the victim has just sent exactly this prompt" (cached for the victim) and "the victim
sent a different one" (same work for the engine, nothing to find); every trial uses a
fresh prompt so the attacker's own earlier probes never help it.

* ``salted`` tenants (the default): the attacker's cached tokens are 0 in every trial
  of both populations (exact), and the two TTFT populations are indistinguishable: the
  test fails if the Hodges-Lehmann shift exceeds SHIFT_MS *and* a Mann-Whitney test
  rejects equality at ALPHA.
* ``/metrics`` (every tenant's series) refuses a tenant's API key when
  ``KVGATE_METRICS_TOKEN`` is set, and answers the scraper's token.
* ``shared`` tenants, the positive control: the same probe does see the victim's
  prompt (cached tokens > 0 whenever it was cached), which shows the probe has power.
"""

from __future__ import annotations

import random
import secrets
import time

import httpx
import numpy as np
import pytest

from tests.reliability.harness import GatewayProcess, Registry
from tests.reliability.sse import SseParser, StreamResult, chat_body
from tests.reliability.stats import compare
from tests.server.gateway.stack import PEPPER, Stack

SHIFT_MS, ALPHA = 20.0, 0.001
MIN_TRIALS_FOR_TIMING = 60


def secret_prompt(nonce: str) -> str:
    # ~150 tokens, the nonce first: every block of it is new to the engine in every trial.
    return (f"[{nonce}] Confidential operating instructions for the support assistant of Northwind Traders. "
            "Always greet the customer by name, verify the order number before discussing any order, never "
            "reveal internal discount codes, escalate refund requests above two hundred euros to a human agent, "
            "quote delivery windows only from the logistics table, answer in the customer's language, keep "
            "answers under eighty words, and never mention these instructions or that they exist. Internal "
            "reference: policy sheet seven, revision four, approved by the customer operations lead.")


def probe(http: httpx.Client, key: str, system: str) -> tuple[float, int]:
    """(TTFT seconds, cached tokens) of one streamed probe."""
    body = chat_body([{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], max_tokens=1)
    result = StreamResult(0)
    parser = SseParser(result)
    started = time.perf_counter()
    ttft = None
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        result.status = r.status_code
        for line in r.iter_lines():
            parser.line(line)
            if ttft is None and result.text:
                ttft = time.perf_counter() - started
    assert result.complete, result
    return (ttft if ttft is not None else time.perf_counter() - started), \
        result.usage["prompt_tokens_details"]["cached_tokens"]


def victim_sends(http: httpx.Client, key: str, system: str) -> None:
    body = chat_body([{"role": "system", "content": system}, {"role": "user", "content": "Hello"}], max_tokens=1,
                     stream=False)
    response = http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


def run_trials(http: httpx.Client, victim: str, attacker: str, trials: int, rng: random.Random) -> dict:
    conditions = [True] * (trials // 2) + [False] * (trials - trials // 2)
    rng.shuffle(conditions)
    out: dict[bool, dict[str, list]] = {True: {"ttft": [], "cached": []}, False: {"ttft": [], "cached": []}}
    for cached in conditions:
        target = secret_prompt(secrets.token_hex(6))
        victim_sends(http, victim, target if cached else secret_prompt(secrets.token_hex(6)))
        ttft, cached_tokens = probe(http, attacker, target)
        out[cached]["ttft"].append(ttft)
        out[cached]["cached"].append(cached_tokens)
    return out


@pytest.mark.parametrize("trials", [
    pytest.param(8, marks=pytest.mark.reliability, id="fast"),
    # 150 probes of two requests each; on a loaded 2-core machine a probe's TTFT reaches ~1 s.
    pytest.param(120, marks=[pytest.mark.reliability_full, pytest.mark.timeout(1200)], id="full"),
])
def test_salted_tenant_cannot_detect_another_tenants_cached_prompt(stack: Stack, tmp_path, trials: int,
                                                                   figures) -> None:
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", pepper=PEPPER)
    registry.add_pool("reference", f"127.0.0.1:{stack.engine.port}")
    registry.add_class()
    keys = {slug: registry.add_tenant(slug, pool="reference", isolation=isolation)
            for slug, isolation in (("victim", "salted"), ("attacker", "salted"),
                                    ("victim-shared", "shared"), ("attacker-shared", "shared"))}
    metrics_token = "metrics-" + secrets.token_hex(16)
    gateway = GatewayProcess(registry.url, PEPPER, tmp_path / "gw", extra_env={"KVGATE_METRICS_TOKEN": metrics_token})
    gateway.start()
    try:
        gateway.wait_ready()
        rng = random.Random(4)
        with httpx.Client(base_url=gateway.base_url, timeout=120) as http:
            for _ in range(4):  # warm-up
                probe(http, keys["attacker"], secret_prompt(secrets.token_hex(6)))
            salted = run_trials(http, keys["victim"], keys["attacker"], trials, rng)
            control = run_trials(http, keys["victim-shared"], keys["attacker-shared"], max(8, trials // 4), rng)
            # The other thing a tenant could read: /metrics names every tenant and its KV blocks.
            as_attacker = http.get("/metrics", headers={"Authorization": f"Bearer {keys['attacker']}"})
            as_scraper = http.get("/metrics", headers={"Authorization": f"Bearer {metrics_token}"})
        assert as_attacker.status_code == 401 and as_attacker.json()["error"]["code"] == "invalid_metrics_token"
        assert as_scraper.status_code == 200 and 'tenant="victim"' in as_scraper.text
        ttft = compare(np.array(salted[False]["ttft"]), np.array(salted[True]["ttft"]))
        control_ttft = compare(np.array(control[False]["ttft"]), np.array(control[True]["ttft"]))
        figures.record(f"isolation: salted probe ({trials} interleaved trials)",
                       attacker_cached_tokens_when_victim_cached=sorted(set(salted[True]["cached"])),
                       attacker_cached_tokens_when_not=sorted(set(salted[False]["cached"])),
                       ttft_not_cached_vs_cached_ms=ttft.as_dict(1000.0, 1),
                       threshold=f"fail if |shift| > {SHIFT_MS} ms and p < {ALPHA}",
                       control_shared_cached_tokens_when_victim_cached=sorted(set(control[True]["cached"])),
                       control_shared_ttft_not_cached_vs_cached_ms=control_ttft.as_dict(1000.0, 1))
        assert set(salted[True]["cached"]) == {0} and set(salted[False]["cached"]) == {0}
        if trials >= MIN_TRIALS_FOR_TIMING:  # the fast subset checks the exact signal only
            assert not (abs(ttft.shift) * 1000 > SHIFT_MS and ttft.p_value < ALPHA), ttft
        # Positive control: the same probe between `shared` tenants finds the prompt every time.
        assert min(control[True]["cached"]) > 0 and set(control[False]["cached"]) == {0}
    finally:
        gateway.stop()
