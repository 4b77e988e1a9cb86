"""`kvgate engine serve` as a real process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import tritonclient.grpc as grpcclient

from tests.engines.reference.helpers import MODEL

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_engine_serve_starts_answers_and_stops_on_sigint():
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "engine", "serve", "--port", str(port), "--kv-dtype", "fp8_e5m2",
         "--primary-blocks", "64", "--secondary-blocks", "0", "--max-input-len", "512", "--max-output-len", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if client.is_model_ready(MODEL):
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.3)
        assert client.get_model_config(MODEL).config.parameters["max_output_len"].string_value == "64"
    finally:
        client.close()
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "serving model kvgate_llm" in output


def test_engine_serve_rejects_a_bad_setting():
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "engine", "serve", "--kv-dtype", "int4"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "kv_dtype" in result.stderr + result.stdout
