"""A live capture from a real run, then `kvgate analyze` on it (docs/measure-reuse.md).

Starts the real stack (reference engine process + gateway over HTTP + SQLite registry,
the same ``build_stack`` the end-to-end tests use), creates three salted tenants with
different reuse shapes, turns a capture on through the admin API, sends a seeded mixed
workload, stops the capture, exports it with ``kvgate trace export`` and analyses it with
``kvgate analyze`` (tables to stdout, plots to ``--plots``)::

    python -m bench.retention.reuse_capture --out /tmp/capture.jsonl --plots docs/img/analyze-capture

Tenants: ``support`` (one long system prompt, three-turn conversations), ``docs`` (a short
system prompt plus one of five documents, Zipf-popular, then a question) and ``oneshot``
(unique prompts). Prompts are made of seeded filler words: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.server.gateway.stack import build_stack  # noqa: E402

MODEL = "smollm2-135m-instruct"
WORDS = ("cache block tenant prefix engine host tier retention priority offload token request gateway pool "
         "latency budget window policy segment context system turn decode prefill salt hash chain reuse").split()


def filler(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def workload(seed: int) -> list[tuple[str, list[list[dict]]]]:
    """(tenant, [turns]) units; a conversation's turns run in order, units are shuffled."""
    rng = random.Random(seed)
    support_system = "You are the support assistant of a storage company. " + filler(rng, 180)
    docs_system = "Answer from the document only. " + filler(rng, 30)
    documents = [f"Document {i}: " + filler(rng, 150) for i in range(5)]
    units: list[tuple[str, list[list[dict]]]] = []
    for c in range(12):
        msgs = [{"role": "system", "content": support_system}]
        turns = []
        for t in range(3):
            msgs = msgs + [{"role": "user", "content": f"Ticket {c} question {t}: " + filler(rng, 12)}]
            turns.append(list(msgs))
            msgs = msgs + [{"role": "assistant", "content": filler(rng, 8)}]
        units.append(("support", turns))
    weights = [1 / (i + 1) for i in range(len(documents))]
    for q in range(30):
        doc = rng.choices(documents, weights)[0]
        units.append(("docs", [[{"role": "system", "content": docs_system},
                                {"role": "user", "content": doc + f" Question {q}: " + filler(rng, 10)}]]))
    for q in range(20):
        units.append(("oneshot", [[{"role": "user", "content": f"Note {q}: " + filler(rng, 90)}]]))
    rng.shuffle(units)
    return units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="exported trace (JSONL)")
    parser.add_argument("--plots", type=Path, help="kvgate analyze --plots DIR")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        engine_args = ["--tokens-per-block", "16", "--primary-blocks", "96", "--secondary-blocks", "256",
                       "--max-input-len", "1024", "--max-output-len", "64", "--max-batch-size", "4"]
        stack = build_stack(tmp, engine_args=engine_args, tokens_per_block=16, primary=96, secondary=256)
        try:
            keys = {slug: stack.add_tenant(slug, isolation="salted") for slug in ("support", "docs", "oneshot")}
            admin = {"Authorization": f"Bearer {stack.admin_token}"}
            cap = httpx.post(f"{stack.gateway.base_url}/admin/v1/pools/reference/captures", headers=admin,
                             json={"sample_rate": 1.0, "max_bytes": 50_000_000}).json()
            captures = stack.gateway.app.state.gateway.captures  # type: ignore[attr-defined]
            while "reference" not in captures.active_pools:
                time.sleep(0.05)
            start_ms = int(time.time() * 1000)
            clients = {slug: openai.OpenAI(api_key=k, base_url=stack.gateway.base_url + "/v1", max_retries=2,
                                           timeout=300) for slug, k in keys.items()}
            done = 0
            lock = threading.Lock()

            def run(unit: tuple[str, list[list[dict]]]) -> None:
                nonlocal done
                slug, turns = unit
                for messages in turns:
                    stream = clients[slug].chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True)
                    for _ in stream:
                        pass
                    with lock:
                        done += 1

            units = workload(args.seed)
            began = time.monotonic()
            with ThreadPoolExecutor(args.workers) as pool:
                list(pool.map(run, units))
            print(f"{done} requests in {time.monotonic() - began:.0f} s; seed {args.seed} (random.Random: the "
                  "conversations' order, documents and filler words)", file=sys.stderr)
            time.sleep(1.0)  # the writer thread flushes the last lines
            httpx.post(f"{stack.gateway.base_url}/admin/v1/pools/reference/captures/{cap['id']}/stop", headers=admin)
            end_ms = int(time.time() * 1000) + 1
            kvgate = [sys.executable, "-m", "server.cli"]
            subprocess.run([*kvgate, "trace", "export", "--pool", "reference", "--dir", str(stack.trace_dir),
                            "--from", str(start_ms), "--to", str(end_ms), "-o", str(args.out)], check=True)
        finally:
            stack.gateway.stop()
            stack.engine.kill()
    if args.plots is not None:
        subprocess.run([sys.executable, "-m", "server.cli", "analyze", str(args.out), "--no-progress",
                        "--kv-bytes-per-token", "11520", "--gpu", "96", "--host-multiples", "0,0.5,1,2,4,8",
                        "--plots", str(args.plots)], check=True)


if __name__ == "__main__":
    main()
