"""The LiteLLM bench's profile section: before / after side by side, one frame per cell."""

from __future__ import annotations

from bench.gateway_litellm import render_profile


def test_before_and_after_tops_render_side_by_side() -> None:
    tops = {"before": [(17.1, "A.f (a.py:1)"), (9.0, "B.g (b.py:2)")], "after": [(12.5, "A.f (a.py:1)")]}
    text = render_profile(40, tops, n=2)
    lines = text.splitlines()
    assert lines[0].startswith("## Gateway hot path") and "--baseline DIR" in lines[0]
    rows = [line for line in lines if line.startswith("| ") and "%" in line]
    assert rows[0] == "| 17.1 % | `A.f (a.py:1)` | 12.5 % | `A.f (a.py:1)` |"
    assert rows[1] == "| 9.0 % | `B.g (b.py:2)` |  |  |"  # after has no second frame
    assert "*before*" in text


def test_one_gateway_alone_has_one_pair_of_columns() -> None:
    text = render_profile(30, {"after": [(5.0, "F (f.py:3)")]}, n=1)
    assert "--baseline" not in text.splitlines()[0] and "| after: share | frame |" in text
