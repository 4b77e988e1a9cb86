"""NVIDIA AIPerf (a load generator we did not write) against the live stack's chat endpoint."""

from __future__ import annotations

import secrets

import pytest

from bench.server.aiperf import metric, profile_command, run_profile, write_tokenizer_dir
from tests.server.gateway.stack import MODEL, Stack

pytestmark = pytest.mark.slow


def test_aiperf_profile_streams_a_fixed_output_length(stack: Stack, tmp_path) -> None:
    key = stack.add_tenant("ap-" + secrets.token_hex(4), rpm_limit=100000, tpm_limit=100000000)
    artifacts = tmp_path / "artifacts"
    command = profile_command(url=stack.gateway.base_url, key=key, tokenizer_dir=write_tokenizer_dir(tmp_path / "tok"),
                              artifacts=artifacts, requests=4, concurrency=2, input_tokens=24, output_tokens=8,
                              model=MODEL)
    export = run_profile(command, artifacts)
    assert metric(export, "request_count") == 4
    assert export.get("error_request_count") in (None, 0) or metric(export, "error_request_count") == 0
    # ignore_eos + min_tokens fixed every answer at 8 tokens, as AIPerf counts them with the model's tokenizer
    assert metric(export, "output_sequence_length", "min") == metric(export, "output_sequence_length", "max") == 8
    assert metric(export, "time_to_first_token") > 0 and metric(export, "inter_token_latency") > 0
