"""``Prompts``: a trace's prompts and block hashes made once, shared by every replay, results unchanged."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import retention.simulation.simulator as simulator
from retention.hashing import block_hashes
from retention.simulation.cluster_sim import ClusterConfig, compare_routers, simulate_cluster
from retention.simulation.sim_policies import make_policy
from retention.simulation.simulator import Prompts, SimConfig, request_hashes, simulate
from retention.trace import parse_trace, request_tokens
from retention.workloads import NoisyNeighbourSpec, noisy_neighbour_trace

BS = 16
CFG = SimConfig(tokens_per_block=BS, trace_block_size=BS, hold="tokens", prefill_tokens_per_s=400.0,
                decode_tokens_per_s=8.0)


@pytest.fixture(scope="module")
def chat():
    spec = NoisyNeighbourSpec(duration_s=120, block_size=BS, system_blocks=4, turns=5, premium_rps=2.0,
                              turn_gap_s=5.0, flood_factor=1.0, noisy_blocks=12, output_tokens=16)
    return parse_trace([json.dumps(x) for x in noisy_neighbour_trace(spec, seed=3)], block_size=BS)


def test_prompts_are_the_requests_tokens_and_the_pools_hashes(chat) -> None:
    salted = dataclasses.replace(CFG, salted=True)
    prompts = Prompts(chat, salted)
    for request in chat[:50]:
        tokens, hashes = prompts.get(request)
        assert np.array_equal(tokens, request_tokens(request, BS))
        assert hashes == block_hashes(tokens, BS, salt=request.tenant)
    assert prompts.hashes(chat) == request_hashes(chat, salted)
    # a request it was not built with is made afresh, even under a known index
    stranger = dataclasses.replace(chat[0], hash_ids=chat[1].hash_ids, input_length=chat[1].input_length)
    assert np.array_equal(prompts.get(stranger)[0], request_tokens(chat[1], BS))


def test_replays_are_the_same_whether_prompts_are_kept_or_not(chat, monkeypatch: pytest.MonkeyPatch) -> None:
    def run() -> tuple:
        single = simulate(chat, make_policy("trtllm-default"), primary_blocks=72, secondary_blocks=144, config=CFG)
        cluster = simulate_cluster(chat, lambda: make_policy("trtllm-default"), cluster=ClusterConfig(3, "kv-aware"),
                                   primary_blocks=24, secondary_blocks=48, config=CFG)
        return single.to_dict(), cluster.to_dict()

    kept = run()
    monkeypatch.setattr(simulator, "KEEP_PROMPT_TOKENS", 0)  # tokens made again at every admission attempt
    assert run() == kept


def test_compare_routers_shares_prompts_without_changing_a_result(chat) -> None:
    routers = [ClusterConfig(3, "round-robin"), ClusterConfig(3, "kv-aware")]
    report = compare_routers(chat, lambda: make_policy("lru"), routers, primary_blocks=24, secondary_blocks=0,
                             config=CFG)
    for cluster in routers:
        alone = simulate_cluster(chat, lambda: make_policy("lru"), cluster=cluster, primary_blocks=24,
                                 secondary_blocks=0, config=CFG)
        assert report.results[cluster.router].to_dict() == alone.to_dict()
    ceiling = simulate(chat, make_policy("lru"), primary_blocks=72, secondary_blocks=0, config=CFG)
    assert report.ceiling.to_dict() == ceiling.to_dict()
