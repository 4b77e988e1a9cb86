"""kvgate against LiteLLM: gateway CPU per request, side by side in one run.

Both gateways run at once, one uvicorn worker each, on the same machine; rounds alternate
between them (the order rotates every round) with the same load generator and the same
request body, so machine noise hits all of them alike. Each gateway fronts a trivial
backend that answers 16 fixed tokens at once (a stream: 16 chunks):

* **kvgate** (``kvgate serve``) in front of ``bench/server/fixed_engine.py`` (the real KServe
  contract) in two configurations served by the one gateway, one tenant each:
  *default* (static retention class, one replica) and *production* (adaptive class with
  selection, two replicas routed kv-aware); the miss-ratio curves run at their default
  sample rate in both;
* **LiteLLM** (the proxy, pinned in ``requirements-litellm.lock``, virtualenv
  ``.venv-litellm``, made by ``make bench-server/vs_litellm``) in front of an OpenAI-compatible
  server answering the same 16 tokens (:func:`openai_backend`, started by this script).

Gateway CPU is the growth of ``/proc/<pid>/task/*/schedstat`` run time, thread by thread,
over the gateway's process and its children (nanoseconds; ``/proc/<pid>/stat`` ticks are
10 ms, too coarse for a 30-request round; :func:`cpu_seconds_between`). A round's ratio is LiteLLM's CPU per request over kvgate's in
that round; figures are medians of per-round values.

Prompts: *short* (the 33-token system + user chat of ``bench/server/overhead.py``) and *long* (a
2,000-token system prompt shared by every request + a 200-token user turn that differs per
request). For the long prompt the gateway's CPU is also given per 1,000 prompt tokens and as
a share of the reference engine's prefill of the same prompt (q4 weights, one torch thread,
measured once in-process after the gateways have stopped).

    python bench/server/vs_litellm.py [--rounds 8] [--requests 30] [--no-write] [--profile SECONDS]

``--profile`` instead samples the kvgate gateway with py-spy (from ``.venv-litellm``) under
the production configuration's non-streaming and streaming load (with ``--baseline``, the
baseline gateway first, then this one) and writes the top self-time entries to the
``bench:gateway_profile`` section. Otherwise writes the ``bench:gateway_litellm`` section of
docs/benchmarks.md. ``--prompts short`` measures the short prompt only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.server.gateway_load import MESSAGES, free_port, wait_http  # noqa: E402
from bench.report import machine, publish, seed_line  # noqa: E402

LITELLM_VENV = ROOT / ".venv-litellm"
OUTPUT_TOKENS = 16
SYSTEM_TOKENS, TURN_TOKENS = 2000, 200
TOPICS = ["rivers", "bridges", "orchards", "lighthouses", "glaciers", "markets", "libraries", "harbors", "mills"]


# -- the trivial OpenAI-compatible backend LiteLLM fronts ----------------------------------

def fixed_pieces() -> list[str]:
    """The 16 token texts bench/server/fixed_engine.py answers, decoded one by one."""
    from engines.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer()
    text = " The quick brown fox jumps over the lazy dog and keeps running far away" * 8
    return [tokenizer.decode([t]) for t in tokenizer.encode(text)[:OUTPUT_TOKENS]]


def openai_backend(port: int) -> None:
    """An OpenAI chat-completions server answering the fixed tokens at once (LiteLLM's backend)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    pieces = fixed_pieces()

    async def chat(request: Request) -> Response:
        body = await request.json()
        n = min(int(body.get("max_tokens") or OUTPUT_TOKENS), len(pieces))
        prompt = sum(len(str(m.get("content", ""))) for m in body["messages"]) // 4
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        base = {"id": "chatcmpl-" + secrets.token_hex(6), "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            return JSONResponse({**base, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "finish_reason": "length",
                 "message": {"role": "assistant", "content": "".join(pieces[:n])}}]})
        frames = []
        for i, piece in enumerate(pieces[:n]):
            delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            frames.append({**base, "object": "chat.completion.chunk",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        frames.append({**base, "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            frames.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        data = "".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n"
        return StreamingResponse(iter([data]), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# -- set-up --------------------------------------------------------------------------------

def seed_registry(url: str, default_port: int, prod_ports: list[int], pepper: str) -> dict[str, str]:
    """Two pools and a tenant on each: ``default`` (static class, one replica) and
    ``production`` (adaptive class with selection, a host tier, two replicas)."""
    from tenants import keys, migrate, pools, retention_classes, tenant
    from tenants.db import make_engine, make_session_factory

    migrate.upgrade(url=url)
    factory = make_session_factory(make_engine(url))
    now, actor = datetime.now(UTC), "bench"
    with factory() as s:
        pools.create_pool(s, actor=actor, now=now, name="fixed", model_name="fixed", engine_spec="reference-smollm2",
                          replicas=[{"name": "r0", "endpoint": f"127.0.0.1:{default_port}"}], tokens_per_block=16,
                          primary_blocks=1024, secondary_blocks=0, secondary_offload_min_priority=35)
    with factory() as s:
        pools.create_pool(s, actor=actor, now=now, name="fixedprod", model_name="fixedprod",
                          engine_spec="reference-smollm2", tokens_per_block=16, primary_blocks=1024,
                          secondary_blocks=4096, secondary_offload_min_priority=35,
                          replicas=[{"name": f"r{i}", "endpoint": f"127.0.0.1:{p}"} for i, p in enumerate(prod_ports)])
    with factory() as s:
        retention_classes.create_class(s, actor=actor, now=now, name="std")
    with factory() as s:
        retention_classes.create_class(s, actor=actor, now=now, name="adaptive", mode="adaptive")
    out = {}
    for name, pool, klass in (("default", "fixed", "std"), ("production", "fixedprod", "adaptive")):
        with factory() as s:
            tenant.create_tenant(s, actor=actor, now=now, slug=name, display_name=name, pool=pool,
                                 retention_class=klass, rpm_limit=10_000_000, tpm_limit=2_000_000_000,
                                 max_concurrent_requests=10_000, max_prompt_tokens=100_000, max_output_tokens=4096)
        with factory() as s:
            out[name] = keys.create_key(s, actor=actor, now=now, tenant=name, pepper=pepper)[1]
    return out


def litellm_config(path: Path, backend_port: int, master_key: str) -> None:
    path.write_text(
        "model_list:\n"
        "  - model_name: fixed\n"
        "    litellm_params:\n"
        "      model: openai/fixed\n"
        f"      api_base: http://127.0.0.1:{backend_port}/v1\n"
        "      api_key: sk-backend\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "general_settings:\n"
        f"  master_key: {master_key}\n"
    )


# -- CPU of a process tree -----------------------------------------------------------------

def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return pids


def cpu_snapshot(pid: int) -> dict[tuple[int, int], int]:
    """Run time (schedstat, ns) of every live thread of ``pid`` and its descendants, by (pid, tid)."""
    times: dict[tuple[int, int], int] = {}
    for p in _tree(pid):
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                times[(p, int(task))] = int(Path(f"/proc/{p}/task/{task}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return times


def cpu_seconds_between(before: dict[tuple[int, int], int], after: dict[tuple[int, int], int]) -> float:
    """CPU spent between two snapshots, thread by thread: a thread alive in both counts its
    growth, a new one all of its time; one that exited in between counts nothing (its time
    since ``before`` is not readable any more; the threads that exit are idle pool workers
    reaped after their idle timeout). Summing live threads' totals instead went negative
    whenever a thread exited during a round."""
    return sum(t - before.get(key, 0) for key, t in after.items()) / 1e9


# -- prompts and load ----------------------------------------------------------------------

def long_prompt_parts() -> tuple[str, str]:
    """A system prompt of ~2,000 tokens and a user turn of ~200 (SmolLM2's tokenizer)."""
    from engines.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer()

    def prose(tag: str, count: int) -> str:
        text, i = "", 0
        while len(tokenizer.encode(text)) < count:
            text += f" Rule {tag}-{i}: the {TOPICS[i % len(TOPICS)]} near town {i * 37 % 101} changed in {1650 + 3 * i}."
            i += 1
        return text.strip()

    return "You are the travel desk's assistant. Follow these rules." + prose("s", SYSTEM_TOKENS - 12), \
        prose("u", TURN_TOKENS - 8)


class Load:
    """One party's requests: same body shape, same load generator, for every gateway."""

    def __init__(self, base_url: str, key: str, model: str, long_parts: tuple[str, str] | None) -> None:
        # Idle connections are dropped before the servers' keep-alive timeout (uvicorn: 5 s),
        # so a round never reuses one the server is closing while other parties run.
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=1.0)
        self.http = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120,
                                      headers={"Authorization": f"Bearer {key}"})
        self.model = model
        self.long_parts = long_parts
        self.counter = 0
        self.prompt_tokens: dict[str, int] = {}

    def body(self, prompt: str, stream: bool) -> dict:
        if prompt == "short":
            messages = MESSAGES
        else:
            self.counter += 1
            system, turn = self.long_parts
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Request {self.counter}. {turn}"}]
        return {"model": self.model, "messages": messages, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
                "stream": stream}

    async def run(self, prompt: str, n: int, concurrency: int, stream: bool) -> None:
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                body = self.body(prompt, stream)
                if stream:
                    async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                        assert response.status_code == 200, await response.aread()
                        async for _ in response.aiter_bytes():
                            pass
                else:
                    response = await self.http.post("/v1/chat/completions", json=body)
                    assert response.status_code == 200, response.text
                    if prompt not in self.prompt_tokens:
                        self.prompt_tokens[prompt] = response.json()["usage"]["prompt_tokens"]

        await asyncio.gather(*(one() for _ in range(n)))


async def measure(args, parties: dict[str, tuple[Load, int]]) -> list[dict]:
    rows = []
    names = list(parties)
    for prompt in args.prompts:
        for stream in (False, True):
            for concurrency in (1, 32):
                for load, _ in parties.values():  # warm-up: tokenizer, caches, connections
                    await load.run(prompt, 16, 8, stream)
                per_round: dict[str, list[float]] = {name: [] for name in names}
                for r in range(args.rounds):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for name in order:
                        load, pid = parties[name]
                        before = cpu_snapshot(pid)
                        await load.run(prompt, args.requests, concurrency, stream)
                        per_round[name].append(cpu_seconds_between(before, cpu_snapshot(pid)) / args.requests)
                row = {"prompt": prompt, "mode": "stream" if stream else "non-stream", "clients": concurrency}
                for name in names:
                    row[f"{name}_ms"] = 1000 * statistics.median(per_round[name])
                if "baseline" in per_round:  # before / after, production tenant, same rounds
                    row["before_after"] = statistics.median(
                        [b / a for b, a in zip(per_round["baseline"], per_round["production"])])
                for name in names:
                    if name in ("default", "production"):
                        ratios = [lite / own for lite, own in zip(per_round["litellm"], per_round[name])]
                        row[f"ratio_{name}"] = statistics.median(ratios)
                        row[f"ratio_{name}_range"] = (min(ratios), max(ratios))
                rows.append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
    return rows


def prefill_seconds(input_ids: list[int], repeats: int = 3) -> float:
    """The reference engine's prefill of ``input_ids`` (q4 weights, one torch thread): the
    median time to its first token over ``repeats`` cold requests (distinct salts)."""
    import torch

    from engines.contract import EngineRequest, SamplingParams
    from engines.reference.config import ReferenceEngineConfig
    from engines.reference.engine import ReferenceEngine
    from engines.reference.loader import load_model
    from retention.types import RetentionPlan

    torch.set_num_threads(1)
    bundle = load_model(weight_format="q4")
    engine = ReferenceEngine(bundle, ReferenceEngineConfig(
        primary_blocks=512, secondary_blocks=0, max_input_len=4096, max_output_len=16, max_num_tokens=512,
        num_threads=1, decode_threads=1))

    async def once(salt: str, ids: list[int]) -> float:
        start = time.perf_counter()
        request = EngineRequest(tuple(ids), 1, None, True, SamplingParams(), RetentionPlan(), salt, "bench")
        async for _ in engine.generate(secrets.token_hex(4), request):
            break
        return time.perf_counter() - start

    async def run() -> list[float]:
        await once("warm", input_ids[:64])
        return [await once(f"cold-{i}", input_ids) for i in range(repeats)]

    engine.start()
    try:
        return statistics.median(asyncio.run(run()))
    finally:
        engine.stop()


def render(args, rows: list[dict], long_tokens: dict[str, int], prefill_s: float | None, version: str) -> str:
    lines = [
        "## kvgate vs LiteLLM: gateway CPU per request (`bench/server/vs_litellm.py`)",
        "",
        seed_line(None, "fixed chat requests; the backends answer 16 fixed tokens"),
        "",
        f"Machine: {machine()} (shared; 1-minute load average {os.getloadavg()[0]:.1f} at the end). kvgate (`kvgate "
        "serve`, 1 uvicorn worker) in front of `bench/server/fixed_engine.py` and LiteLLM "
        f"{version} (proxy, 1 worker, master key, no database) in front of an OpenAI-compatible server answering the "
        "same 16 tokens at once (a stream: 16 chunks), both running throughout. kvgate serves two tenants: *default* "
        "(static class, one replica) and *production* (adaptive class with selection over a host tier, two replicas "
        "routed kv-aware); the miss-ratio curves run at their default 1 % sample in both. Rounds of "
        f"{args.requests} requests rotate LiteLLM / kvgate default / kvgate production ({args.rounds} rounds per row, "
        "same load generator and body); gateway CPU is the run time of the gateway's process tree from "
        "`/proc/<pid>/task/*/schedstat`. Figures are medians of per-round values; × = LiteLLM's CPU over kvgate's "
        "in the same round (median, range over rounds in brackets). kvgate's figures include its usage journal with "
        "the default fsync before each answer (`KVGATE_USAGE_JOURNAL_SYNC=fsync`), while LiteLLM runs with no "
        "database and so records no usage.",
        "",
        "| prompt | mode | clients | LiteLLM CPU ms/req | kvgate default ms/req | × default | "
        "kvgate production ms/req | × production |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d_lo, d_hi = r["ratio_default_range"]
        p_lo, p_hi = r["ratio_production_range"]
        lines.append(f"| {r['prompt']} | {r['mode']} | {r['clients']} | {r['litellm_ms']:.2f} | {r['default_ms']:.2f} | "
                     f"{r['ratio_default']:.1f} × ({d_lo:.1f}–{d_hi:.1f}) | {r['production_ms']:.2f} | "
                     f"{r['ratio_production']:.1f} × ({p_lo:.1f}–{p_hi:.1f}) |")
    tokens = long_tokens.get("long")
    if tokens:
        lines += ["", f"Long prompt: {tokens:,} prompt tokens as kvgate counts them (chat template included; "
                  f"{SYSTEM_TOKENS:,}-token system prompt shared by every request, {TURN_TOKENS}-token turn different "
                  "in each). Gateway CPU per 1,000 prompt tokens"
                  + (f", and as a share of the reference engine's prefill of the same prompt ({1000 * prefill_s:,.0f} "
                     "ms, q4 weights, one torch thread, median of 3 cold runs)" if prefill_s else "") + ":", "",
                  "| mode | clients | LiteLLM ms / 1k tok | kvgate default ms / 1k tok | kvgate production ms / 1k tok |"
                  + (" kvgate production / prefill |" if prefill_s else ""),
                  "|---|---:|---:|---:|---:|" + ("---:|" if prefill_s else "")]
        for r in rows:
            if r["prompt"] != "long":
                continue
            per_k = {name: r[f"{name}_ms"] * 1000 / tokens for name in ("litellm", "default", "production")}
            share = f" {100 * r['production_ms'] / 1000 / prefill_s:.2f} % |" if prefill_s else ""
            lines.append(f"| {r['mode']} | {r['clients']} | {per_k['litellm']:.2f} | {per_k['default']:.2f} | "
                         f"{per_k['production']:.2f} |{share}")
    if rows and "before_after" in rows[0]:
        lines += ["", "Before / after the measured commit's hot-path changes (a second kvgate gateway from its parent commit's "
                  "source on the same production tenant and backends, in the same rotation; parent's CPU over this "
                  "one's, median of per-round ratios):", "",
                  "| prompt | mode | clients | parent ms/req | this ms/req | parent / this |", "|---|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['prompt']} | {r['mode']} | {r['clients']} | {r['baseline_ms']:.2f} | "
                         f"{r['production_ms']:.2f} | {r['before_after']:.2f} × |")
    lines += ["", "Target: ≥ 10 × less gateway CPU per request than LiteLLM in all four short-prompt modes, "
              "production configuration."]
    short = [r["ratio_production"] for r in rows if r["prompt"] == "short"]
    if short:
        lines[-1] += (" In this run: " + ", ".join(f"{x:.1f} ×" for x in short)
                      + (" — reached." if len(short) == 4 and min(short) >= 10 else " — not reached."))
    return "\n".join(lines)


def py_spy_top(pid: int, seconds: int, drive, n: int = 25) -> tuple[list[tuple[float, str]], dict[str, float]]:
    """py-spy's top ``n`` self-time frames of ``pid`` (share of samples, frame) while ``drive()``
    loads it, and the share of every :func:`frame_group`."""
    spy = LITELLM_VENV / "bin" / "py-spy"
    out = Path(tempfile.mkdtemp()) / "profile.txt"
    proc = subprocess.Popen([str(spy), "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "250",
                             "--format", "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    drive()
    proc.wait(seconds + 30)
    self_time: dict[str, int] = {}
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frame = stack.split(";")[-1]
        self_time[frame] = self_time.get(frame, 0) + int(count)
        total += int(count)
    top = sorted(self_time.items(), key=lambda kv: -kv[1])[:n]
    groups: dict[str, float] = {}
    for frame, count in self_time.items():
        group = frame_group(frame)
        groups[group] = groups.get(group, 0.0) + 100 * count / total
    return [(100 * count / total, frame) for frame, count in top], groups


FRAME_GROUPS = (  # (group, path prefixes of a frame's file), first match wins
    ("gRPC client (grpc.aio, tritonclient, grpclib, h2)",
     ("grpc/", "tritonclient/", "grpclib/", "h2/", "hpack/", "hyperframe/", "multidict/")),
    ("threads (gRPC poller; usage journal writer)", ("threading.py", "server/gateway/usage_journal.py", "queue.py")),
    ("event loop (asyncio / uvloop)", ("asyncio/",)),
    ("HTTP server (uvicorn)", ("uvicorn/",)),
    ("web framework (FastAPI, Starlette, anyio, pydantic)", ("fastapi/", "starlette/", "anyio/", "pydantic")),
    ("kvgate (server/, engines/, retention/, tenants/)", ("server/", "engines/", "retention/", "tenants/")),
)


def frame_group(frame: str) -> str:
    """The :data:`FRAME_GROUPS` group of a py-spy frame ``name (path:line)``; else ``other``."""
    path = frame.rpartition(" (")[2]
    for group, prefixes in FRAME_GROUPS:
        if path.startswith(prefixes):
            return group
    return "other (SQLAlchemy, json, stdlib)"


def render_profile(seconds: int, tops: dict[str, list[tuple[float, str]]], n: int = 16,
                   groups: dict[str, dict[str, float]] | None = None) -> str:
    """The ``bench:gateway_profile`` section: top self-time frames, before / after side by side,
    then the share of each group of frames (:data:`FRAME_GROUPS`)."""
    labels = list(tops)
    lines = [
        f"## Gateway hot path: where the CPU goes (`bench/server/vs_litellm.py --profile {seconds}"
        + (" --baseline DIR`)" if len(labels) > 1 else "`)"),
        "",
        f"Machine: {machine()} (shared; 1-minute load average {os.getloadavg()[0]:.1f} at the end). py-spy (from "
        f"`.venv-litellm`) sampling the kvgate gateway at 250 Hz for {seconds} s while the production tenant "
        "(adaptive class with selection, 2 replicas kv-aware, miss-ratio curves at their default rate) gets the short "
        "prompt, batches of 40 non-streaming then 40 streaming requests at 8 clients; share of samples by the "
        "innermost Python frame (self time; time in C extensions is charged to the Python frame that called them). "
        + ("*before*: a gateway from the source tree given with `--baseline` (the parent commit), profiled first, "
           "then *after*: this tree, on the same tenant and backends. " if len(labels) > 1 else "")
        + "The machine is shared, so shares move by a point or two between runs.",
        "",
        "| " + " | ".join(f"{label}: share | frame" for label in labels) + " |",
        "|" + "---:|---|" * len(labels),
    ]
    for i in range(n):
        cells = []
        for label in labels:
            row = tops[label][i] if i < len(tops[label]) else None
            cells.append(f"{row[0]:.1f} % | `{row[1]}`" if row else " | ")
        lines.append("| " + " | ".join(cells) + " |")
    if groups:
        names = [g for g, _ in FRAME_GROUPS] + ["other (SQLAlchemy, json, stdlib)"]
        lines += ["", "Self time by group of frames (every sample):", "",
                  "| group | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
        for name in names:
            lines.append(f"| {name} | " + " | ".join(f"{groups[label].get(name, 0.0):.1f} %" for label in labels) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--openai-backend", type=int, help=argparse.SUPPRESS)  # internal: serve LiteLLM's backend
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=30, help="requests per party per round")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--no-prefill", action="store_true", help="skip the reference engine's prefill measurement")
    parser.add_argument("--prompts", nargs="+", choices=("short", "long"), default=["short", "long"],
                        help="which prompts to measure (default: both)")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also run a second kvgate gateway from the source tree DIR (e.g. `git archive` of the "
                             "parent commit) on the production tenant: before/after in the same rounds")
    parser.add_argument("--profile", type=int, default=0, metavar="SECONDS",
                        help="py-spy the kvgate gateway (production tenant) instead of measuring")
    args = parser.parse_args()
    if args.openai_backend:
        openai_backend(args.openai_backend)
        return
    litellm_bin = LITELLM_VENV / "bin" / "litellm"
    if not args.profile and not litellm_bin.exists():
        sys.exit(f"{litellm_bin} is missing: make bench-server/vs_litellm builds it")
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-litellm-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ports = {name: free_port() for name in ("e0", "e1", "e2", "backend", "kvgate", "litellm")}
    procs: list[subprocess.Popen] = []

    def start(cmd, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, **kw)
        procs.append(proc)
        return proc

    for e in ("e0", "e1", "e2"):
        # the production pool's replicas report the host tier the registry gives them
        tiers = ["--secondary-blocks", "4096"] if e != "e0" else []
        start([sys.executable, str(ROOT / "bench" / "server" / "fixed_engine.py"), "--port", str(ports[e]), *tiers],
              env=env, cwd=ROOT)
    pepper, admin = "bench-pepper-" + secrets.token_hex(16), "bench-admin-" + secrets.token_hex(16)
    db_url = f"sqlite:///{tmp / 'registry.db'}"
    keys = seed_registry(db_url, ports["e0"], [ports["e1"], ports["e2"]], pepper)
    gw_env = dict(env, KVGATE_DATABASE_URL=db_url, KVGATE_KEY_PEPPER=pepper, KVGATE_ADMIN_TOKENS=f"bench:{admin}",
                  KVGATE_LOG_LEVEL="warning", KVGATE_USAGE_JOURNAL="true", KVGATE_USAGE_JOURNAL_SYNC="fsync")
    kvgate = start([sys.executable, "-m", "server.cli", "serve", "--no-engine", "--no-seed-demo",
                    "--port", str(ports["kvgate"])], env=gw_env, cwd=tmp)
    baseline = None
    if args.baseline:
        base_tmp = tmp / "baseline"
        base_tmp.mkdir()
        for path in tmp.glob("registry.db*"):  # with the SQLite journal files (WAL)
            shutil.copy(path, base_tmp / path.name)
        ports["baseline"] = free_port()
        baseline = start([sys.executable, "-m", "server.cli", "serve", "--no-engine", "--no-seed-demo",
                          "--port", str(ports["baseline"])], cwd=base_tmp,
                         env=dict(gw_env, PYTHONPATH=str(args.baseline.resolve()),
                                  KVGATE_DATABASE_URL=f"sqlite:///{base_tmp / 'registry.db'}"))
    master = "sk-bench-" + secrets.token_hex(16)
    litellm = None
    version = "?"
    if not args.profile:
        start([sys.executable, __file__, "--openai-backend", str(ports["backend"])], env=env, cwd=ROOT)
        litellm_config(tmp / "litellm.yaml", ports["backend"], master)
        lite_env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        lite_env.update(LITELLM_LOG="ERROR", LITELLM_LOCAL_MODEL_COST_MAP="True", OMP_NUM_THREADS="1")
        litellm = start([str(litellm_bin), "--config", str(tmp / "litellm.yaml"), "--host", "127.0.0.1",
                         "--port", str(ports["litellm"]), "--num_workers", "1"], env=lite_env, cwd=tmp,
                        stdout=subprocess.DEVNULL)
        version = subprocess.run([str(LITELLM_VENV / "bin" / "python"), "-c",
                                  "import importlib.metadata as m; print(m.version('litellm'))"],
                                 capture_output=True, text=True).stdout.strip()
    rows: list[dict] = []
    try:
        wait_http(f"http://127.0.0.1:{ports['kvgate']}/healthz", timeout=240)
        if litellm is not None:
            wait_http(f"http://127.0.0.1:{ports['litellm']}/health/liveliness", timeout=180)
        time.sleep(3)  # the fixed engines load the tokenizer to pick their tokens
        long_parts = long_prompt_parts()
        kv = f"http://127.0.0.1:{ports['kvgate']}"
        parties = {"default": (Load(kv, keys["default"], "fixed", long_parts), kvgate.pid),
                   "production": (Load(kv, keys["production"], "fixedprod", long_parts), kvgate.pid)}
        if args.profile:
            targets = {"after": (parties["production"][0], kvgate.pid)}
            if baseline is not None:
                wait_http(f"http://127.0.0.1:{ports['baseline']}/healthz", timeout=240)
                targets = {"before": (Load(f"http://127.0.0.1:{ports['baseline']}", keys["production"], "fixedprod",
                                           long_parts), baseline.pid), **targets}
            tops, groups = {}, {}
            for label, (load, pid) in targets.items():
                def drive(load: Load = load) -> None:
                    async def go() -> None:
                        await load.run("short", 16, 8, False)  # warm-up, outside the samples' window
                        deadline = time.monotonic() + args.profile - 3
                        while time.monotonic() < deadline:
                            await load.run("short", 40, 8, False)
                            await load.run("short", 40, 8, True)
                    asyncio.run(go())

                tops[label], groups[label] = py_spy_top(pid, args.profile, drive)
            profile_text = render_profile(args.profile, tops, groups=groups)
            publish("gateway_profile", profile_text, write=not args.no_write)
            return
        parties["litellm"] = (Load(f"http://127.0.0.1:{ports['litellm']}", master, "fixed", long_parts), litellm.pid)
        if baseline is not None:
            wait_http(f"http://127.0.0.1:{ports['baseline']}/healthz", timeout=240)
            parties["baseline"] = (Load(f"http://127.0.0.1:{ports['baseline']}", keys["production"], "fixedprod",
                                        long_parts), baseline.pid)
        parties = {name: parties[name] for name in ("litellm", "default", "production", "baseline") if name in parties}
        rows = asyncio.run(measure(args, parties))
        long_tokens = parties["production"][0].prompt_tokens
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    prefill_s = None
    if not args.no_prefill and "long" in args.prompts:
        from engines.tokenizer import load_gguf_tokenizer
        from server.gateway.api.prompting import prepare_chat

        system, turn = long_prompt_parts()
        ids = list(prepare_chat(load_gguf_tokenizer(), [{"role": "system", "content": system},
                                                         {"role": "user", "content": f"Request 1. {turn}"}]).input_ids)
        prefill_s = prefill_seconds(ids)
        print(json.dumps({"prefill_tokens": len(ids), "prefill_s": round(prefill_s, 3)}))
    text = render(args, rows, long_tokens, prefill_s, version)
    publish("gateway_litellm", text, write=not args.no_write)


if __name__ == "__main__":
    main()
