"""NVIDIA AIPerf against kvgate's chat endpoint: the load generator other stacks are measured with.

AIPerf is a CLI with its own dependency pins (older ``huggingface_hub``, ``rich`` and
``prometheus_client`` than kvgate's), so it lives in its own virtualenv, ``.venv-aiperf``
(``make setup`` creates it from ``requirements-aiperf.lock``); ``KVGATE_AIPERF`` overrides
the executable. Nothing is downloaded at run time: AIPerf counts tokens with SmolLM2's own
tokenizer, written from the GGUF into a local directory (``--tokenizer PATH``).

    python bench/server/aiperf.py [--requests 24] [--concurrency 4] [--no-write]

runs the reference engine and ``kvgate serve`` in child processes, then ``aiperf profile``
(chat, streaming, fixed output length through ``ignore_eos`` + ``min_tokens``), and writes
its figures to the ``bench:aiperf`` section of docs/benchmarks.md. The test
(tests/server/gateway/test_aiperf.py) runs the same command with a small request count.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, publish, seed_line  # noqa: E402
from bench.server.gateway_load import free_port, wait_http  # noqa: E402
from bench.server.overhead import seed_registry  # noqa: E402
from engines.tokenizer import load_gguf_tokenizer  # noqa: E402

MODEL = "smollm2-135m-instruct"
SEED = 7  # AIPerf --random-seed: its synthetic prompts


def aiperf_executable() -> Path:
    path = Path(os.environ.get("KVGATE_AIPERF", ROOT / ".venv-aiperf" / "bin" / "aiperf"))
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make test` or `make bench` (they create .venv-aiperf) or set KVGATE_AIPERF")
    return path


def write_tokenizer_dir(path: Path) -> Path:
    """SmolLM2's tokenizer as a Hugging Face directory (tokenizer.json + config), from the GGUF."""
    tokenizer = load_gguf_tokenizer()
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer.tokenizer.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token, "chat_template": tokenizer.chat_template, "model_max_length": 8192,
    }))
    return path


def profile_command(*, url: str, key: str, tokenizer_dir: Path, artifacts: Path, requests: int, concurrency: int,
                    input_tokens: int, output_tokens: int, model: str = MODEL) -> list[str]:
    """``aiperf profile``: chat endpoint, streaming, fixed input and output lengths."""
    return [
        str(aiperf_executable()), "profile",
        "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming", "--api-key", key,
        "--tokenizer", str(tokenizer_dir),
        "--request-count", str(requests), "--concurrency", str(concurrency),
        "--prompt-input-tokens-mean", str(input_tokens), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(output_tokens), "--prompt-output-tokens-stddev", "0",
        # what fixes the output length on vLLM-compatible servers; kvgate honours both
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{output_tokens}",
        # token counts from the server's usage, per chunk (stream_options.continuous_usage_stats): the
        # generated ids, not a re-tokenization of the text (special tokens are not in the text)
        "--use-server-token-count", "--per-chunk-usage",
        "--random-seed", str(SEED), "--output-artifact-dir", str(artifacts), "--ui-type", "none",
        "--no-server-metrics", "--no-gpu-telemetry",
    ]


def run_profile(command: list[str], artifacts: Path, timeout: float = 1200) -> dict:
    """Run AIPerf and return its JSON export (``profile_export_aiperf.json``)."""
    # Not HF_HUB_OFFLINE: AIPerf's offline mode looks the name up in the hub cache, which a local
    # tokenizer directory is not in; a local path is loaded from disk without any network access.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if done.returncode != 0 or not exports:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return json.loads(exports[-1].read_text())


def metric(export: dict, name: str, stat: str = "avg") -> float:
    """One figure of AIPerf's export (``{name: {"unit": ..., "avg": ..., "p50": ...}}``)."""
    value = export[name]
    return float(value[stat] if isinstance(value, dict) else value)


def render(export: dict, *, requests: int, concurrency: int, input_tokens: int, output_tokens: int) -> str:
    rows = [("time to first token", "time_to_first_token", "ms"), ("inter-token latency", "inter_token_latency", "ms"),
            ("request latency", "request_latency", "ms"), ("output sequence length", "output_sequence_length", "tokens"),
            ("input sequence length", "input_sequence_length", "tokens")]
    lines = [
        "## AIPerf against the chat endpoint (`bench/server/aiperf.py`)",
        "",
        seed_line(SEED, "AIPerf `--random-seed`: its synthetic prompts"),
        "",
        f"Machine: {machine()}; NVIDIA AIPerf 0.13.0 (`aiperf profile --endpoint-type chat --streaming`), "
        f"{requests} requests at concurrency {concurrency}, synthetic prompts of {input_tokens} tokens, output fixed at "
        f"{output_tokens} tokens with `--extra-inputs ignore_eos:true min_tokens:{output_tokens}`, through `kvgate serve` "
        "to the CPU reference engine (SmolLM2-135M, q4 weights, FP8 KV) on the same 2 shared cores. "
        "These are CPU-reference figures (they show the stack is benchmarkable the standard way), not GPU ones; "
        f"the machine is shared (1-minute load average {os.getloadavg()[0]:.1f} when the run ended). "
        "Input length is the server's count: the synthetic prompt plus SmolLM2's chat template.",
        "",
        "| metric | avg | p50 | p99 |",
        "|---|---:|---:|---:|",
    ]
    for label, key, unit in rows:
        if key in export:
            lines.append(f"| {label} ({unit}) | {metric(export, key):.1f} | {metric(export, key, 'p50'):.1f} | "
                         f"{metric(export, key, 'p99'):.1f} |")
    for label, key in (("request throughput (req/s)", "request_throughput"),
                       ("output token throughput (tokens/s)", "output_token_throughput")):
        if key in export:
            lines.append(f"| {label} | {metric(export, key):.2f} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-aiperf-"))
    engine_port, gateway_port = free_port(), free_port()
    pepper, admin = "bench-pepper-" + secrets.token_hex(16), "bench-admin-" + secrets.token_hex(16)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    engine = subprocess.Popen([sys.executable, "-m", "server.cli", "engine", "serve", "--port", str(engine_port)],
                              env=env, cwd=ROOT)
    db_url = f"sqlite:///{tmp / 'registry.db'}"
    key = seed_registry(db_url, engine_port, pepper, pool="reference", model=MODEL, primary_blocks=512)
    gw_env = dict(env, KVGATE_DATABASE_URL=db_url, KVGATE_KEY_PEPPER=pepper, KVGATE_ADMIN_TOKENS=f"bench:{admin}",
                  KVGATE_LOG_LEVEL="warning")
    gateway = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--no-engine", "--no-seed-demo",
                                "--port", str(gateway_port)], env=gw_env, cwd=tmp)
    try:
        wait_http(f"http://127.0.0.1:{gateway_port}/healthz", timeout=300)
        deadline = time.monotonic() + 300
        while wait_ready(gateway_port) is False and time.monotonic() < deadline:
            time.sleep(1)
        artifacts = tmp / "artifacts"
        command = profile_command(url=f"http://127.0.0.1:{gateway_port}", key=key,
                                  tokenizer_dir=write_tokenizer_dir(tmp / "tokenizer"), artifacts=artifacts,
                                  requests=args.requests, concurrency=args.concurrency,
                                  input_tokens=args.input_tokens, output_tokens=args.output_tokens)
        export = run_profile(command, artifacts)
    finally:
        gateway.terminate()
        engine.terminate()
        gateway.wait(10)
        engine.wait(10)
    text = render(export, requests=args.requests, concurrency=args.concurrency, input_tokens=args.input_tokens,
                  output_tokens=args.output_tokens)
    publish("aiperf", text, write=not args.no_write)


def wait_ready(gateway_port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{gateway_port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
