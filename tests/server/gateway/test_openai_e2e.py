"""The issue's done-when list, through the official openai SDK against a real stack."""

from __future__ import annotations

import re
import secrets

import httpx
import openai
import pytest

from tests.server.gateway.stack import MODEL, Stack

pytestmark = pytest.mark.slow


def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=stack.gateway.base_url + "/v1", max_retries=0, timeout=120)


def system_prompt(nonce: str) -> str:
    # ~100 tokens, so it fills several 16-token blocks; the nonce keeps tests' caches apart.
    return (f"[{nonce}] You are a meticulous geography tutor. Answer in one short sentence, name the city "
            "explicitly, never apologise, never add follow-up questions, and keep a friendly, precise tone. "
            "Capitals are cities; countries are not. Prefer the commonly used English name of every place.")


def metric(stack: Stack, name: str, *, scrape: str | None = None, **labels: str) -> float:
    """Sum of the samples of `name` matching `labels`, from `scrape` (one /metrics body, so
    several figures read from it are one snapshot) or from a new scrape."""
    text = scrape if scrape is not None else httpx.get(stack.gateway.base_url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def tenant_key(stack: Stack) -> tuple[str, str]:
    slug = "t-" + secrets.token_hex(4)
    return slug, stack.add_tenant(slug)


def test_chat_non_streaming_answers_paris(stack: Stack, tenant_key) -> None:
    _, key = tenant_key
    reply = client(stack, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_streaming_delivers_the_same_answer(stack: Stack, tenant_key) -> None:
    _, key = tenant_key
    stream = client(stack, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert "Paris" in text
    assert len(finishes) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_text_completion_and_stop_string(stack: Stack, tenant_key) -> None:
    _, key = tenant_key
    api = client(stack, key)
    full = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    assert full.choices[0].text
    cut = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[","])
    assert "," not in cut.choices[0].text
    assert full.choices[0].text.startswith(cut.choices[0].text)
    assert cut.choices[0].finish_reason == "stop"


def test_streamed_text_finish_and_usage_match_the_json_answer(stack: Stack, tenant_key) -> None:
    # The SSE path renders one frame per token from prebuilt bytes and skips the stop
    # matcher when there are no stop strings; what the client assembles must be exactly
    # the JSON answer, with and without a stop string, for chat and text completions.
    _, key = tenant_key
    api = client(stack, key)
    usage = {"include_usage": True}
    for stop in (None, [","]):
        whole = api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=stop)
        chunks = list(api.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                             stop=stop, stream=True, stream_options=usage))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            [whole.choices[0].finish_reason]
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    messages = [{"role": "user", "content": "Name three primary colours."}]
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                              stream=True, stream_options=usage))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_models_lists_the_tenants_pool_model(stack: Stack, tenant_key) -> None:
    _, key = tenant_key
    assert [m.id for m in client(stack, key).models.list()] == [MODEL]


def test_shared_system_prompt_is_reused_and_shows_in_metrics(stack: Stack, tenant_key) -> None:
    slug, key = tenant_key
    api = client(stack, key)
    system = system_prompt(secrets.token_hex(4))
    first = api.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Capital of Italy?"}])
    second = api.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Capital of Spain?"}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 4 * 16
    assert metric(stack, "kvgate_kv_blocks_reused_total", tenant=slug, pool="reference") >= 4
    assert metric(stack, "kvgate_requests_total", tenant=slug, pool="reference", status="ok") == 2


def test_salted_tenants_never_share_blocks(stack: Stack) -> None:
    system = system_prompt(secrets.token_hex(4))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Capital of Peru?"}]
    a = client(stack, stack.add_tenant("a-" + secrets.token_hex(3), isolation="salted"))
    b = client(stack, stack.add_tenant("b-" + secrets.token_hex(3), isolation="salted"))
    assert a.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).usage.prompt_tokens_details.cached_tokens == 0
    assert b.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).usage.prompt_tokens_details.cached_tokens == 0
    again = a.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_shared_isolation_tenants_do_share_prefixes(stack: Stack) -> None:
    system = system_prompt(secrets.token_hex(4))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Capital of Chile?"}]
    a = client(stack, stack.add_tenant("sa-" + secrets.token_hex(3), isolation="shared"))
    b = client(stack, stack.add_tenant("sb-" + secrets.token_hex(3), isolation="shared"))
    a.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert b.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).usage.prompt_tokens_details.cached_tokens > 0


def test_wrong_key_is_401(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(stack, "kvg_abcdefgh_" + "x" * 43).models.list()
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"


def test_suspended_tenant_is_403_and_resumes(stack: Stack, tenant_key) -> None:
    slug, key = tenant_key
    admin = httpx.Client(base_url=stack.gateway.base_url + "/admin/v1",
                         headers={"Authorization": f"Bearer {stack.admin_token}"})
    assert admin.post(f"/tenants/{slug}/suspend").status_code == 200
    with pytest.raises(openai.PermissionDeniedError) as info:
        client(stack, key).models.list()
    assert info.value.body["code"] == "tenant_suspended"
    assert admin.post(f"/tenants/{slug}/resume").status_code == 200
    assert client(stack, key).models.list().data


def test_revoked_key_is_401(stack: Stack, tenant_key) -> None:
    slug, key = tenant_key
    api = client(stack, key)
    assert api.models.list().data
    admin = httpx.Client(base_url=stack.gateway.base_url + "/admin/v1",
                         headers={"Authorization": f"Bearer {stack.admin_token}"})
    listed = admin.get(f"/tenants/{slug}/keys").json()["items"]
    assert admin.post(f"/tenants/{slug}/keys/{listed[0]['id']}/revoke").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        api.models.list()


def test_requests_per_minute_exceeded_is_429_with_retry_after(stack: Stack) -> None:
    key = stack.add_tenant("rpm-" + secrets.token_hex(3), rpm_limit=2)
    api = client(stack, key)
    for _ in range(2):
        api.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        api.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert info.value.body["param"] == "requests_per_minute"


def test_prompt_over_limit_is_400_naming_the_limit(stack: Stack) -> None:
    key = stack.add_tenant("big-" + secrets.token_hex(3), max_prompt_tokens=20)
    with pytest.raises(openai.BadRequestError) as info:
        client(stack, key).completions.create(model=MODEL, prompt="word " * 100, max_tokens=1)
    assert "max_prompt_tokens" in info.value.body["message"]
    assert "20" in info.value.body["message"]


def test_a_prompt_over_the_models_input_limit_is_context_length_exceeded(stack: Stack, tenant_key) -> None:
    """The engine refuses it (the gateway knows the model's limit from that refusal alone); OpenAI's
    code, naming the prompt's field."""
    _, key = tenant_key
    long = "word " * 3000
    for path, body, field in (("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
                              ("/v1/completions", {"prompt": long}, "prompt")):
        response = httpx.post(stack.gateway.base_url + path, json={"model": MODEL, "max_tokens": 1, **body},
                              headers={"Authorization": f"Bearer {key}"}, timeout=120)
        error = response.json()["error"]
        assert response.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", field)
        assert "this model accepts at most" in error["message"], error


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"model": MODEL, "messages": []}, "invalid_request"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "invalid_request"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, "invalid_request"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "bogus": 1}, "unsupported_parameter"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, "model_not_found"),
    ],
)
def test_bad_requests_get_openai_errors(stack: Stack, tenant_key, body, code) -> None:
    _, key = tenant_key
    response = httpx.post(stack.gateway.base_url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"})
    assert 400 <= response.status_code < 500
    assert response.json()["error"]["code"] == code


def test_invalid_json_is_400(stack: Stack, tenant_key) -> None:
    _, key = tenant_key
    response = httpx.post(stack.gateway.base_url + "/v1/chat/completions", content=b"{\"model\": \xff",
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_key_last_used_is_written_off_the_request_path(stack: Stack) -> None:
    import time

    from sqlalchemy import select

    from tenants.models import ApiKey, Tenant

    slug = "lu-" + secrets.token_hex(3)
    api = client(stack, stack.add_tenant(slug))
    api.models.list()
    deadline = time.monotonic() + 10
    while True:
        with stack.session_factory() as session:
            used = session.scalars(select(ApiKey.last_used_at).join(Tenant).where(Tenant.slug == slug)).one()
        if used is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert used is not None


GENERATED_ID = re.compile(r"req_[0-9a-f]{24}")
HELLO = [{"role": "user", "content": "Say hello."}]


def test_every_answer_carries_an_x_request_id(stack: Stack, tenant_key) -> None:
    _, key = tenant_key
    api = client(stack, key)
    raw = api.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
    sent = raw.headers["x-request-id"]
    assert GENERATED_ID.fullmatch(sent), sent
    assert raw.parse()._request_id == sent  # what the SDK reads from the header
    again = api.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
    assert GENERATED_ID.fullmatch(again.headers["x-request-id"]) and again.headers["x-request-id"] != sent
    streamed = api.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO, max_tokens=2, stream=True)
    assert GENERATED_ID.fullmatch(streamed.headers["x-request-id"])  # on the SSE response too
    assert list(streamed.parse())
    text = api.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert GENERATED_ID.fullmatch(text.headers["x-request-id"])
    assert GENERATED_ID.fullmatch(api.models.with_raw_response.list().headers["x-request-id"])
    # errors too, their body unchanged: the SDK reads the id from the header of a 404
    with pytest.raises(openai.NotFoundError) as info:
        api.chat.completions.create(model="nope", messages=HELLO, max_tokens=1)
    assert GENERATED_ID.fullmatch(info.value.request_id or ""), info.value.response.headers
    assert info.value.response.json() == {"error": info.value.body} and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        api.responses.retrieve("resp_" + secrets.token_hex(12))
    assert GENERATED_ID.fullmatch(info.value.request_id or "")
    with pytest.raises(openai.AuthenticationError) as info:
        client(stack, "kvg_abcdefgh_" + "x" * 43).models.list()
    assert GENERATED_ID.fullmatch(info.value.request_id or "")
    for method, path in (("POST", "/v1/nope"), ("GET", "/v1/chat/completions")):  # the app's 404 / 405
        response = httpx.request(method, stack.gateway.base_url + path, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code in (404, 405) and GENERATED_ID.fullmatch(response.headers["x-request-id"])
    assert "x-request-id" not in httpx.get(stack.gateway.base_url + "/healthz").headers  # the serving API's only


def test_the_request_id_is_the_servers_and_a_valid_client_id_travels_beside_it(stack: Stack, tenant_key) -> None:
    _, key = tenant_key
    api = client(stack, key)
    for mine in ("trace-7.b:c_d", "x" * 128):
        raw = api.chat.completions.with_raw_response.create(
            model=MODEL, messages=HELLO, max_tokens=1, extra_headers={"x-client-request-id": mine, "x-request-id": mine})
        assert raw.headers["x-client-request-id"] == mine  # echoed beside the server's own id
        assert GENERATED_ID.fullmatch(raw.headers["x-request-id"]) and raw.parse()._request_id == raw.headers["x-request-id"]
    with pytest.raises(openai.NotFoundError) as info:  # an error too
        api.chat.completions.create(model="nope", messages=HELLO, max_tokens=1, extra_headers={"x-client-request-id": "e-1"})
    assert info.value.response.headers["x-client-request-id"] == "e-1" and GENERATED_ID.fullmatch(info.value.request_id)
    for bad in ("has space", "x" * 129, "x" * 200, "a/b", "<b>", ""):
        response = httpx.post(stack.gateway.base_url + "/v1/chat/completions", timeout=120,
                              json={"model": MODEL, "messages": HELLO, "max_tokens": 1},
                              headers={"Authorization": f"Bearer {key}", "x-client-request-id": bad})
        assert response.status_code == 200 and GENERATED_ID.fullmatch(response.headers["x-request-id"]), bad
        assert "x-client-request-id" not in response.headers, bad  # never echoed unvalidated
