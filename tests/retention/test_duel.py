"""Policy duelling: the pool follows the candidate that wins on the shadows, with hysteresis."""

from __future__ import annotations

import random

import pytest

from retention.hashing import block_hashes
from retention.shadow.duel import DuelConfig, PolicyDuel
from retention.types import RetentionPlan, TokenRange

B = 4
KEEP = RetentionPlan((TokenRange(0, None, 90, None),), 35, None)
SINK = RetentionPlan((TokenRange(0, None, 0, None),), 35, None)
LRU = RetentionPlan()


def favour(tenant: str) -> RetentionPlan:
    """The 'favour-a' candidate: tenant a's blocks kept at 90, everyone else's sunk to 0."""
    return KEEP if tenant == "a" else SINK


def phase(rng: random.Random, reuser: str, flooder: str, requests: int, base: int):  # noqa: ANN201
    """``reuser`` cycles over 8 prompts of 3 blocks; ``flooder`` sends unique 6-block prompts, 2 per reuse."""
    prompts = [[base + 1000 * p + k for k in range(3 * B)] for p in range(8)]
    unique = base + 100_000
    for _ in range(requests // 3):
        yield reuser, prompts[rng.randrange(8)] + [7]
        for _ in range(2):
            yield flooder, list(range(unique, unique + 6 * B)) + [7]
            unique += 6 * B


def run(duel: PolicyDuel, traffic, now: float) -> tuple[float, list[str]]:  # noqa: ANN001
    chosen = []
    for tenant, tokens in traffic:
        hashes = block_hashes(tokens, B)
        kept = duel.kept(hashes)
        chosen.append(duel.chosen(None))
        duel.record(hashes, kept, [LRU, favour(tenant)], now=now, num_tokens=len(tokens), tokens_per_block=B,
                    tenant=None)
        now += 1.0
    return now, chosen


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_the_pool_switches_when_the_winner_changes_and_back(rate: float) -> None:
    """Phase 1: tenant a reuses, b floods → favouring a wins. Phase 2: roles swap → LRU wins again."""
    duel = PolicyDuel(("lru", "favour-a"), primary_blocks=40, config=DuelConfig(rate=rate, half_life_refs=300,
                                                                               min_refs=100, patience=30))
    rng = random.Random(0)
    now, first = run(duel, phase(rng, "a", "b", 900, 0), 0.0)
    assert first[0] == "lru"  # the incumbent until another candidate proves itself
    assert first[-1] == "favour-a" and duel.switches() == 1
    standings = duel.standings()
    assert standings["favour-a"] > standings["lru"] + 0.1
    _, second = run(duel, phase(rng, "b", "a", 900, 10_000_000), now)
    assert second[-1] == "lru" and duel.switches() == 2
    # Hysteresis: one switch per change of character, no flapping in between.
    flips = sum(1 for x, y in zip(first + second, (first + second)[1:]) if x != y)
    assert flips == 2


def test_no_switch_without_a_clear_margin() -> None:
    """Two candidates with identical plans tie forever: the incumbent stays."""
    duel = PolicyDuel(("static", "same"), primary_blocks=40, config=DuelConfig(rate=1.0, min_refs=10, patience=5))
    rng = random.Random(1)
    run_traffic = [(t, tok) for t, tok in phase(rng, "a", "b", 600, 0)]
    for tenant, tokens in run_traffic:
        hashes = block_hashes(tokens, B)
        duel.record(hashes, duel.kept(hashes), [LRU, LRU], now=0.0, num_tokens=len(tokens), tokens_per_block=B)
    assert duel.chosen() == "static" and duel.switches() == 0


def test_a_tenants_own_winner_is_not_followed_when_the_mix_earns_nothing() -> None:
    cfg = DuelConfig(rate=1.0, half_life_refs=300, min_refs=100, patience=30, tenant_min_refs=50)
    duel = PolicyDuel(("lru", "favour-a"), primary_blocks=40, config=cfg)
    rng = random.Random(2)
    for tenant, tokens in phase(rng, "a", "b", 900, 0):
        hashes = block_hashes(tokens, B)
        duel.record(hashes, duel.kept(hashes), [LRU, favour(tenant)], now=0.0, num_tokens=len(tokens),
                    tokens_per_block=B, tenant=tenant)
    assert duel.chosen("a") == "favour-a" == duel.chosen()
    # b never hits under either candidate (its prompts are unique): no margin, its own scope stays where the
    # pool was when it gathered enough evidence (lru) ...
    assert duel.tenants["b"].refs >= cfg.tenant_min_refs and duel.names[duel.tenants["b"].current] == "lru"
    assert duel.standings("b") == {"lru": 0.0, "favour-a": 0.0}
    # ... but the mix (b on lru) earns the pool nothing over the pool's choice, so b follows the pool.
    assert not duel.tenants_follow_own()
    assert duel.chosen("b") == "favour-a" and duel.chosen("new") == "favour-a"


def keep_only(owner: str):  # noqa: ANN201
    """A candidate keeping ``owner``'s blocks at 90 and sinking everyone else's to 0."""
    return lambda tenant: KEEP if tenant == owner else SINK


def test_tenants_follow_their_own_winners_while_the_mix_beats_the_pools_choice() -> None:
    """a and b each reuse 24 blocks, f floods; the pool (60 blocks) fits a and b together. Everyone on
    keep-a (or keep-b) loses b's (a's) reuse to the flood; a on keep-a and b on keep-b keep both: the mix
    shadow proves it and the tenants follow their own winners."""
    cfg = DuelConfig(rate=1.0, half_life_refs=300, min_refs=100, patience=30, tenant_min_refs=50)
    candidates = {"keep-a": keep_only("a"), "keep-b": keep_only("b")}
    duel = PolicyDuel(tuple(candidates), primary_blocks=60, config=cfg)
    rng = random.Random(3)
    a_prompts = [[1000 * p + k for k in range(3 * B)] for p in range(8)]
    b_prompts = [[500_000 + 1000 * p + k for k in range(3 * B)] for p in range(8)]
    unique, now = 900_000, 0.0
    traffic = []
    for _ in range(700):
        traffic += [("a", rng.choice(a_prompts) + [7]), ("b", rng.choice(b_prompts) + [7])]
        for _ in range(2):
            traffic.append(("f", list(range(unique, unique + 6 * B)) + [7]))
            unique += 6 * B
    for tenant, tokens in traffic:
        hashes = block_hashes(tokens, B)
        duel.record(hashes, duel.kept(hashes), [make(tenant) for make in candidates.values()], now=now,
                    num_tokens=len(tokens), tokens_per_block=B, tenant=tenant)
        now += 1.0
    assert duel.tenants_follow_own()
    assert (duel.chosen("a"), duel.chosen("b")) == ("keep-a", "keep-b")


@pytest.mark.parametrize("per_tenant", [True, False])
def test_the_mix_shadow_runs_only_with_per_tenant_selection_and_two_tenants(per_tenant: bool) -> None:
    duel = PolicyDuel(("lru", "favour-a"), primary_blocks=40, config=DuelConfig(rate=1.0, per_tenant=per_tenant))
    for tenant, tokens in phase(random.Random(4), "a", "b", 30, 0):
        hashes = block_hashes(tokens, B)
        if tenant == "b" and duel.mix is None:
            assert duel.tenants.keys() <= {"a"}  # one tenant so far: its mix is the pool's choice, no shadow
        duel.record(hashes, duel.kept(hashes), [LRU, favour(tenant)], now=0.0, num_tokens=len(tokens),
                    tokens_per_block=B, tenant=tenant)
    assert (duel.mix is not None) == per_tenant and not duel.tenants_follow_own()


def test_record_checks_its_inputs() -> None:
    duel = PolicyDuel(("a", "b"), primary_blocks=8, config=DuelConfig(rate=1.0))
    hashes = block_hashes(list(range(3 * B)), B)
    with pytest.raises(ValueError):
        duel.record(hashes, duel.kept(hashes), [LRU], now=0.0, num_tokens=3 * B, tokens_per_block=B)
    with pytest.raises(ValueError):
        PolicyDuel(("a", "a"), primary_blocks=8)
    with pytest.raises(ValueError):
        DuelConfig(half_life_refs=0)
