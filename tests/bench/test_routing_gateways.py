"""The gateways bench judges kv-aware behind several gateways, alone and synced, by the families grid's own targets."""

from __future__ import annotations

from bench.routing import gateways

FAST, SLOW = gateways.SYNC_DELAYS


def row(family: str, one: tuple[float, float], two: tuple[float, float], fast: tuple[float, float],
        slow: tuple[float, float]) -> dict:
    out = {"family": family, "ceiling": 0.5}
    figures = {"kv-aware": one, gateways.label("kv-aware", 2): two, gateways.label("kv-aware", 2, FAST): fast,
               gateways.label("kv-aware", 2, SLOW): slow, "cache only": (0.5, 2.0), "session": (0.45, 1.2),
               "random": (0.3, 1.0), "round-robin": (0.3, 1.0), "dynamo": (0.35, 1.0)}
    for label, (hit, imbalance) in figures.items():
        out[label] = {"hit": hit, "imbalance": imbalance}
    return out


def test_the_section_counts_one_gateway_alone_and_synced() -> None:
    rows = [
        # alone the defaults fall behind session (0.44 < 0.445); synced they hold, late by a second they do not
        row("chat", (0.48, 1.05), (0.44, 1.10), (0.48, 1.05), (0.44, 1.05)),
        # alone the defaults pass 1.3 imbalance; synced both hold
        row("chat", (0.48, 1.05), (0.48, 1.35), (0.47, 1.05), (0.47, 1.20)),
        row("api", (0.48, 1.05), (0.49, 1.05), (0.49, 1.05), (0.40, 1.05)),
    ]
    lag = [0.0004] * 98 + [0.005, 0.012]
    body = gateways.section(rows, {"chat": "tune", "api": "report"}, 2, 1.0, 2, lag, "redis://x")
    assert "| kv-aware, 1 gateway | kv-aware, 2 gateways | kv-aware, 2 gateways, synced (10 ms) | " \
           "kv-aware, 2 gateways, synced (1 s) |" in body
    assert "| chat (tune) | 2 | 2 | 0 | 2 | 1 |" in body
    assert "| api (report) | 1 | 1 | 1 | 1 | 0 |" in body
    assert "| **total** | 3 | **3** | **1** | **3** | **1** |" in body
    # hit-rate change behind two gateways alone, in points: -4, 0, +1
    assert "| kv-aware, 2 gateways | -4.0 / +0.0 / +1.0 | 1.05 → 1.35 | 0 → 1 |" in body
    assert "alone and in 3 synced at 10 ms, 1 synced at 1 s, against 3 behind one gateway" in body
    assert "(100 of 2,000 dispatch notices of 64 block hashes arrived" in body
    assert "median 0.40 ms, p99 5.00 ms, max 12.00 ms" in body
    unmeasured = gateways.section(rows, {"chat": "tune", "api": "report"}, 2, 1.0, 2, None, "redis://x")
    assert "not measured: no Redis answered at `redis://x`" in unmeasured


def test_one_setting_replays_behind_two_gateways_alone_and_synced() -> None:
    from bench.routing import families

    gpu = families.gpu_blocks("chat", 200, 0.05)
    one = gateways.run_gateways({}, 1, "chat", 200, 2, gpu, 0, 1)
    two = gateways.run_gateways({}, 2, "chat", 200, 2, gpu, 0, 1)
    synced = gateways.run_gateways({}, 2, "chat", 200, 2, gpu, 0, 1, 0.0)
    assert 0 < one["hit"] < 1 and 0 < two["hit"] < 1 and two != one
    assert synced == one  # synced with no delay, two gateways route as one


def test_the_sync_delay_is_measured_through_a_real_redis() -> None:
    lag = gateways.sync_lag("redis://127.0.0.1:6379/0", notices=200)
    assert lag is not None and len(lag) == 200 and lag == sorted(lag) and lag[0] > 0
    assert gateways.sync_lag("redis://127.0.0.1:1/0", notices=10) is None
