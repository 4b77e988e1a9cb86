"""Stored responses over HTTP, against the live stack: what a continuation of a response that
cannot be found answers, the byte cap's pre-check of the whole row, what the cap counts, the
store's TTL as the conversation hold's bound, and ``input_items``' ``before`` / ``include``."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest
from sqlalchemy import select, update

from retention.policy.conversation import ConversationRequest
from retention.policy.hint_quota import MIN_GAP_SAMPLES, HintLedger
from retention.types import DEFAULT_PLAN
from tenants import responses as stored
from tenants.models import StoredResponse, Tenant
from tests.server.gateway.stack import MODEL, Stack
from tests.server.gateway.test_conversation_hold import job
from tests.server.gateway.test_responses_e2e import second_gateway

pytestmark = pytest.mark.slow

ASK = {"model": MODEL, "input": "What is the capital of France?", "temperature": 0, "max_output_tokens": 4}


def _tenant(stack: Stack) -> tuple[str, str]:
    slug = "rs-" + secrets.token_hex(4)
    return slug, stack.add_tenant(slug)


def _not_found(rid: str) -> dict:
    """OpenAI's answer for a previous_response_id it cannot find (clients resend the history on it)."""
    return {"type": "invalid_request_error", "param": "previous_response_id", "code": "previous_response_not_found",
            "message": f"Previous response with id '{rid}' not found."}


def test_a_previous_response_that_cannot_be_found_is_openais_previous_response_not_found(stack: Stack) -> None:
    _, key = _tenant(stack)
    _, other_key = _tenant(stack)
    url = stack.gateway.base_url + "/v1/responses"
    headers, other = {"Authorization": f"Bearer {key}"}, {"Authorization": f"Bearer {other_key}"}

    def create(body: dict, h: dict = headers) -> httpx.Response:
        return httpx.post(url, headers=h, json={**ASK, **body}, timeout=120)

    first = create({}).json()
    second = create({"previous_response_id": first["id"], "input": "And of Italy?"}).json()
    unstored = create({"store": False}).json()
    deleted = create({}).json()
    httpx.delete(f"{url}/{deleted['id']}", headers=headers, timeout=60).raise_for_status()
    expired = create({}).json()
    with stack.session_factory() as session, session.begin():
        session.execute(update(StoredResponse).where(StoredResponse.id == expired["id"])
                        .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    for rid, h in (("resp_" + "0" * 48, headers), (unstored["id"], headers), (first["id"], other),
                   (deleted["id"], headers), (expired["id"], headers)):
        for stream in (False, True):
            answer = create({"previous_response_id": rid, "stream": stream}, h)
            assert answer.status_code == 400 and answer.json()["error"] == _not_found(rid), answer.text
    # through the SDK: a BadRequestError with the code clients branch on
    with pytest.raises(openai.BadRequestError) as caught:
        openai.OpenAI(api_key=other_key, base_url=url[:-len("/responses")], max_retries=0).responses.create(
            model=MODEL, input="Hi", previous_response_id=second["id"], max_output_tokens=2)
    assert caught.value.code == "previous_response_not_found" and caught.value.param == "previous_response_id"
    # a chain that lost an ancestor: the same code; the message goes on to name the missing link
    httpx.delete(f"{url}/{first['id']}", headers=headers, timeout=60).raise_for_status()
    broken = create({"previous_response_id": second["id"]})
    error = broken.json()["error"]
    assert broken.status_code == 400 and error["code"] == "previous_response_not_found", broken.text
    assert error["message"].startswith(_not_found(second["id"])["message"] + " ") and first["id"] in error["message"]
    # the stored response's own routes keep their 404, another tenant's id included
    for response in (httpx.get(f"{url}/{second['id']}", headers=other, timeout=60),
                     httpx.get(f"{url}/{second['id']}/input_items", headers=other, timeout=60),
                     httpx.delete(f"{url}/{second['id']}", headers=other, timeout=60),
                     httpx.get(f"{url}/{deleted['id']}", headers=headers, timeout=60)):
        assert response.status_code == 404 and response.json()["error"]["code"] == "response_not_found"


def _events(response: httpx.Response):  # type: ignore[no-untyped-def]
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def _not_stored_count(base: str, slug: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=60).text.splitlines():
        if line.startswith("kvgate_responses_not_stored_total{") and f'tenant="{slug}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_byte_cap_refuses_what_may_not_fit_before_the_engine_runs(stack: Stack, tmp_path) -> None:
    """Every stored request the gateway answers was stored: one that may not fit (its input, its
    response body and its output bound) is refused before it runs; only a cap reached while it ran
    answers store: false, and that is counted."""
    slug, key = _tenant(stack)
    with second_gateway(stack, tmp_path, responses_max_bytes=6000) as small:
        url = small.base_url + "/v1/responses"
        headers = {"Authorization": f"Bearer {key}"}
        answers = []
        for i in range(8):  # each row takes about 1.3 KB (the body echoes the request): the cap fills
            r = httpx.post(url, headers=headers, timeout=120, json={**ASK, "input": f"Hi {i}"})
            if r.status_code != 200:
                assert r.status_code == 400 and r.json()["error"]["code"] == "response_store_full", r.text
                break
            answers.append(r.json())
        else:
            pytest.fail("the cap was never reached")
        assert answers and all(a["store"] is True for a in answers), [a["store"] for a in answers]
        for a in answers:  # stored, readable
            assert httpx.get(f"{url}/{a['id']}", headers=headers, timeout=60).status_code == 200
        # a stream is refused before its first event too (it never says store: true and then stores nothing)
        streamed = httpx.post(url, headers=headers, timeout=120, json={**ASK, "stream": True})
        assert streamed.status_code == 400 and streamed.json()["error"]["code"] == "response_store_full"
        assert _not_stored_count(small.base_url, slug) == 0
    # the cap reached while a stream runs: answered, not stored, says so at the end, and is counted
    slug, key = _tenant(stack)
    with second_gateway(stack, tmp_path, responses_max_bytes=20_000) as roomy:
        url = roomy.base_url + "/v1/responses"
        headers = {"Authorization": f"Bearer {key}"}
        with stack.session_factory() as session:
            tenant_id = session.scalar(select(Tenant.id).where(Tenant.slug == slug))
        with httpx.stream("POST", url, headers=headers, timeout=300,
                          json={**ASK, "input": "Tell me a long story.", "max_output_tokens": 96,
                                "stream": True}) as response:
            assert response.status_code == 200
            events = _events(response)
            created = next(events)
            assert created["type"] == "response.created" and created["response"]["store"] is True
            with stack.session_factory() as session:  # meanwhile the tenant stores elsewhere up to the cap
                filler = [{"id": "f", "type": "message", "role": "user",
                           "content": [{"type": "input_text", "text": "x" * (20_000 - 200)}]}]
                stored.store_response(session, tenant_id=tenant_id, response_id="resp_filler_" + secrets.token_hex(8),
                                      previous_response_id=None, model=MODEL, input_items=filler, output_items=[],
                                      body={}, now=datetime.now(UTC), ttl=timedelta(hours=1), max_bytes=20_000)
            final = list(events)[-1]
        assert final["type"] in ("response.completed", "response.incomplete")
        assert final["response"]["store"] is False
        assert httpx.get(f"{url}/{final['response']['id']}", headers=headers, timeout=60).status_code == 404
        assert _not_stored_count(roomy.base_url, slug) == 1


def test_the_cap_counts_what_the_tenant_stored_not_the_prompts_block_hashes(stack: Stack) -> None:
    _, key = _tenant(stack)
    url = stack.gateway.base_url + "/v1/responses"
    headers = {"Authorization": f"Bearer {key}"}
    previous = None
    for turn in range(3):
        body = {**ASK, "input": "The quick brown fox jumps over the lazy dog. " * 20 + f"Turn {turn}."}
        if previous is not None:
            body["previous_response_id"] = previous
        previous = httpx.post(url, headers=headers, json=body, timeout=120).json()["id"]
        with stack.session_factory() as session:
            row = session.get(StoredResponse, previous)
            assert row.prompt_blocks and len(row.prompt_blocks) >= 10 * (turn + 1)  # the whole prompt's, kept
            assert row.size_bytes == stored.row_size(input_items=row.input_items, output_items=row.output_items,
                                                     body=row.body)


def test_a_short_store_ttl_bounds_the_conversation_hold(stack: Stack, tmp_path) -> None:
    """The gateway's hold ledger knows the store's TTL: a stored response is never held longer than
    the store keeps it (nobody can continue it after). Here the store keeps it 0.5 s: a measured
    0.4 s gap asks for the shortest hold (1 s), which the store's TTL cuts to 0.5 s."""
    from server.serving import build_serving_app
    from server.settings import Settings
    from tests.server.gateway.stack import PEPPER

    url = stack.session_factory.kw["bind"].url.render_as_string(hide_password=False)
    for ttl_s, held_ms in ((0.5, 500), (3600.0, 1_000)):
        app = build_serving_app(Settings(database_url=url, admin_tokens=["ci:" + "x" * 40], key_pepper=PEPPER,
                                         trace_dir=tmp_path / "traces", responses_ttl_s=ttl_s))
        holds = app.state.gateway.holds  # type: ignore[attr-defined]
        assert holds is app.state.gateway.runner.holds and holds.store_ttl_ms == int(ttl_s * 1000)
        holds.duel, hints, now = None, HintLedger(), 0.0  # the hold alone (its duel is tested apart)
        for i in range(MIN_GAP_SAMPLES + 1):  # stored tool steps, each continued 0.4 s later
            holds.plan(job(conversation=ConversationRequest(f"r{i}a", None, True, True)), DEFAULT_PLAN, [i], hints,
                       now)
            holds.plan(job(conversation=ConversationRequest(f"r{i}b", f"r{i}a", True, True)), DEFAULT_PLAN, [i],
                       hints, now + 0.4)
            now += 100.0
        out = holds.plan(job(conversation=ConversationRequest("last", None, True, True)), DEFAULT_PLAN,
                         list(range(5)), hints, now)
        assert out.hold_ms == held_ms, (ttl_s, out.hold_ms)


def test_input_items_before_and_include(stack: Stack) -> None:
    _, key = _tenant(stack)
    url = stack.gateway.base_url + "/v1/responses"
    headers = {"Authorization": f"Bearer {key}"}
    items = [{"id": f"m{i}", "role": "user" if i % 2 == 0 else "assistant", "content": f"line {i}"} for i in range(5)]
    rid = httpx.post(url, headers=headers, json={**ASK, "input": items, "max_output_tokens": 2}, timeout=120).json()["id"]

    def page(**params) -> tuple[list[str], bool]:  # type: ignore[no-untyped-def]
        r = httpx.get(f"{url}/{rid}/input_items", headers=headers, params=params, timeout=60)
        assert r.status_code == 200, r.text
        return [d["id"] for d in r.json()["data"]], r.json()["has_more"]

    assert page(before="m3") == (["m4"], False)  # newest first: before m3 comes m4
    assert page(order="asc", before="m3") == (["m0", "m1", "m2"], False)
    assert page(order="asc", before="m3", limit=2) == (["m1", "m2"], True)  # the page just before m3
    assert page(order="asc", after="m0", before="m3") == (["m1", "m2"], False)
    for value in ("message.output_text.logprobs", "message.input_image.image_url", "reasoning.encrypted_content"):
        assert page(include=[value]) == (["m4", "m3", "m2", "m1", "m0"], False)  # OpenAI's values: nothing to add
    for params, param in (({"include": ["nope"]}, "include"), ({"include": ["message.output_text.logprobs", "x.y"]},
                                                                "include"),
                          ({"before": "zzz"}, "before"), ({"before": "b" * 65}, "before")):
        r = httpx.get(f"{url}/{rid}/input_items", headers=headers, params=params, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (params, r.text)
        if param == "include":
            assert params["include"][-1] in r.json()["error"]["message"]
