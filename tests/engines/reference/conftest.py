"""Fixtures for the reference engine: the model is loaded once per session.

Servers run in a background thread with their own event loop, so synchronous
``tritonclient.grpc`` clients and ``tritonclient.grpc.aio`` clients (in each test's own
loop) both talk to them over real TCP, exactly as the gateway and Triton clients do.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from engines.reference.config import ReferenceEngineConfig
from engines.reference.loader import ModelBundle, load_model
from engines.reference.server import RunningServer, start_reference_server


@dataclass
class ServerHandle:
    running: RunningServer
    loop: asyncio.AbstractEventLoop

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def engine(self):
        return self.running.engine


def start_in_thread(config: ReferenceEngineConfig, bundle: ModelBundle) -> tuple[ServerHandle, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="reference-server-loop", daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(start_reference_server(config, port=0, bundle=bundle), loop).result(60)
    return ServerHandle(running, loop), thread


def stop_in_thread(handle: ServerHandle, thread: threading.Thread) -> None:
    asyncio.run_coroutine_threadsafe(handle.running.stop(grace=0.5), handle.loop).result(60)
    handle.loop.call_soon_threadsafe(handle.loop.stop)
    thread.join(10)
    handle.loop.close()


@pytest.fixture(scope="session")
def bundle() -> ModelBundle:
    torch.set_num_threads(1)
    return load_model()


@pytest.fixture(scope="session")
def tokenizer(bundle):
    return bundle.tokenizer


# Small pools so that eviction/offload tests need little prefill; limits sized to fit.
FP8_CONFIG = dict(
    kv_dtype="fp8_e4m3", primary_blocks=40, secondary_blocks=64, tokens_per_block=32,
    max_batch_size=16, max_num_tokens=256, max_input_len=640, max_output_len=64,
)


@pytest.fixture(scope="session")
def fp8_server(bundle) -> Iterator[ServerHandle]:
    handle, thread = start_in_thread(ReferenceEngineConfig(**FP8_CONFIG), bundle)
    yield handle
    stop_in_thread(handle, thread)


@pytest.fixture(scope="session")
def fp32_server(bundle) -> Iterator[ServerHandle]:
    handle, thread = start_in_thread(ReferenceEngineConfig(**{**FP8_CONFIG, "kv_dtype": "fp32"}), bundle)
    yield handle
    stop_in_thread(handle, thread)
