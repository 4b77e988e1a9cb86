"""Block operations per second of the retention pool replaying the Mooncake synthetic trace.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python bench/retention/pool_ops.py [--runs 3] [--no-write]``

Pool only: token synthesis happens before the timer starts for each request; the timed
section is exactly ``pool.allocate`` + ``pool.release`` (``--hold none``). A *block
operation* is one of: a full prompt block hashed and looked up, a block claimed or
allocated for a request, a block released, a block offloaded, onboarded or evicted.
Each configuration runs ``--runs`` times; the median is reported and written into the
``bench:pool_ops`` section of docs/benchmarks.md (only that section is replaced).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import seed_line, synthetic_trace, write_section  # noqa: E402
from retention.pool import BlockPool, PoolConfig  # noqa: E402
from retention.trace import distinct_blocks, parse_trace, request_tokens  # noqa: E402
from retention.types import DEFAULT_PLAN  # noqa: E402

TRACE = synthetic_trace()
SECTION = "pool_ops"


def replay(requests, *, primary: int, secondary: int, block: int) -> tuple[int, float]:
    """(block operations, seconds inside the pool) for one replay."""
    pool = BlockPool(PoolConfig(primary_blocks=primary, secondary_blocks=secondary, tokens_per_block=block,
                                event_buffer_max_size=0))
    ops = 0
    elapsed = 0.0
    # CPU time of this process: the 2 cores are shared by several engineers, and wall time
    # would mostly measure their load. Single-threaded code, so CPU time ~ wall time when idle.
    clock = time.process_time
    for request in requests:
        tokens = request_tokens(request, 512)
        n = len(tokens)
        now = request.timestamp_ms / 1000.0
        start = clock()
        alloc = pool.allocate(request.index, tokens, salt=None, tenant=None, plan=DEFAULT_PLAN, now=now)
        if alloc is not None:
            pool.release(request.index, tokens, now=now, num_computed_tokens=n)
        elapsed += clock() - start
        if alloc is not None:
            ops += n // block + 2 * len(alloc.slots)
    stats = pool.stats()
    ops += stats.offloaded_blocks + stats.onboarded_blocks + stats.evicted_blocks
    return ops, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    with TRACE.open() as handle:
        requests = parse_trace(handle)
    distinct = distinct_blocks(requests)
    configs = [
        ("lru, GPU 2 % (878 blocks), no host", round(0.02 * distinct), 0, 512),
        ("TensorRT-LLM defaults, GPU 2 % + host 4x (offload/onboard traffic)", round(0.02 * distinct),
         4 * round(0.02 * distinct), 512),
        ("lru, 32-token blocks (engine-sized), GPU 2 %", round(0.02 * distinct) * 16, 0, 32),
    ]
    rows = []
    for label, primary, secondary, block in configs:
        rates = []
        ops = 0
        for _ in range(args.runs):
            ops, seconds = replay(requests, primary=primary, secondary=secondary, block=block)
            rates.append(ops / seconds)
        median = statistics.median(rates)
        rows.append((label, ops, median, min(rates), max(rates)))
        print(f"{label}: {ops:,} block ops/replay, median {median:,.0f} ops/s (min {min(rates):,.0f}, max {max(rates):,.0f})")
    machine = f"{platform.machine()}, {os.cpu_count()} cores shared with other work, Python {platform.python_version()}"
    body = [
        "## Block pool operations (bench/retention/pool_ops.py)",
        "",
        seed_line(None, "the public synthetic trace as it is; tokens synthesised from its hash ids"),
        "",
        f"Replay of `mooncake_synthetic_trace.jsonl` ({len(requests):,} requests, {distinct:,} distinct 512-token blocks),",
        "`--hold none`, pool calls only (token synthesis excluded), process CPU time, median of "
        f"{args.runs} runs. Machine: {machine}.",
        "A block operation is a full prompt block hashed and looked up, a block claimed or allocated, a block",
        "released, or a block offloaded, onboarded or evicted. Target: >= 500,000 ops/s.",
        "",
        "| configuration | block ops per replay | median ops/s | min | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, ops, median, low, high in rows:
        body.append(f"| {label} | {ops:,} | {median:,.0f} | {low:,.0f} | {high:,.0f} |")
    text = "\n".join(body)
    if not args.no_write:
        write_section(SECTION, text)
        print("wrote docs/benchmarks.md section bench:pool_ops")


if __name__ == "__main__":
    main()
