"""What the usage journal costs: gateway CPU and latency per request, journal on vs off.

Two ``kvgate serve`` processes on one SQLite registry and one ``bench/server/fixed_engine.py``
(the real contract, 16 fixed tokens at once, so the gateway is what is measured), one
with the usage journal (``KVGATE_USAGE_JOURNAL``, the default: every answered request's
usage fsynced, group committed, before the answer ends) and one without. Rounds
alternate between them so machine noise hits both equally; CPU time of each gateway is
read from ``/proc/<pid>/stat`` around its rounds. Figures go to the ``bench:usage_journal``
section of docs/benchmarks.md.

    python bench/server/usage_journal.py [--requests 400] [--concurrency 1,32] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402
from bench.server.gateway_load import cpu_seconds, free_port, pct, run_gateway, wait_http  # noqa: E402
from bench.server.overhead import seed_registry  # noqa: E402


async def measure(args, key: str, gateways: dict[str, tuple[int, int]]) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256)) as http:
        for stream in (False, True):
            for concurrency in args.concurrency:
                latencies: dict[str, list[float]] = {mode: [] for mode in gateways}
                cpu = dict.fromkeys(gateways, 0.0)
                for mode, (port, _) in gateways.items():  # warm-up, not measured
                    http.base_url = f"http://127.0.0.1:{port}"
                    await run_gateway(http, key, 20, concurrency, stream)
                rounds = max(1, args.requests // args.round)
                for _ in range(rounds):
                    for mode, (port, pid) in gateways.items():
                        http.base_url = f"http://127.0.0.1:{port}"
                        before = cpu_seconds(pid)
                        latencies[mode] += await run_gateway(http, key, args.round, concurrency, stream)
                        cpu[mode] += cpu_seconds(pid) - before
                row = {"stream": stream, "concurrency": concurrency, "requests": len(latencies["journal"])}
                for mode in gateways:
                    row[f"{mode}_p50_ms"] = 1000 * statistics.median(latencies[mode])
                    row[f"{mode}_p99_ms"] = 1000 * pct(latencies[mode], 0.99)
                    row[f"{mode}_cpu_ms"] = 1000 * cpu[mode] / len(latencies[mode])
                row["cpu_ratio"] = row["journal_cpu_ms"] / row["no_journal_cpu_ms"]
                row["p50_ratio"] = row["journal_p50_ms"] / row["no_journal_p50_ms"]
                rows.append(row)
                print(row, flush=True)
    return rows


def render(rows: list[dict], args) -> str:
    lines = ["## Usage journal cost (`bench/server/usage_journal.py`)", "",
             f"Machine: {machine()}. Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Two `kvgate serve` "
             "processes, usage journal on (default) and off, one SQLite registry, one `bench/server/fixed_engine.py` "
             f"(16 fixed tokens); {args.requests} requests per cell in alternating rounds of {args.round}. The "
             "journal's storage is the machine's local disk (fsync per group commit).", "",
             "| mode | concurrency | p50 ms on / off | p99 ms on / off | gateway CPU ms/request on / off | CPU ratio | p50 ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {'stream' if r['stream'] else 'json'} | {r['concurrency']} | "
                     f"{r['journal_p50_ms']:.2f} / {r['no_journal_p50_ms']:.2f} | "
                     f"{r['journal_p99_ms']:.2f} / {r['no_journal_p99_ms']:.2f} | "
                     f"{r['journal_cpu_ms']:.2f} / {r['no_journal_cpu_ms']:.2f} | {r['cpu_ratio']:.2f} × | "
                     f"{r['p50_ratio']:.2f} × |")
    lines += ["", "The durability point: a JSON answer is built after its usage line is fsynced; a stream's "
              "closing frames (finish reason, usage, `[DONE]`) are held until it is, content frames never are. "
              "Concurrent requests share one fsync (group commit), so at concurrency the cost per request falls.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--round", type=int, default=50)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-journal-"))
    engine_port = free_port()
    pepper, admin = "bench-pepper-" + secrets.token_hex(16), "bench-admin-" + secrets.token_hex(16)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, str(ROOT / "bench" / "server" / "fixed_engine.py"), "--port", str(engine_port)],
                              env=env, cwd=ROOT)]
    db_url = f"sqlite:///{tmp / 'registry.db'}"
    key = seed_registry(db_url, engine_port, pepper)
    gateways: dict[str, tuple[int, int]] = {}
    try:
        for mode, on in (("journal", "true"), ("no_journal", "false")):
            port = free_port()
            gw_env = dict(env, KVGATE_DATABASE_URL=db_url, KVGATE_KEY_PEPPER=pepper,
                          KVGATE_ADMIN_TOKENS=f"bench:{admin}", KVGATE_LOG_LEVEL="warning",
                          KVGATE_USAGE_JOURNAL=on, KVGATE_USAGE_JOURNAL_DIR=str(tmp / f"journal-{mode}"))
            proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--no-engine", "--no-seed-demo",
                                     "--no-migrate", "--port", str(port)], env=gw_env, cwd=tmp)
            procs.append(proc)
            gateways[mode] = (port, proc.pid)
        for port, _ in gateways.values():
            wait_http(f"http://127.0.0.1:{port}/healthz")
        time.sleep(2.5)  # the fixed engine loads the tokenizer to pick its tokens
        rows = asyncio.run(measure(args, key, gateways))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    body = render(rows, args)
    print(body)
    if not args.no_write:
        write_section("usage_journal", body)


if __name__ == "__main__":
    main()
