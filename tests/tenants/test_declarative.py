"""`registry.yaml` → plan → one audited transaction, on SQLite and PostgreSQL.

Apply twice → no change and no audit event; a changed file → exactly the audited changes;
a bad file (unknown field, unknown pool, bad priority) → a clear error naming the path
and nothing written; a change that fails half-way → nothing written.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import func, select

from tenants import declarative, replicas
from tenants.errors import Conflict, InUse, InvalidField
from tenants.models import AuditEvent, Pool, PoolReplica, RetentionClass, Tenant
from tests.tenants.factories import make_class, make_pool, make_tenant, now

ROOT = Path(__file__).resolve().parents[2]
ACTOR = "cli:ops"
FILE: dict[str, Any] = {
    "pools": [
        {
            "name": "llama8b",
            "model_name": "llama-3.1-8b",
            "engine_spec": "llama-3.1-8b-instruct-fp8kv",
            "tokens_per_block": 32,
            "primary_blocks": 8192,
            "secondary_blocks": 32768,
            "secondary_offload_min_priority": 35,
            "replicas": [
                {"name": "r0", "endpoint": "kvgate-engine-llama8b-0.kvgate-engine-llama8b:8001", "weight": 1,
                 "state": "active"},
                {"name": "r1", "endpoint": "kvgate-engine-llama8b-1.kvgate-engine-llama8b:8001"},
            ],
        }
    ],
    "retention_classes": [{"name": "chat", "turn_priority": 30, "turn_duration_ms": None}],
    "tenants": [
        {"slug": "acme", "pool": "llama8b", "retention_class": "chat", "isolation": "salted", "rpm_limit": 100,
         "kv_quota_fraction": 0.4},
        {"slug": "beta", "display_name": "Beta", "pool": "llama8b", "retention_class": "chat"},
    ],
}


def _events(session) -> list[AuditEvent]:  # type: ignore[no-untyped-def]
    return list(session.scalars(select(AuditEvent).order_by(AuditEvent.id)))


def _apply(session, data: dict[str, Any], **kw: Any) -> declarative.Plan:  # type: ignore[no-untyped-def]
    return declarative.apply_registry(session, declarative.parse_registry(data), actor=ACTOR, now=now(), **kw)


def _counts(session) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    return tuple(
        session.scalar(select(func.count()).select_from(m)) for m in (Pool, PoolReplica, RetentionClass, Tenant,
                                                                       AuditEvent)
    )


def test_apply_twice_changes_nothing_the_second_time(session) -> None:  # type: ignore[no-untyped-def]
    plan = _apply(session, FILE)
    assert [(c.kind, c.action, c.ref) for c in plan.changes] == [
        ("retention_class", "create", "chat"),
        ("pool", "create", "llama8b"),
        ("tenant", "create", "acme"),
        ("tenant", "create", "beta"),
    ]
    events = _events(session)
    assert [e.action for e in events] == ["retention_class.create", "pool.create", "tenant.create", "tenant.create"]
    assert {e.actor for e in events} == {ACTOR}
    pool = session.scalars(select(Pool)).one()
    assert [(r.name, r.weight, r.state) for r in pool.replicas] == [("r0", 1, "active"), ("r1", 1, "active")]
    acme = session.scalars(select(Tenant).where(Tenant.slug == "acme")).one()
    assert (acme.display_name, acme.rpm_limit, acme.kv_quota_fraction, acme.tpm_limit) == ("acme", 100, 0.4, 200_000)
    assert session.scalars(select(RetentionClass)).one().turn_duration_ms is None

    again = _apply(session, FILE)
    assert again.empty and again.render() == "no changes: the registry matches the file"
    assert len(_events(session)) == 4
    # The shipped example applies cleanly, twice, too.
    example = yaml.safe_load((ROOT / "deploy/registry.example.yaml").read_text())
    assert not _apply(session, example).empty
    assert _apply(session, example).empty


def test_a_changed_file_makes_exactly_the_audited_changes(session) -> None:  # type: ignore[no-untyped-def]
    _apply(session, FILE)
    before = len(_events(session))
    changed = copy.deepcopy(FILE)
    changed["pools"][0]["primary_blocks"] = 16384
    changed["pools"][0]["replicas"][1]["state"] = "draining"
    changed["pools"][0]["replicas"].append({"name": "r2", "endpoint": "10.0.0.3:8001", "weight": 2})
    changed["retention_classes"][0]["turn_priority"] = 20
    changed["tenants"][0]["rpm_limit"] = 200
    changed["tenants"][1]["status"] = "suspended"
    dry = declarative.apply_registry(session, declarative.parse_registry(changed), actor=ACTOR, now=now(),
                                     dry_run=True)
    assert len(_events(session)) == before  # dry run: nothing written
    text = dry.render()
    for line in (
        "~ pool llama8b", "    primary_blocks: 8192 → 16384",
        "~ replica llama8b/r1", '    state: "active" → "draining"',
        "+ replica llama8b/r2", '    endpoint: "10.0.0.3:8001"',
        "~ retention_class chat", "    turn_priority: 30 → 20",
        "~ tenant acme", "    rpm_limit: 100 → 200",
        "~ tenant beta (suspend)",
        "6 change(s): 1 create, 1 suspend, 4 update",
    ):
        assert line in text.splitlines(), (line, text)

    plan = _apply(session, changed)
    assert [(c.kind, c.action, c.ref) for c in plan.changes] == [(c.kind, c.action, c.ref) for c in dry.changes]
    new = _events(session)[before:]
    assert [(e.action, e.entity_type) for e in new] == [
        ("retention_class.update", "retention_class"),
        ("pool.update", "pool"),
        ("pool_replica.create", "pool_replica"),
        ("pool_replica.update", "pool_replica"),
        ("tenant.update", "tenant"),
        ("tenant.suspend", "tenant"),
    ]
    assert all(e.actor == ACTOR for e in new)
    assert (new[1].before["primary_blocks"], new[1].after["primary_blocks"]) == (8192, 16384)
    assert _apply(session, changed).empty


def test_omitted_fields_are_not_managed(session) -> None:  # type: ignore[no-untyped-def]
    """A replica an operator drained stays drained when the file says nothing about its state."""
    _apply(session, FILE)
    replicas.drain_replica(session, actor="ops", now=now(), pool="llama8b", name="r1")
    assert _apply(session, FILE).empty  # r1 has no state in FILE
    forced = copy.deepcopy(FILE)
    forced["pools"][0]["replicas"][1]["state"] = "active"
    (change,) = _apply(session, forced).changes
    assert (change.kind, change.ref, change.fields[0].old, change.fields[0].new) == (
        "replica", "llama8b/r1", "draining", "active")


def test_prune_only_deletes_listed_kinds(session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session, name="legacy")
    make_class(session, name="old")
    make_tenant(session, slug="gone", pool="legacy", cls="old")
    _apply(session, FILE)
    counts = _counts(session)
    # Pruning pools alone cannot delete "legacy" while tenant "gone" (not pruned: no
    # tenants list in this file) is on it: the registry refuses, nothing is written.
    with pytest.raises(InUse):
        _apply(session, {"pools": FILE["pools"]}, prune=True)
    assert _counts(session) == counts
    # Without --prune nothing outside the file is touched.
    assert _apply(session, FILE).empty
    assert _counts(session) == counts
    trimmed = copy.deepcopy(FILE)
    trimmed["pools"][0]["replicas"] = trimmed["pools"][0]["replicas"][1:]
    plan = _apply(session, trimmed, prune=True)
    assert [(c.kind, c.action, c.ref) for c in plan.changes] == [
        ("replica", "delete", "llama8b/r0"),
        ("tenant", "delete", "gone"),
        ("pool", "delete", "legacy"),
        ("retention_class", "delete", "old"),
    ]
    assert [r.name for r in session.scalars(select(Pool)).one().replicas] == ["r1"]
    assert _apply(session, trimmed, prune=True).empty


def test_prune_of_a_file_without_tenants_keeps_tenants(session) -> None:  # type: ignore[no-untyped-def]
    _apply(session, FILE)
    plan = _apply(session, {"retention_classes": FILE["retention_classes"]}, prune=True)
    assert plan.empty and session.scalar(select(func.count()).select_from(Tenant)) == 2


@pytest.mark.parametrize(
    ("mutate", "field", "code"),
    [
        (lambda d: d["tenants"][0].update(api_keys=["kvg_x"]), "tenants[0].api_keys", "unknown_field"),
        (lambda d: d["pools"][0]["replicas"][0].update(port=1), "pools[0].replicas[0].port", "unknown_field"),
        (lambda d: d.update(quotas=[]), "quotas", "unknown_field"),
        (lambda d: d["tenants"][1].update(pool="nope"), "tenants[1].pool", "unknown_pool"),
        (lambda d: d["tenants"][1].update(retention_class="nope"), "tenants[1].retention_class",
         "unknown_retention_class"),
        (lambda d: d["retention_classes"][0].update(turn_priority=150), "retention_classes[0].turn_priority", None),
        (lambda d: d["pools"][0].update(secondary_offload_min_priority=-1),
         "pools[0].secondary_offload_min_priority", None),
        (lambda d: d["pools"][0]["replicas"][1].update(name="r0"), "pools[0].replicas[1]", "duplicate"),
        (lambda d: d["pools"][0].update(replicas=[]), "pools[0].replicas", None),
        (lambda d: d["tenants"][0].update(status="paused"), "tenants[0].status", None),
    ],
)
def test_a_bad_file_is_a_clear_error_and_writes_nothing(session, mutate, field, code) -> None:  # type: ignore[no-untyped-def]
    bad = copy.deepcopy(FILE)
    mutate(bad)
    with pytest.raises(InvalidField) as err:
        _apply(session, bad)
    assert err.value.field == field and err.value.message.startswith(field)
    if code is not None:
        assert err.value.code == code
    assert _counts(session) == (0, 0, 0, 0, 0)


def test_a_change_failing_half_way_rolls_back_the_whole_apply(session) -> None:  # type: ignore[no-untyped-def]
    """The last tenant cannot be placed (dedicated pool taken): the class, pool, replicas and
    the first tenant created before it in the same apply are rolled back too."""
    bad = copy.deepcopy(FILE)
    bad["tenants"][0]["isolation"] = "dedicated"
    with pytest.raises(Conflict) as err:
        _apply(session, bad)
    assert err.value.code == "pool_dedicated"
    assert _counts(session) == (0, 0, 0, 0, 0)
    assert _apply(session, FILE).changes  # and the session is usable afterwards


def _placement_file(tenants: list[dict[str, Any]], pools: tuple[str, ...] = ("x", "y")) -> dict[str, Any]:
    return {"pools": [{"name": p, "model_name": "m", "primary_blocks": 64,
                       "replicas": [{"name": "r0", "endpoint": f"{p}-0:8001"}]} for p in pools],
            "retention_classes": [{"name": "chat"}],
            "tenants": [{"retention_class": "chat", **t} for t in tenants]}


def _placements(session) -> dict[str, tuple[str, str]]:  # type: ignore[no-untyped-def]
    rows = session.execute(select(Tenant.slug, Pool.name, Tenant.isolation).join(Pool, Tenant.pool_id == Pool.id))
    return {slug: (pool, isolation) for slug, pool, isolation in rows}


def test_dedicated_tenants_can_swap_pools(session) -> None:  # type: ignore[no-untyped-def]
    """Dedication is a rule on the end state: two dedicated tenants trading pools is one apply
    (each move alone would put two tenants on a dedicated pool)."""
    _apply(session, _placement_file([{"slug": "a", "pool": "x", "isolation": "dedicated"},
                                     {"slug": "b", "pool": "y", "isolation": "dedicated"}]))
    before = len(_events(session))
    swapped = _placement_file([{"slug": "a", "pool": "y", "isolation": "dedicated"},
                               {"slug": "b", "pool": "x", "isolation": "dedicated"}])
    plan = _apply(session, swapped)
    assert [(c.kind, c.action, c.ref) for c in plan.changes] == [("tenant", "update", "a"), ("tenant", "update", "b")]
    assert _placements(session) == {"a": ("y", "dedicated"), "b": ("x", "dedicated")}
    assert [e.action for e in _events(session)[before:]] == ["tenant.update", "tenant.update"]
    assert _apply(session, swapped).empty


def test_pools_are_vacated_before_they_are_taken(session) -> None:  # type: ignore[no-untyped-def]
    """A dedicated tenant may take a pool that a later-listed tenant leaves, that a pruned tenant
    leaves, or that a moved tenant leaves for a new one; whatever the order of the file."""
    pools = ("x", "y", "z", "w")
    _apply(session, _placement_file([{"slug": "a", "pool": "x", "isolation": "dedicated"},
                                     {"slug": "s", "pool": "y"}, {"slug": "old", "pool": "w"}], pools))
    wanted = _placement_file([
        {"slug": "n", "pool": "x", "isolation": "dedicated"},  # new, on the pool a leaves
        {"slug": "a", "pool": "y", "isolation": "dedicated"},  # onto the pool s leaves
        {"slug": "s", "pool": "z"},
        {"slug": "m", "pool": "w", "isolation": "dedicated"},  # new, on the pool the pruned "old" leaves
    ], pools)
    plan = _apply(session, wanted, prune=True)
    assert sorted((c.action, c.ref) for c in plan.changes) == [
        ("create", "m"), ("create", "n"), ("delete", "old"), ("update", "a"), ("update", "s")]
    assert _placements(session) == {"n": ("x", "dedicated"), "a": ("y", "dedicated"), "s": ("z", "salted"),
                                    "m": ("w", "dedicated")}
    assert _apply(session, wanted, prune=True).empty


@pytest.mark.parametrize(("tenants", "code"), [
    # Both onto y: the end state itself breaks dedication.
    ([{"slug": "a", "pool": "y", "isolation": "dedicated"}, {"slug": "b", "pool": "y", "isolation": "dedicated"}],
     "pool_not_empty"),
    # A salted tenant onto the pool a dedicated tenant keeps.
    ([{"slug": "a", "pool": "x", "isolation": "dedicated"}, {"slug": "b", "pool": "x", "isolation": "salted"}],
     "pool_dedicated"),
])
def test_an_end_state_that_breaks_dedication_is_refused_whole(session, tenants, code) -> None:  # type: ignore[no-untyped-def]
    _apply(session, _placement_file([{"slug": "a", "pool": "x", "isolation": "dedicated"},
                                     {"slug": "b", "pool": "y", "isolation": "dedicated"}]))
    counts = _counts(session)
    with pytest.raises(Conflict) as err:
        _apply(session, _placement_file(tenants))
    assert err.value.code == code
    assert _counts(session) == counts
    assert _placements(session) == {"a": ("x", "dedicated"), "b": ("y", "dedicated")}


def test_replicas_are_renamed_at_the_per_pool_maximum_and_below(session) -> None:  # type: ignore[no-untyped-def]
    """--prune renaming a replica: a pool at its maximum drops the old one before adding the new
    one; a pool with a single replica adds the new one before dropping the old one."""
    full = [{"name": f"r{i}", "endpoint": f"10.0.{i // 200}.{i % 200}:8001"} for i in range(replicas.MAX_REPLICAS)]
    doc = {"pools": [{"name": "big", "model_name": "m", "primary_blocks": 64, "replicas": full},
                     {"name": "one", "model_name": "m", "primary_blocks": 64,
                      "replicas": [{"name": "r0", "endpoint": "10.1.0.1:8001"}]}]}
    _apply(session, doc)
    renamed = copy.deepcopy(doc)
    renamed["pools"][0]["replicas"][0] = {"name": "new0", "endpoint": "10.2.0.1:8001"}
    renamed["pools"][0]["replicas"][1] = {"name": "new1", "endpoint": "10.2.0.2:8001"}
    renamed["pools"][1]["replicas"][0] = {"name": "r1", "endpoint": "10.1.0.2:8001"}
    plan = _apply(session, renamed, prune=True)
    assert [(c.action, c.ref) for c in plan.changes] == [
        ("delete", "big/r0"), ("create", "big/new0"), ("delete", "big/r1"), ("create", "big/new1"),
        ("create", "one/r1"), ("delete", "one/r0")]
    names = {p.name: sorted(r.name for r in p.replicas) for p in session.scalars(select(Pool))}
    assert len(names["big"]) == replicas.MAX_REPLICAS and {"new0", "new1"} <= set(names["big"])
    assert {"r0", "r1"}.isdisjoint(names["big"]) and names["one"] == ["r1"]
    assert _apply(session, renamed, prune=True).empty


def test_yaml_errors_name_the_line() -> None:
    with pytest.raises(InvalidField) as err:
        declarative.load_registry("pools:\n  - name: [\n")
    assert err.value.code == "invalid_yaml" and "line" in err.value.message


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("retention_classes:\n  - {name: chat}\nretention_classes: []\n", "retention_classes", 3),
        ("pools: []\ntenants:\n  - slug: acme\n    pool: p\n    slug: beta\n", "slug", 5),
        ('{"pools": [], "pools": []}', "pools", 1),
    ],
)
def test_a_repeated_key_is_refused_naming_the_key_and_line(text: str, key: str, line: int) -> None:
    # Plain YAML lets the last key win: a repeated list would vanish, and --prune delete its rows.
    with pytest.raises(InvalidField) as err:
        declarative.load_registry(text)
    assert err.value.code == "invalid_yaml"
    assert f"duplicate key {key!r}" in err.value.message and f"at line {line}," in err.value.message


def test_merge_keys_may_still_be_overridden() -> None:
    text = ("retention_classes:\n  - &base {name: chat, turn_priority: 30}\n"
            "  - {<<: *base, name: batch}\n")
    doc = declarative.load_registry(text)
    assert [c.name for c in doc.retention_classes] == ["chat", "batch"]


def test_hint_fields_are_declared_applied_and_validated(session) -> None:  # type: ignore[no-untyped-def]
    hinted = copy.deepcopy(FILE)
    hinted["retention_classes"][0].update(hints_enabled=True, hint_max_ttl_ms=3_600_000, hint_max_priority=70)
    _apply(session, hinted)
    row = session.scalar(select(RetentionClass).where(RetentionClass.name == "chat"))
    assert (row.hints_enabled, row.hint_max_priority, row.hint_quota_fraction) == (True, 70, 0.5)
    assert _apply(session, hinted).empty
    hinted["retention_classes"][0]["hint_quota_fraction"] = 0.0
    with pytest.raises(InvalidField) as err:
        _apply(session, hinted)
    assert "hint_quota_fraction" in str(err.value)


def test_the_conversation_hold_switch_is_declared_and_applied(session) -> None:  # type: ignore[no-untyped-def]
    held = copy.deepcopy(FILE)
    held["retention_classes"][0]["conversation_hold_enabled"] = True
    _apply(session, held)
    row = session.scalar(select(RetentionClass).where(RetentionClass.name == "chat"))
    assert (row.conversation_hold_enabled, row.hints_enabled) == (True, False)
    assert _apply(session, held).empty
    held["retention_classes"][0]["conversation_hold_enabled"] = "yes"
    with pytest.raises(InvalidField) as err:
        _apply(session, held)
    assert "conversation_hold_enabled" in str(err.value)


def test_the_end_demote_switch_is_declared_and_applied_apart_from_the_hold(session) -> None:  # type: ignore[no-untyped-def]
    _apply(session, FILE)
    ended = copy.deepcopy(FILE)
    ended["retention_classes"][0]["conversation_end_demote_enabled"] = True
    plan = _apply(session, ended)
    assert "conversation_end_demote_enabled: false → true" in plan.render()
    row = session.scalar(select(RetentionClass).where(RetentionClass.name == "chat"))
    assert (row.conversation_end_demote_enabled, row.conversation_hold_enabled) == (True, False)
    assert _apply(session, ended).empty
    ended["retention_classes"][0]["conversation_end_demote_enabled"] = 1
    with pytest.raises(InvalidField) as err:
        _apply(session, ended)
    assert "conversation_end_demote_enabled" in str(err.value)


def test_limit_caps_are_declared_applied_and_validated(session) -> None:  # type: ignore[no-untyped-def]
    capped = copy.deepcopy(FILE)
    capped["tenants"][0]["limit_caps"] = {"rpm_limit": 500, "kv_quota_fraction": 0.6}
    _apply(session, capped)
    acme = session.scalar(select(Tenant).where(Tenant.slug == "acme"))
    assert acme.limit_caps == {"rpm_limit": 500, "kv_quota_fraction": 0.6}
    assert _apply(session, capped).empty
    capped["tenants"][0]["limit_caps"] = {"rpm_limit": 800}
    plan = _apply(session, capped)
    assert [(c.kind, c.action) for c in plan.changes] == [("tenant", "update")]
    capped["tenants"][0]["limit_caps"] = {"cache_salt": 1}
    with pytest.raises(InvalidField) as err:
        _apply(session, capped)
    assert "cache_salt" in str(err.value)


def test_empty_limit_caps_settle_after_one_apply(session) -> None:  # type: ignore[no-untyped-def]
    """The registry stores ``limit_caps: {}`` as no caps (NULL): a re-apply plans nothing."""
    doc = copy.deepcopy(FILE)
    doc["tenants"][0]["limit_caps"] = {"rpm_limit": 1000}
    doc["tenants"][1]["limit_caps"] = {}
    _apply(session, doc)
    events = len(_events(session))
    assert _apply(session, doc).empty
    assert _apply(session, doc).empty
    assert len(_events(session)) == events
    beta = session.scalars(select(Tenant).where(Tenant.slug == "beta")).one()
    assert (beta.limit_caps, beta.version) == (None, 1)
    doc["tenants"][1]["limit_caps"] = {"tpm_limit": 5}  # a real change is still one
    (change,) = _apply(session, doc).changes
    assert [(f.name, f.old, f.new) for f in change.fields] == [("limit_caps", None, {"tpm_limit": 5})]


def _with_rows_that_go_with_acme(session) -> int:  # type: ignore[no-untyped-def]
    from datetime import timedelta

    from tenants import UsageRow, keys, record_usage, responses

    _apply(session, FILE)
    acme = session.scalars(select(Tenant).where(Tenant.slug == "acme")).one()
    for name in ("ci", "prod"):
        keys.create_key(session, actor=ACTOR, now=now(), tenant="acme", pepper="pepper", name=name)
    minute = now().replace(second=0, microsecond=0)
    record_usage(session, flush_id="f", rows=[UsageRow(acme.id, minute + timedelta(minutes=m), 1, 1, 1)
                                              for m in range(3)])
    responses.store_response(session, tenant_id=acme.id, response_id="resp_1", previous_response_id=None,
                             model="m", input_items=[], output_items=[], body={}, now=now(), ttl=timedelta(days=1),
                             max_bytes=10**6)
    return int(acme.id)


def test_pruning_a_tenant_shows_what_goes_with_it(session) -> None:  # type: ignore[no-untyped-def]
    _with_rows_that_go_with_acme(session)
    trimmed = copy.deepcopy(FILE)
    trimmed["tenants"] = trimmed["tenants"][1:]
    dry = _apply(session, trimmed, prune=True, dry_run=True)
    lines = dry.render().splitlines()
    assert lines[:5] == ["- tenant acme", '    pool: "llama8b"', "    api_keys: 2", "    usage_minutes: 3",
                         "    stored_responses: 1"], lines
    (change,) = dry.changes
    assert {f.name: f.old for f in change.fields} == {"pool": "llama8b", "api_keys": 2, "usage_minutes": 3,
                                                      "stored_responses": 1}
    # beta has none: its counts are zeros, and a capture shows only when there is one.
    gone_too = copy.deepcopy(trimmed)
    gone_too["tenants"] = []
    plan = _apply(session, gone_too, prune=True, dry_run=True)
    beta = next(c for c in plan.changes if c.ref == "beta")
    assert [(f.name, f.old) for f in beta.fields] == [("pool", "llama8b"), ("api_keys", 0), ("usage_minutes", 0),
                                                      ("stored_responses", 0)]


def test_a_prune_never_leaves_a_tenant_admin_without_tenants(session) -> None:  # type: ignore[no-untyped-def]
    from tenants import admin_credentials

    _with_rows_that_go_with_acme(session)
    lone, _, _ = admin_credentials.create_credential(session, actor=ACTOR, now=now(), name="acme-admin",
                                                     role="tenant-admin", pepper="pepper", tenants=["acme"])
    both, _, _ = admin_credentials.create_credential(session, actor=ACTOR, now=now(), name="both-admin",
                                                     role="tenant-admin", pepper="pepper", tenants=["acme", "beta"])
    trimmed = copy.deepcopy(FILE)
    trimmed["tenants"] = trimmed["tenants"][1:]
    counts = _counts(session)
    for dry_run in (True, False):
        with pytest.raises(Conflict) as err:
            _apply(session, trimmed, prune=True, dry_run=dry_run)
        assert (err.value.code, err.value.field) == ("prune_orphans_credential", "tenants")
        assert "'acme-admin'" in err.value.message and "both-admin" not in err.value.message
        assert "revoke" in err.value.message
    assert _counts(session) == counts  # nothing written
    # Revoked, it no longer stands in the way; the one that keeps beta never did.
    admin_credentials.revoke_credential(session, actor=ACTOR, now=now(), credential_id=lone.id)
    plan = _apply(session, trimmed, prune=True)
    assert [(c.kind, c.action, c.ref) for c in plan.changes] == [("tenant", "delete", "acme")]
    assert admin_credentials.scope_of(session, both.id) == ["beta"]
