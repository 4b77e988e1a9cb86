"""One real stack (engine process + gateway over HTTP + SQLite registry) for the gateway tests."""

from __future__ import annotations

import pytest

from tests.server.gateway.stack import Stack, build_stack

TOKENS_PER_BLOCK = 16
ENGINE_ARGS = ["--tokens-per-block", str(TOKENS_PER_BLOCK), "--primary-blocks", "256", "--secondary-blocks", "512",
               "--max-input-len", "2048", "--max-output-len", "256", "--max-batch-size", "8"]


@pytest.fixture(scope="session")
def bundle():
    """The reference model, loaded once for the in-process engine fleets (tests/server/gateway/fleet.py)."""
    import torch

    from engines.reference.loader import load_model

    torch.set_num_threads(1)
    return load_model()


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    built = build_stack(tmp_path_factory.mktemp("stack"), engine_args=ENGINE_ARGS, tokens_per_block=TOKENS_PER_BLOCK,
                        primary=256, secondary=512,
                        # every block in the miss-ratio curves' shadows: exact figures to check
                        settings={"mrc_sample_rate": 1.0})
    yield built
    built.gateway.stop()
    built.engine.kill()
