"""The gateways bench judges kv-aware behind several gateways by the families grid's own targets."""

from __future__ import annotations

from bench.routing import gateways


def row(family: str, one: tuple[float, float], two: tuple[float, float], previous_one: tuple[float, float],
        previous_two: tuple[float, float]) -> dict:
    out = {"family": family, "ceiling": 0.5}
    figures = {"kv-aware": one, gateways.label("kv-aware", 2): two, gateways.PREVIOUS: previous_one,
               gateways.label(gateways.PREVIOUS, 2): previous_two, "cache only": (0.5, 2.0), "session": (0.45, 1.2),
               "random": (0.3, 1.0), "round-robin": (0.3, 1.0), "dynamo": (0.35, 1.0)}
    for label, (hit, imbalance) in figures.items():
        out[label] = {"hit": hit, "imbalance": imbalance}
    return out


def test_the_section_counts_each_cost_at_one_and_at_n_gateways() -> None:
    rows = [
        # behind two gateways the defaults fall behind session (0.44 < 0.445); the previous defaults hold
        row("chat", (0.48, 1.05), (0.44, 1.10), (0.47, 1.05), (0.46, 1.20)),
        # behind two gateways the defaults pass 1.3 imbalance
        row("chat", (0.48, 1.05), (0.48, 1.35), (0.47, 1.05), (0.47, 1.05)),
        row("api", (0.48, 1.05), (0.49, 1.05), (0.40, 1.05), (0.40, 1.05)),
    ]
    body = gateways.section(rows, {"chat": "tune", "api": "report"}, 2, 1.0, 2)
    assert "| chat (tune) | 2 | 2 | 0 | 2 | 2 |" in body
    assert "| api (report) | 1 | 1 | 1 | 0 | 0 |" in body
    assert "| **total** | 3 | **3** | **1** | **2** | **2** |" in body
    # hit-rate change behind two gateways, in points: -4, 0, +1
    assert "| kv-aware | -4.0 / +0.0 / +1.0 | 1.05 → 1.35 | 0 → 1 |" in body
    assert "the defaults meet them in fewer settings on chat (0 vs 2) (defaults vs previous)" in body


def test_one_setting_replays_behind_two_gateways() -> None:
    from bench.routing import families

    gpu = families.gpu_blocks("chat", 200, 0.05)
    one = gateways.run_gateways({}, 1, "chat", 200, 2, gpu, 0, 1)
    two = gateways.run_gateways({}, 2, "chat", 200, 2, gpu, 0, 1)
    assert 0 < one["hit"] < 1 and 0 < two["hit"] < 1 and two != one
