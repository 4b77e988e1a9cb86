"""Hostile input: never a 5xx, always the documented error shape, no auth oracle.

* hand-picked bad inputs on the serving API and the admin API;
* schemathesis against the serving API's OpenAPI document (FastAPI's own, with a valid
  key) and against the admin API's, over real HTTP;
* refused credentials (unknown key, a real key's prefix with a wrong secret, revoked
  keys, a tenant key on the admin API, an admin token on the serving API) are all 401,
  and the three key kinds take the same time (interleaved samples, rank test).
"""

from __future__ import annotations

import json
import random
import secrets
import string
import time

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis.errors import Unsatisfiable
from hypothesis import settings as hypothesis_settings
from schemathesis.generation import GenerationMode

from tests.reliability.harness import GatewayProcess, Registry
from tests.reliability.stats import compare
from tests.server.gateway.stack import MODEL, PEPPER, Stack

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}
ADMIN_ERROR_KEYS = {"code", "message", "field"}
MESSAGES = [{"role": "user", "content": "x"}]


def assert_openai_error(response) -> dict:  # httpx or schemathesis response
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR_KEYS, body
    assert isinstance(body["error"]["code"], str) and body["error"]["message"]
    return body["error"]


ANTHROPIC_ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                         "request_too_large", "rate_limit_error", "api_error", "overloaded_error", "timeout_error"}


def assert_serving_error(response) -> dict:
    """A serving error in its dialect's shape: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if "/v1/messages" not in str(response.request.url):
        return assert_openai_error(response)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    body = response.json()
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error", body
    header = response.headers["request-id"]  # a list in schemathesis' responses, a string in httpx's
    assert body["request_id"] == (header[0] if isinstance(header, list) else header), body  # as Anthropic's body
    assert body["error"]["type"] in ANTHROPIC_ERROR_TYPES and body["error"]["message"], body
    return body["error"]


def assert_admin_error(response) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ADMIN_ERROR_KEYS, body
    return body["error"]


@pytest.fixture(scope="module")
def tenant_key(stack: Stack) -> str:
    return stack.add_tenant("hostile-" + secrets.token_hex(3), max_output_tokens=4, max_prompt_tokens=96)


def _deep(depth: int) -> bytes:
    return b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"x"}],"response_format":' \
        + b"[" * depth + b"]" * depth + b"}"


# name, raw body (bytes) or JSON (dict), content type; expected status (None: any 4xx)
SERVING_CASES: list[tuple[str, object, str, int | None]] = [
    ("oversized body (5 MiB)", b"{" + b" " * (5 * 1024 * 1024) + b"}", "application/json", 413),
    ("invalid UTF-8 in a string", b'{"model": "\xff\xfe", "messages": []}', "application/json", 400),
    ("invalid UTF-8, whole body", b"\xff\xfe\xfd", "application/json", 400),
    ("lone surrogate escape", b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}', "application/json", 400),
    ("NUL in content (valid: answered)", {"model": MODEL, "messages": [{"role": "user", "content": "a\x00b"}], "max_tokens": 1}, "application/json", 200),
    ("huge max_tokens", {"model": MODEL, "messages": MESSAGES, "max_tokens": 10**30}, "application/json", 400),
    ("max_tokens over the tenant cap", {"model": MODEL, "messages": MESSAGES, "max_tokens": 5000}, "application/json", 400),
    ("negative max_tokens", {"model": MODEL, "messages": MESSAGES, "max_tokens": -1}, "application/json", 400),
    ("zero max_tokens", {"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "application/json", 400),
    ("negative temperature", {"model": MODEL, "messages": MESSAGES, "temperature": -0.5}, "application/json", 400),
    ("NaN temperature", b'{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":NaN}', "application/json", 400),
    ("Infinity top_p", b'{"model":"m","messages":[{"role":"user","content":"x"}],"top_p":1e999}', "application/json", 400),
    ("negative seed", {"model": MODEL, "messages": MESSAGES, "seed": -1}, "application/json", 400),
    ("seed over uint64", {"model": MODEL, "messages": MESSAGES, "seed": 2**70}, "application/json", 400),
    ("unknown field", {"model": MODEL, "messages": MESSAGES, "bogus": 1}, "application/json", 400),
    ("unknown field in a message", {"model": MODEL, "messages": [{"role": "user", "content": "x", "x": 1}]}, "application/json", 400),
    ("unknown role", {"model": MODEL, "messages": [{"role": "root", "content": "x"}]}, "application/json", 400),
    ("string instead of list", {"model": MODEL, "messages": "hello"}, "application/json", 400),
    ("bool as max_tokens", {"model": MODEL, "messages": MESSAGES, "max_tokens": True}, "application/json", 400),
    ("string as stream flag", {"model": MODEL, "messages": MESSAGES, "stream": "yes"}, "application/json", 400),
    ("numeric string temperature", {"model": MODEL, "messages": MESSAGES, "temperature": "0.5"}, "application/json", 400),
    ("float max_tokens 2.0", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2.0}, "application/json", 400),
    ("float max_tokens", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1.5}, "application/json", 400),
    ("n = 2", {"model": MODEL, "messages": MESSAGES, "n": 2}, "application/json", 400),
    ("too many stop strings", {"model": MODEL, "messages": MESSAGES, "stop": ["a"] * 50}, "application/json", 400),
    ("too many messages", {"model": MODEL, "messages": MESSAGES * 5000}, "application/json", 400),
    ("deeply nested JSON (100k)", _deep(100_000), "application/json", 400),
    ("deeply nested JSON (1k)", _deep(1_000), "application/json", 400),
    ("unclosed nesting", b"[" * 200_000, "application/json", 400),
    ("JSON array body", b"[]", "application/json", 400),
    ("JSON string body", b'"hello"', "application/json", 400),
    ("empty body", b"", "application/json", 400),
    ("text/plain body", {"model": MODEL, "messages": MESSAGES}, "text/plain", 400),
    ("form body", b"model=x&messages=y", "application/x-www-form-urlencoded", 400),
    ("duplicate keys", b'{"model":"m","model":"n","messages":[]}', "application/json", 400),
    ("unknown model", {"model": "gpt-4", "messages": MESSAGES}, "application/json", 404),
    ("prompt over the tenant cap", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]}, "application/json", 400),
]


@pytest.mark.reliability
def test_bad_inputs_to_the_serving_api_get_clear_4xx(stack: Stack, tenant_key: str, figures) -> None:
    http = httpx.Client(base_url=stack.gateway.base_url, timeout=60)
    seen: dict[str, str] = {}
    for name, body, ctype, expected in SERVING_CASES:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        for path in ("/v1/chat/completions", "/v1/completions"):
            response = http.post(path, content=content,
                                 headers={"Authorization": f"Bearer {tenant_key}", "Content-Type": ctype})
            if expected == 200:
                if path == "/v1/chat/completions":
                    assert response.status_code == 200, (name, response.text)
                    seen[f"{name} {path}"] = "200"
                    continue
            error = assert_openai_error(response)
            if path == "/v1/chat/completions" and expected is not None:
                assert response.status_code == expected, (name, response.status_code, error)
            seen[f"{name} {path}"] = f"{response.status_code} {error['code']}"
    figures.record("hostile input: hand-picked serving cases",
                   cases=len(SERVING_CASES), requests=len(seen), responses_5xx=0,
                   codes=sorted({v for v in seen.values()}))


ADMIN_CASES: list[tuple[str, str, str, object]] = [
    ("POST", "/tenants", "deeply nested JSON", _deep(100_000)),
    ("POST", "/tenants", "invalid UTF-8", b'{"slug": "\xff"}'),
    ("POST", "/tenants", "oversized body", b"{" + b" " * (5 * 1024 * 1024) + b"}"),
    ("POST", "/tenants", "unknown field", {"slug": "a", "display_name": "A", "pool": "reference",
                                           "retention_class": "standard", "bogus": 1}),
    ("POST", "/tenants", "negative limit", {"slug": "neg", "display_name": "A", "pool": "reference",
                                            "retention_class": "standard", "rpm_limit": -5}),
    ("POST", "/tenants", "huge limit", {"slug": "huge", "display_name": "A", "pool": "reference",
                                        "retention_class": "standard", "rpm_limit": 10**30}),
    ("POST", "/tenants", "NUL in slug", {"slug": "a\x00b", "display_name": "A", "pool": "reference",
                                         "retention_class": "standard"}),
    ("POST", "/pools", "NaN priority", b'{"name":"p","model_name":"m","triton_url":"x:1","secondary_offload_min_priority":NaN}'),
    ("PATCH", "/tenants/nope", "missing tenant", {"version": 1, "rpm_limit": 5}),
    ("GET", "/tenants?limit=-1", "negative limit param", None),
    ("GET", "/tenants?limit=99999999999999999999", "huge limit param", None),
    ("GET", "/tenants/%00", "NUL in path", None),
    ("GET", "/audit?since=not-a-date", "bad date", None),
]


@pytest.mark.reliability
def test_bad_inputs_to_the_admin_api_get_the_error_shape(stack: Stack, figures) -> None:
    http = httpx.Client(base_url=stack.gateway.base_url + "/admin/v1", timeout=60,
                        headers={"Authorization": f"Bearer {stack.admin_token}"})
    codes = set()
    for method, path, name, body in ADMIN_CASES:
        content = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        response = http.request(method, path, content=content, headers={"Content-Type": "application/json"})
        codes.add(f"{response.status_code} {assert_admin_error(response)['code']}")
    figures.record("hostile input: hand-picked admin cases", cases=len(ADMIN_CASES), responses_5xx=0,
                   codes=sorted(codes))


# Schemathesis -----------------------------------------------------------------------------------
def _fuzz(schema, base_url: str, headers: dict[str, str], examples: int, check_body, prepare=None) -> dict:
    counts = {"operations": 0, "requests": 0, "4xx": 0, "2xx": 0}
    for result in schema.get_all_operations():
        operation = result.ok()
        counts["operations"] += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @hypothesis_settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                                 derandomize=True, database=None)
            def check(case) -> None:  # type: ignore[no-untyped-def]
                if prepare is not None:
                    prepare(case, mode)
                response = case.call(base_url=base_url, headers=headers, timeout=120)
                counts["requests"] += 1
                assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
                if response.status_code >= 400:
                    counts["4xx"] += 1
                    try:
                        check_body(response)
                    except AssertionError as exc:
                        raise AssertionError(f"{case.method} {response.request.url} {case.body!r}: {exc}") from None
                else:
                    counts["2xx"] += 1

            try:
                check()
            except Unsatisfiable:  # e.g. GET /v1/models has no input that can be made invalid
                counts["unsatisfiable"] = counts.get("unsatisfiable", 0) + 1
    return counts


@pytest.mark.parametrize("examples", [
    pytest.param(6, marks=pytest.mark.reliability, id="fast"),
    pytest.param(60, marks=pytest.mark.reliability_full, id="full"),
])
def test_schemathesis_serving_api_never_5xx(stack: Stack, tenant_key: str, examples: int, figures) -> None:
    raw = stack.gateway.app.openapi()
    for item in raw["paths"].values():  # we send a valid key on every call; do not let it be fuzzed away
        for operation in item.values():
            operation["parameters"] = [p for p in operation.get("parameters", []) if p["name"] != "authorization"]
    schema = schemathesis.openapi.from_dict(raw)

    def prepare(case, mode) -> None:  # type: ignore[no-untyped-def]
        # Valid bodies name the real model and stay within the tenant's output cap, so they
        # get past routing and admission into the hot path (engine, SSE) instead of a 404.
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = MODEL
            for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if isinstance(case.body.get(name), int):
                    case.body[name] = min(case.body[name], 4)

    counts = _fuzz(schema, stack.gateway.base_url, {"Authorization": f"Bearer {tenant_key}"}, examples,
                   assert_serving_error, prepare)
    figures.record(f"hostile input: schemathesis serving API ({examples} examples/op/mode)", **counts,
                   responses_5xx=0)


@pytest.mark.reliability_full
def test_schemathesis_admin_api_over_http_never_5xx(stack: Stack, figures) -> None:
    # tests/server/admin/test_admin_fuzz.py runs 3 examples per operation in-process on every
    # `make test`; this is the long run, over real HTTP, against the live registry.
    stack.add_tenant("fuzzed-" + secrets.token_hex(3))
    schema = schemathesis.openapi.from_dict(stack.gateway.app.state.admin_app.openapi())
    counts = _fuzz(schema, stack.gateway.base_url + "/admin/v1",
                   {"Authorization": f"Bearer {stack.admin_token}"}, 25, assert_admin_error)
    figures.record("hostile input: schemathesis admin API over HTTP (25 examples/op/mode)", **counts,
                   responses_5xx=0)


# Credentials ------------------------------------------------------------------------------------
@pytest.mark.reliability
def test_credentials_of_the_wrong_kind_are_401(stack: Stack) -> None:
    key = stack.add_tenant("cred-" + secrets.token_hex(3))
    other = stack.add_tenant("cred-" + secrets.token_hex(3))
    base = stack.gateway.base_url
    assert httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    cases = [
        (base + "/admin/v1/tenants", key, assert_admin_error),  # a tenant key is not an admin token
        (base + "/v1/models", stack.admin_token, assert_openai_error),  # an admin token is not an API key
        (base + "/v1/models", key[:-1] + ("a" if key[-1] != "a" else "b"), assert_openai_error),  # one char off
        (base + "/v1/models", key.upper(), assert_openai_error),
        (base + "/v1/models", key + " " + other, assert_openai_error),
        (base + "/v1/models", "kvg_", assert_openai_error),
    ]
    for url, credential, check in cases:
        response = httpx.get(url, headers={"Authorization": f"Bearer {credential}"})
        assert response.status_code == 401, (url, response.text)
        check(response)


def _random_key(prefix: str | None = None) -> str:
    alphabet = string.ascii_lowercase + string.digits
    prefix = prefix or "".join(secrets.choice(alphabet) for _ in range(8))
    return f"kvg_{prefix}_{secrets.token_urlsafe(32)}"


@pytest.mark.parametrize("samples", [
    pytest.param(80, marks=pytest.mark.reliability, id="fast"),
    pytest.param(400, marks=pytest.mark.reliability_full, id="full"),
])
def test_refused_keys_take_the_same_time(stack: Stack, tmp_path, samples: int, figures) -> None:
    """Unknown key vs a real key's prefix with a wrong secret: no timing oracle.

    Every sample is a key the gateway has not seen (so each one costs a registry lookup,
    never a cache hit). The kinds are sent in one shuffled order; the test fails if
    "real prefix, wrong secret" is slower or faster than "unknown prefix" by more than
    SHIFT_MS (Hodges-Lehmann estimate) *and* the difference is significant (Mann-Whitney
    p < ALPHA). Revoked keys (with their real secret) are measured and reported too: they
    are 401 like the others, but load the tenant before refusing, so they are slower;
    only someone holding the real secret can observe that, and it tells them nothing
    they do not know (docs/reliability.md).
    """
    SHIFT_MS, ALPHA = 0.25, 0.001
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}", pepper=PEPPER)
    registry.add_pool("reference", f"127.0.0.1:{stack.engine.port}")
    registry.add_class()
    victim_key = registry.add_tenant("victim", pool="reference")
    registry.add_tenant("revoked", pool="reference")
    revoked = [registry.add_key("revoked") for _ in range(samples)]
    registry.revoke_all_keys("revoked")
    real_prefix = victim_key.split("_")[1]
    gateway = GatewayProcess(registry.url, PEPPER, tmp_path / "gw")
    gateway.start()
    try:
        trials = [("unknown", _random_key()) for _ in range(samples)]
        trials += [("wrong_secret", _random_key(real_prefix)) for _ in range(samples)]
        trials += [("revoked", k) for k in revoked]
        random.Random(8).shuffle(trials)
        times: dict[str, list[float]] = {"unknown": [], "wrong_secret": [], "revoked": []}
        with httpx.Client(base_url=gateway.base_url, timeout=30) as http:
            for _ in range(40):  # warm-up: connection, code paths, SQLite page cache
                http.get("/v1/models", headers={"Authorization": f"Bearer {_random_key()}"})
            for kind, key in trials:
                started = time.perf_counter()
                response = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                elapsed = time.perf_counter() - started
                assert response.status_code == 401, response.text
                assert response.json()["error"]["code"] == "invalid_api_key"
                times[kind].append(elapsed)
        results = {}
        for kind in ("wrong_secret", "revoked"):
            cmp = compare(np.array(times["unknown"]), np.array(times[kind]))
            results[kind] = cmp
            figures.record(f"hostile input: 401 timing ({samples} samples per kind)",
                           **{f"unknown_vs_{kind}_ms": cmp.as_dict(1000.0)})
        figures.record(f"hostile input: 401 timing ({samples} samples per kind)",
                       threshold=f"fail if |shift| > {SHIFT_MS} ms and p < {ALPHA}")
        oracle = results["wrong_secret"]
        assert not (abs(oracle.shift) * 1000 > SHIFT_MS and oracle.p_value < ALPHA), oracle
    finally:
        gateway.stop()
