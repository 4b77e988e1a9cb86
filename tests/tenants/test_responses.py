"""Stored responses (tenants.responses) on SQLite and PostgreSQL: per tenant, TTL, byte cap, chains, pages."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from tenants import responses
from tenants.errors import InvalidField, NotFound
from tenants.models import AuditEvent, StoredResponse
from tests.tenants.factories import make_placement, make_tenant

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
TTL = timedelta(days=30)


def _items(*texts: str) -> list[dict]:
    return [{"id": f"msg_{t}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": t}]}
            for t in texts]


def _store(session, tenant_id: int, ident: str, *, previous: str | None = None, now: datetime = T0,
           max_bytes: int = 10**6, texts: tuple[str, ...] = ("hi",), ancestors: tuple[str, ...] = (),
           items: list[dict] | None = None):  # type: ignore[no-untyped-def]
    output = [{"id": f"out_{ident}", "type": "message", "role": "assistant",
               "content": [{"type": "output_text", "text": f"answer {ident}", "annotations": []}]}]
    return responses.store_response(session, tenant_id=tenant_id, response_id=ident, previous_response_id=previous,
                                    model="m", input_items=_items(*texts) if items is None else items,
                                    output_items=output, body={"id": ident, "status": "completed"}, now=now, ttl=TTL,
                                    max_bytes=max_bytes, ancestor_ids=ancestors)


@pytest.fixture
def two_tenants(session):  # type: ignore[no-untyped-def]
    first = make_placement(session)
    second = make_tenant(session, "globex")
    return first.id, second.id


def test_a_response_is_read_only_by_its_tenant(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    acme, globex = two_tenants
    _store(session, acme, "resp_a")
    row = responses.get_response(session, tenant_id=acme, response_id="resp_a", now=T0)
    assert row.output_items[0]["content"][0]["text"] == "answer resp_a"
    for call in (responses.get_response, responses.delete_response, responses.list_input_items,
                 responses.response_chain):
        with pytest.raises(NotFound) as caught:
            call(session, tenant_id=globex, response_id="resp_a", now=T0)
        assert caught.value.code == "response_not_found"
        with pytest.raises(NotFound) as missing:  # the same answer as for an id that never existed
            call(session, tenant_id=globex, response_id="resp_nope", now=T0)
        assert missing.value.message.replace("resp_nope", "resp_a") == caught.value.message
        for impossible in ("resp_\x00a", "resp_" + "a" * 60):  # PostgreSQL's text holds no NUL: never queried
            with pytest.raises(NotFound):
                call(session, tenant_id=acme, response_id=impossible, now=T0)
    assert session.scalar(select(func.count()).select_from(AuditEvent).where(
        AuditEvent.entity_type == "response")) == 0  # data, not configuration


def test_expired_and_deleted_responses_are_gone(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    acme, _ = two_tenants
    _store(session, acme, "resp_old")
    _store(session, acme, "resp_del")
    later = T0 + TTL
    with pytest.raises(NotFound):
        responses.get_response(session, tenant_id=acme, response_id="resp_old", now=later)
    assert responses.get_response(session, tenant_id=acme, response_id="resp_old", now=later - timedelta(seconds=1))
    responses.delete_response(session, tenant_id=acme, response_id="resp_del", now=T0)
    with pytest.raises(NotFound):
        responses.get_response(session, tenant_id=acme, response_id="resp_del", now=T0)
    with pytest.raises(NotFound):
        responses.delete_response(session, tenant_id=acme, response_id="resp_del", now=T0)
    # the next store of the tenant purges its expired rows
    _store(session, acme, "resp_new", now=later)
    assert session.scalars(select(StoredResponse.id)).all() == ["resp_new"]


def test_the_byte_cap_refuses_and_stores_nothing(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    acme, globex = two_tenants
    first = _store(session, acme, "resp_1")
    assert first.size_bytes == responses.row_size(input_items=first.input_items, output_items=first.output_items,
                                                   body=first.body)
    cap = first.size_bytes * 2 + 10
    _store(session, acme, "resp_2", max_bytes=cap)
    assert responses.stored_bytes(session, tenant_id=acme, now=T0) == 2 * first.size_bytes
    with pytest.raises(responses.StoreFull) as caught:
        _store(session, acme, "resp_3", max_bytes=cap)
    assert caught.value.code == "response_store_full" and caught.value.field == "store"
    with pytest.raises(NotFound):
        responses.get_response(session, tenant_id=acme, response_id="resp_3", now=T0)
    with pytest.raises(responses.StoreFull):
        responses.check_room(session, tenant_id=acme, now=T0, incoming=11, max_bytes=cap)
    _store(session, globex, "resp_g", max_bytes=cap)  # the cap is per tenant
    # expired rows no longer count
    assert responses.stored_bytes(session, tenant_id=acme, now=T0 + TTL) == 0
    _store(session, acme, "resp_4", max_bytes=cap, now=T0 + TTL)


def test_chains_oldest_first_and_broken_links(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    acme, globex = two_tenants
    _store(session, acme, "resp_1")
    _store(session, acme, "resp_2", previous="resp_1")
    _store(session, acme, "resp_3", previous="resp_2")
    chain = responses.response_chain(session, tenant_id=acme, response_id="resp_3", now=T0)
    assert [row.id for row in chain] == ["resp_1", "resp_2", "resp_3"]
    responses.delete_response(session, tenant_id=acme, response_id="resp_2", now=T0)
    with pytest.raises(NotFound) as broken:  # readable, not continuable: the message names the missing link
        responses.response_chain(session, tenant_id=acme, response_id="resp_3", now=T0)
    assert broken.value.message == ("Response 'resp_3' cannot be continued: the response 'resp_2' it continues "
                                    "was deleted or has expired.")
    assert broken.value.field == "previous_response_id" and broken.value.code == "response_not_found"
    assert responses.get_response(session, tenant_id=acme, response_id="resp_3", now=T0)
    _store(session, globex, "resp_g", previous="resp_1")  # a link to another tenant's response is broken too
    with pytest.raises(NotFound):
        responses.response_chain(session, tenant_id=globex, response_id="resp_g", now=T0)


def test_a_long_conversations_prompt_hashes_do_not_count_against_the_cap(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    """Each row keeps its whole prompt's block hashes: counted, a conversation's would grow the
    tenant's bytes quadratically (turn n stores n turns' hashes) though it stored little."""
    acme, _ = two_tenants
    output = [{"id": "o", "type": "message", "role": "assistant", "content": []}]
    one = responses.row_size(input_items=_items("t00"), output_items=output, body={"id": "c00"})
    cap = 20 * one + 100  # room for the 20 turns' own JSON
    previous = None
    for turn in range(20):
        ident = f"c{turn:02d}"
        row = responses.store_response(session, tenant_id=acme, response_id=ident, previous_response_id=previous,
                                       model="m", input_items=_items(f"t{turn:02d}"), output_items=output,
                                       body={"id": ident}, now=T0, ttl=TTL, max_bytes=cap, root_id="c00",
                                       prompt_blocks=[2**63 + i for i in range(64 * (turn + 1))])
        assert row.size_bytes == one  # 64 hashes more each turn (about 1.3 KB): none of them counted
        previous = ident
    assert responses.stored_bytes(session, tenant_id=acme, now=T0) == 20 * one


def test_input_item_pages(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    acme, _ = two_tenants
    _store(session, acme, "resp_p", texts=("a", "b", "c"))

    def ids(**kw) -> tuple[list[str], bool]:  # type: ignore[no-untyped-def]
        page = responses.list_input_items(session, tenant_id=acme, response_id="resp_p", now=T0, **kw)
        return [item["id"] for item in page.items], page.has_more

    assert ids() == (["msg_c", "msg_b", "msg_a"], False)
    assert ids(order="asc", limit=2) == (["msg_a", "msg_b"], True)
    assert ids(order="asc", limit=2, after="msg_b") == (["msg_c"], False)
    assert ids(after="msg_c") == (["msg_b", "msg_a"], False)
    # before: the page just before that item, in the same order (has_more: more before it)
    assert ids(order="asc", before="msg_c") == (["msg_a", "msg_b"], False)
    assert ids(order="asc", limit=1, before="msg_c") == (["msg_b"], True)
    assert ids(before="msg_a") == (["msg_c", "msg_b"], False)
    assert ids(before="msg_c") == ([], False)
    assert ids(order="asc", after="msg_a", before="msg_c") == (["msg_b"], False)
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "msg_zz"}, {"before": "msg_zz"},
                {"order": "asc", "after": "msg_b", "before": "msg_a"}):
        with pytest.raises(InvalidField):
            ids(**bad)


def test_the_sweep_purges_every_tenants_expired_rows(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    acme, globex = two_tenants
    _store(session, acme, "resp_a1")
    _store(session, globex, "resp_g1")
    _store(session, acme, "resp_a2", now=T0 + timedelta(days=1))
    assert responses.purge_expired(session, now=T0 + TTL - timedelta(seconds=1)) == 0
    assert responses.purge_expired(session, now=T0 + TTL, limit=1) == 1
    assert responses.purge_expired(session, now=T0 + TTL) == 1
    assert session.scalars(select(StoredResponse.id)).all() == ["resp_a2"]
    assert responses.get_response(session, tenant_id=acme, response_id="resp_a2", now=T0 + TTL)


def test_a_conversations_live_prompt_blocks_are_read_back_by_root(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    acme, globex = two_tenants
    big = 2**64 - 1  # block hashes are unsigned 64-bit: they survive the JSON column on both backends

    def put(tenant_id: int, ident: str, root: str | None, blocks: list[int] | None, **kw):  # type: ignore[no-untyped-def]
        output = [{"id": f"out_{ident}", "type": "message", "role": "assistant", "content": []}]
        return responses.store_response(session, tenant_id=tenant_id, response_id=ident, previous_response_id=None,
                                        model="m", input_items=_items("hi"), output_items=output, body={"id": ident},
                                        now=kw.get("now", T0), ttl=kw.get("ttl", TTL), max_bytes=10**6,
                                        root_id=root, prompt_blocks=blocks)

    first = put(acme, "r1", "r1", [big, 2])
    # the hashes are the gateway's bookkeeping, not what the tenant stored: not in the cap's count
    assert first.size_bytes == responses.row_size(input_items=_items("hi"), output_items=first.output_items,
                                                   body={"id": "r1"})
    put(acme, "r2", "r1", [big, 2, 3])  # the next turn
    put(acme, "r3", "r1", [big, 5])  # a fork
    put(acme, "r4", "r1", None)  # a row whose blocks are unknown
    put(acme, "r5", "r1", [big, 2, 3, 4], ttl=timedelta(seconds=1))  # expired by T0 + 1 min
    put(acme, "s1", "s1", [big, 9])  # another conversation of the tenant: not read
    put(globex, "g1", "r1", [big, 2, 3])  # another tenant's row under the same root id: never read
    put(acme, "old", None, [big])  # stored before roots were kept: no relatives
    later = T0 + timedelta(minutes=1)

    def rows(tenant_id: int, ident: str) -> list[tuple]:  # type: ignore[type-arg]
        return [(r.id, r.previous_response_id, r.prompt_blocks)
                for r in responses.conversation_rows(session, tenant_id=tenant_id, response_id=ident, now=later)]

    conversation = [("r1", None, (big, 2)), ("r2", None, (big, 2, 3)), ("r3", None, (big, 5)), ("r4", None, None)]
    assert rows(acme, "r2") == conversation  # oldest first, the expired r5 and the others' rows left out
    assert rows(acme, "old") == [("old", None, (big,))]
    responses.delete_response(session, tenant_id=acme, response_id="r1", now=later)
    assert rows(acme, "r3") == conversation[1:]
    with pytest.raises(NotFound):
        rows(globex, "r3")
    # An ended run's demote reads the tenant's other conversations (newest first, bounded), never its own.
    others = responses.other_conversations(session, tenant_id=acme, root_id="r1", now=later, limit=10)
    assert others == [("s1", (big, 9)), ("old", (big,))]  # same created_at: by id, newest first
    assert responses.other_conversations(session, tenant_id=acme, root_id="r1", now=later, limit=1) == others[:1]
    assert responses.other_conversations(session, tenant_id=globex, root_id="s1", now=later, limit=10) == [
        ("r1", (big, 2, 3))]  # another tenant's rows are never read


def test_a_continuation_keeps_its_chain_alive_as_long_as_itself(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    acme, globex = two_tenants
    day = timedelta(days=1)
    _store(session, acme, "c1")
    _store(session, acme, "c2", previous="c1", now=T0 + day, ancestors=("c1",))
    _store(session, globex, "g1", now=T0)
    _store(session, acme, "c3", previous="c2", now=T0 + 2 * day, ancestors=("c1", "c2", "g1"))
    expiry = {row.id: row.expires_at for row in session.scalars(select(StoredResponse))}
    # c1 was raised to c2's expiry + half a TTL when c2 was stored, so c3 (a day later) rewrites only c2
    assert expiry["c1"] == T0 + day + TTL + TTL / 2 and expiry["c2"] == T0 + 2 * day + TTL + TTL / 2
    assert min(expiry["c1"], expiry["c2"]) >= expiry["c3"] == T0 + 2 * day + TTL  # at least the newest turn's
    assert expiry["g1"] == T0 + TTL  # another tenant's row is never touched
    # past the root's own TTL the conversation is still whole, and continuable
    later = T0 + TTL + day
    chain = responses.response_chain(session, tenant_id=acme, response_id="c3", now=later)
    assert [row.id for row in chain] == ["c1", "c2", "c3"]
    # an older turn's continuation (a fork) never shortens what the newest one keeps
    _store(session, acme, "f2", previous="c1", now=T0 + day, ancestors=("c1",))
    assert responses.get_response(session, tenant_id=acme, response_id="c1", now=later).expires_at == \
        T0 + day + TTL + TTL / 2
    # a row already gone stays gone: its descendants stay readable, not continuable
    responses.delete_response(session, tenant_id=acme, response_id="c2", now=later)
    _store(session, acme, "c4", previous="c3", now=later, ancestors=("c1", "c2", "c3"))
    assert session.scalars(select(StoredResponse.id).where(StoredResponse.id == "c2")).all() == []
    with pytest.raises(NotFound) as caught:
        responses.response_chain(session, tenant_id=acme, response_id="c4", now=later)
    assert "'c2' it continues was deleted or has expired" in caught.value.message


def test_paging_over_repeated_item_ids_always_moves_on(session, two_tenants) -> None:  # type: ignore[no-untyped-def]
    """Rows stored before repeated ids were refused: each repeat is served renamed, every item once."""
    acme, _ = two_tenants
    items = [{"id": ident, "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
             for ident, text in (("x1", "a"), ("x1", "b"), ("x2", "c"))]
    _store(session, acme, "resp_dup", items=items)
    for order in ("asc", "desc"):
        seen, after = [], None
        for _ in range(5):  # the SDK's auto-pager: until has_more is false
            page = responses.list_input_items(session, tenant_id=acme, response_id="resp_dup", now=T0, limit=1,
                                              order=order, after=after)
            seen.extend(item["content"][0]["text"] for item in page.items)
            if not page.has_more:
                break
            after = page.items[-1]["id"]
        else:
            pytest.fail(f"{order}: paging never ends ({seen})")
        assert seen == (["a", "b", "c"] if order == "asc" else ["c", "b", "a"]), seen
    page = responses.list_input_items(session, tenant_id=acme, response_id="resp_dup", now=T0, order="asc")
    assert [item["id"] for item in page.items] == ["x1", "x1~2", "x2"]
    # a client's own id that looks like a new name is never given to a repeat
    clash = [{**items[0], "id": "y"}, {**items[1], "id": "y"}, {**items[2], "id": "y~2"}]
    _store(session, acme, "resp_clash", items=clash)
    ids, after = [], None
    for _ in range(5):
        page = responses.list_input_items(session, tenant_id=acme, response_id="resp_clash", now=T0, limit=1,
                                          order="asc", after=after)
        ids.extend(item["id"] for item in page.items)
        if not page.has_more:
            break
        after = page.items[-1]["id"]
    assert ids == ["y", "y~3", "y~2"], ids
