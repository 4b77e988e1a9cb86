"""Hints in traces and in the simulator: the format, ``<policy>+hints``, the class's rules and budget."""

from __future__ import annotations

import json

import pytest

from retention.policy.hints import TTL_1H_MS, Breakpoint, CacheHints
from retention.simulation.sim_policies import ClassMapping, ClassMappingError, make_policy
from retention.simulation.simulator import SimConfig, simulate
from retention.trace import TraceError, hint_fields, parse_trace
from retention.workloads.agent_hinted import HintedAgentSpec, hinted_agent_trace, strip_hints
from retention.workloads.agent import AgentSpec

BS = 16


def line(at: float, ids: list[int], tenant: str, **extra) -> str:  # type: ignore[no-untyped-def]
    return json.dumps({"timestamp": at, "input_length": len(ids) * BS, "output_length": 1, "hash_ids": ids,
                       "tenant": tenant, **extra})


def test_trace_lines_carry_breakpoints_and_retention_and_write_them_back() -> None:
    (req,) = parse_trace([line(0, [1, 2, 3], "a", cache_breakpoints=[[16, 3_600_000], [48, 300_000]],
                               prompt_cache_retention="24h")], block_size=BS)
    assert req.hints == CacheHints((Breakpoint(16, 3_600_000), Breakpoint(48, 300_000)), retention="24h")
    assert hint_fields(req.hints) == {"cache_breakpoints": [[16, 3_600_000], [48, 300_000]],
                                      "prompt_cache_retention": "24h"}
    assert parse_trace([line(0, [1], "a")], block_size=BS)[0].hints is None and hint_fields(None) == {}


@pytest.mark.parametrize("extra,message", [
    ({"cache_breakpoints": [[64, 1000]]}, "past input_length"),
    ({"cache_breakpoints": [[16, 0]]}, "ttl_ms"),
    ({"cache_breakpoints": [[32, 1], [16, 1]]}, "increasing"),
    ({"cache_breakpoints": [16, 1]}, "pairs"),
    ({"prompt_cache_retention": "forever"}, "retention"),
])
def test_bad_hint_fields_name_the_line(extra, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TraceError, match=message) as err:
        parse_trace([line(0, [1, 2, 3], "a", **extra)], block_size=BS)
    assert "line 1" in str(err.value)


def flood_trace(*, hinted: bool) -> list:
    """Tenant a's 4-block prefix, then b floods 3 unique 4-block prompts, then a again."""
    hint = {"cache_breakpoints": [[4 * BS, TTL_1H_MS]]} if hinted else {}
    lines = [line(0, [1, 2, 3, 4], "a", **hint)]
    lines += [line(1000 * (k + 1), [100 + 4 * k + j for j in range(4)], "b") for k in range(3)]
    lines.append(line(10_000, [1, 2, 3, 4], "a", **hint))
    return parse_trace(lines, block_size=BS)


CONFIG = SimConfig(tokens_per_block=BS, trace_block_size=BS)


def test_a_hinted_prefix_survives_a_flood_that_evicts_it_without_hints() -> None:
    plain = simulate(flood_trace(hinted=True), make_policy("lru"), primary_blocks=8, secondary_blocks=0, config=CONFIG)
    hinted = simulate(flood_trace(hinted=True), make_policy("lru+hints"), primary_blocks=8, secondary_blocks=0,
                      config=CONFIG)
    assert plain.tenants["a"].gpu_hit_tokens == 0
    # The whole prompt is kept; the last block is computed again (at least one prompt token is always prefilled).
    assert hinted.tenants["a"].gpu_hit_tokens == 3 * BS
    assert hinted.policy == "lru+hints"


def test_the_hint_budget_bounds_what_a_tenant_keeps() -> None:
    mapping = ClassMapping.from_dict({
        "default": "c", "quotas": {"a": 0.5},
        "classes": {"c": {"system": {"priority": 35}, "context": {"priority": 35}, "turn": {"priority": 35},
                          "decode": {"priority": 35},
                          "hints": {"max_priority": 60, "quota_fraction": 0.5}}},  # 0.5 × 0.5 × 8 = 2 blocks
    })
    policy = make_policy("lru+hints", mapping=mapping, block_size=BS)
    result = simulate(flood_trace(hinted=True), policy, primary_blocks=8, secondary_blocks=0, config=CONFIG)
    assert result.tenants["a"].gpu_hit_tokens == 2 * BS  # only the budget's two leading blocks were kept
    assert policy.clipped_requests == 2


def test_a_class_without_hints_and_stripped_lines_replay_exactly_as_the_policy_alone() -> None:
    spec = HintedAgentSpec(agent=AgentSpec(duration_s=120.0, tenant="agents", block_size=BS), background_per_s=0.5)
    lines = hinted_agent_trace(spec, seed=3)
    assert any("cache_breakpoints" in x for x in lines) and any(x.get("tenant") == "batch" for x in lines)
    hinted = parse_trace([json.dumps(x) for x in lines], block_size=BS)
    stripped = parse_trace([json.dumps(x) for x in strip_hints(lines)], block_size=BS)
    kw = dict(primary_blocks=40, secondary_blocks=0, config=CONFIG)
    base = simulate(hinted, make_policy("trtllm-default"), **kw)
    assert simulate(stripped, make_policy("trtllm-default+hints"), **kw).gpu_hit_tokens == base.gpu_hit_tokens
    off = ClassMapping.from_dict({"classes": {"c": {s: {"priority": 35} for s in ("system", "context", "turn", "decode")}}})
    assert simulate(hinted, make_policy("class+hints", mapping=off, block_size=BS), **kw).gpu_hit_tokens == \
        simulate(hinted, make_policy("class", mapping=off, block_size=BS), **kw).gpu_hit_tokens


def test_class_mapping_hint_rules_are_validated() -> None:
    with pytest.raises(ClassMappingError, match="hints"):
        ClassMapping.from_dict({"classes": {"c": {**{s: {"priority": 35} for s in ("system", "context", "turn",
                                                                                   "decode")},
                                                  "hints": {"max_priority": 101}}}})
