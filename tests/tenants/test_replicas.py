"""Pool replicas against a real registry: creation forms, validation, state changes, the
keep-one rule (also under a real race), audit events, and the gateway's snapshot."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import event, func, select

from tenants import list_pool_snapshots, pools, replicas
from tenants.errors import Conflict, Duplicate, InvalidField, NotFound, StaleVersion
from tenants.models import AuditEvent, PoolReplica
from tests.tenants.factories import ACTOR, make_pool, now


def _events(session, action: str | None = None) -> list[AuditEvent]:  # type: ignore[no-untyped-def]
    stmt = select(AuditEvent).order_by(AuditEvent.id)
    if action is not None:
        stmt = stmt.where(AuditEvent.action == action)
    return list(session.scalars(stmt))


def _two_replica_pool(session):  # type: ignore[no-untyped-def]
    return make_pool(
        session,
        replicas=[{"name": "r0", "endpoint": "engine-0:8001"}, {"name": "r1", "endpoint": "engine-1:8001", "weight": 3}],
    )


def test_legacy_triton_url_means_one_active_replica_r0(session) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(session)
    assert [(r.name, r.endpoint, r.state, r.weight) for r in pool.replicas] == [("r0", "127.0.0.1:8001", "active", 1)]
    assert pool.triton_url == "127.0.0.1:8001"
    (created,) = _events(session, "pool.create")
    assert created.after["replicas"][0]["endpoint"] == "127.0.0.1:8001"


def test_pool_with_replicas_and_its_snapshot(session) -> None:  # type: ignore[no-untyped-def]
    _two_replica_pool(session)
    replicas.drain_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r0")
    (snap,) = list_pool_snapshots(session)
    assert [(r.name, r.endpoint, r.state, r.weight) for r in snap.replicas] == [
        ("r0", "engine-0:8001", "draining", 1),
        ("r1", "engine-1:8001", "active", 3),
    ]
    assert snap.replicas[0].id < snap.replicas[1].id
    # The legacy single endpoint is the first *active* replica's.
    assert snap.triton_url == "engine-1:8001" and [r.name for r in snap.active_replicas] == ["r1"]
    replicas.disable_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1")
    (snap,) = list_pool_snapshots(session)
    assert snap.active_replicas == () and snap.triton_url == "engine-0:8001"  # none active: the first


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"triton_url": None}, "replicas"),  # neither
        ({"triton_url": "h:1", "replicas": [{"name": "r0", "endpoint": "h:1"}]}, "replicas"),  # both
        ({"triton_url": None, "replicas": []}, "replicas"),
        ({"triton_url": "no-port"}, "triton_url"),
        ({"triton_url": None, "replicas": [{"name": "r0", "endpoint": "h:70000"}]}, "replicas.0.endpoint"),
        ({"triton_url": None, "replicas": [{"name": "R 0", "endpoint": "h:1"}]}, "replicas.0.name"),
        ({"triton_url": None, "replicas": [{"name": "r0"}]}, "replicas.0.endpoint"),
        ({"triton_url": None, "replicas": [{"name": "r0", "endpoint": "h:1", "weight": 0}]}, "replicas.0.weight"),
        ({"triton_url": None, "replicas": [{"name": "r0", "endpoint": "h:1", "state": "up"}]}, "replicas.0.state"),
        ({"triton_url": None, "replicas": [{"name": "r0", "endpoint": "h:1", "port": 1}]}, "replicas.0.port"),
        (
            {"triton_url": None, "replicas": [{"name": "r0", "endpoint": "h:1"}, {"name": "r0", "endpoint": "h:2"}]},
            "replicas.1.name",
        ),
    ],
)
def test_pool_replica_validation_names_the_field(session, kwargs, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidField) as err:
        make_pool(session, **kwargs)
    assert err.value.field == field
    assert _events(session) == []
    assert session.scalar(select(func.count()).select_from(PoolReplica)) == 0


def test_add_update_state_changes_and_remove_are_audited(session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    r1 = replicas.add_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1", endpoint="[::1]:8002")
    assert (r1.state, r1.weight, r1.version) == ("active", 1, 1)
    with pytest.raises(Duplicate):
        replicas.add_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1", endpoint="h:1")
    with pytest.raises(NotFound):
        replicas.add_replica(session, actor=ACTOR, now=now(), pool="nope", name="r2", endpoint="h:1")
    r1 = replicas.update_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1", version=1,
                                 changes={"weight": 4, "endpoint": "engine-1:8002"})
    assert (r1.weight, r1.endpoint, r1.version) == (4, "engine-1:8002", 2)
    with pytest.raises(StaleVersion):
        replicas.update_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1", version=1,
                                changes={"weight": 5})
    with pytest.raises(InvalidField) as err:
        replicas.update_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1", version=2,
                                changes={"name": "r9"})
    assert err.value.field == "name"
    replicas.drain_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1")
    replicas.drain_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1")  # no-op, no event
    replicas.disable_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1")
    replicas.activate_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r1", version=4)
    with pytest.raises(NotFound) as missing:
        replicas.drain_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r7")
    assert missing.value.code == "replica_not_found"
    replicas.remove_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r0")
    assert [r.name for r in replicas.list_replicas(session, pool="gpu-a")] == ["r1"]
    assert pools.get_pool(session, ref="gpu-a").triton_url == "engine-1:8002"
    actions = [(e.action, e.entity_type, e.actor) for e in _events(session)]
    assert [a for a, _, _ in actions] == [
        "pool.create",
        "pool_replica.create",
        "pool_replica.update",
        "pool_replica.drain",
        "pool_replica.disable",
        "pool_replica.activate",
        "pool_replica.delete",
    ]
    assert all(t in ("pool", "pool_replica") and actor == ACTOR for _, t, actor in actions)
    drain = _events(session, "pool_replica.drain")[0]
    assert (drain.before["state"], drain.after["state"]) == ("active", "draining")


def test_the_last_replica_cannot_be_removed(session) -> None:  # type: ignore[no-untyped-def]
    make_pool(session)
    before = len(_events(session))
    with pytest.raises(Conflict) as err:
        replicas.remove_replica(session, actor=ACTOR, now=now(), pool="gpu-a", name="r0")
    assert err.value.code == "last_replica" and "last replica" in err.value.message
    assert [r.name for r in replicas.list_replicas(session, pool="gpu-a")] == ["r0"]
    assert len(_events(session)) == before


def test_pool_update_rejects_triton_url_and_delete_cascades(session) -> None:  # type: ignore[no-untyped-def]
    _two_replica_pool(session)
    with pytest.raises(InvalidField) as err:
        pools.update_pool(session, actor=ACTOR, now=now(), ref="gpu-a", version=1, changes={"triton_url": "h:2"})
    assert err.value.field == "triton_url"
    pools.delete_pool(session, actor=ACTOR, now=now(), ref="gpu-a")
    assert session.scalar(select(func.count()).select_from(PoolReplica)) == 0
    (deleted,) = _events(session, "pool.delete")
    assert [r["name"] for r in deleted.before["replicas"]] == ["r0", "r1"]


def test_two_concurrent_removals_keep_one_replica(db) -> None:  # type: ignore[no-untyped-def]
    """Each thread removes a different replica of a two-replica pool at the same moment:
    exactly one succeeds, the other gets ``last_replica``, one replica is left."""
    with db.factory() as s:
        _two_replica_pool(s)
    barrier = threading.Barrier(2, timeout=20)
    # Hold both right before their first write-path statement (FOR UPDATE on PostgreSQL, the
    # DELETE on SQLite), after both have read the pool and its replicas.
    marker = "FOR UPDATE" if db.backend == "postgresql" else "DELETE FROM POOL_REPLICAS"

    def hold(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if marker in statement.upper():
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass

    event.listen(db.engine, "before_cursor_execute", hold)
    outcomes: dict[str, str] = {}

    def worker(name: str) -> None:
        try:
            with db.factory() as s:
                replicas.remove_replica(s, actor=ACTOR, now=now(), pool="gpu-a", name=name)
            outcomes[name] = "removed"
        except Conflict as exc:
            outcomes[name] = exc.code

    try:
        threads = [threading.Thread(target=worker, args=(n,)) for n in ("r0", "r1")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        event.remove(db.engine, "before_cursor_execute", hold)
    assert sorted(outcomes.values()) == ["last_replica", "removed"]
    with db.factory() as s:
        assert s.scalar(select(func.count()).select_from(PoolReplica)) == 1
