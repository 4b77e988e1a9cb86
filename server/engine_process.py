"""Runs the CPU reference engine as a child process of ``kvgate serve``.

The engine is a separate process (as it is in compose), so a crashed engine never takes
the gateway with it and the gateway's reconnect path is the one production uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable


class EngineStartError(RuntimeError):
    pass


def start_engine(args: list[str], *, port: int, timeout: float = 180.0,
                 progress: Callable[[str], None] = lambda _: None) -> subprocess.Popen:
    """Start ``kvgate engine serve ARGS`` and wait until its model is ready."""
    import tritonclient.grpc as grpcclient

    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "engine", "serve", *args], env=dict(os.environ))
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    progress(f"starting the reference engine on 127.0.0.1:{port} (loading SmolLM2-135M)...")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineStartError(f"the reference engine exited with code {proc.returncode} (is port {port} free?)")
        try:
            if client.is_model_ready("kvgate_llm"):
                progress("reference engine ready")
                return proc
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.25)
    proc.terminate()
    raise EngineStartError(f"the reference engine was not ready after {timeout:.0f}s")


def stop_engine(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
