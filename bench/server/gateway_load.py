"""The load the gateway benches put on a gateway, and what they read of its process.

One fixed chat request (``MESSAGES``; ``ANTHROPIC_BODY`` is the same prompt in Anthropic's
shape) sent by :func:`run_gateway` at a given concurrency, streamed or not; a gateway's CPU from
``/proc``; percentiles and one side-by-side row of two variants measured in alternating rounds.
Shared by ``overhead.py``, ``overhead_sync.py``, ``usage_journal.py``, ``aiperf.py`` and
``vs_litellm.py``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import httpx

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant for a travel agency. Answer in one sentence."},
    {"role": "user", "content": "Suggest a weekend destination near Lisbon for a family with two kids."},
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


# The same prompt as MESSAGES in Anthropic's shape (system at the top level).
ANTHROPIC_BODY = {"model": "fixed", "system": MESSAGES[0]["content"], "messages": MESSAGES[1:], "max_tokens": 16,
                  "temperature": 0}


async def run_gateway(http: httpx.AsyncClient, key: str, n: int, concurrency: int, stream: bool,
                      extra: dict | None = None, dialect: str = "chat") -> list[float]:
    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    if dialect == "messages":
        path, headers = "/v1/messages", {"x-api-key": key, "anthropic-version": "2023-06-01"}
        body = {**ANTHROPIC_BODY, "stream": stream, **(extra or {})}
    else:
        path, headers = "/v1/chat/completions", {"Authorization": f"Bearer {key}"}
        body = {"model": "fixed", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "stream": stream,
                **(extra or {})}

    async def one() -> None:
        async with sem:
            start = time.perf_counter()
            if stream:
                async with http.stream("POST", path, json=body, headers=headers) as response:
                    assert response.status_code == 200, await response.aread()
                    async for _ in response.aiter_bytes():
                        pass
            else:
                response = await http.post(path, json=body, headers=headers)
                assert response.status_code == 200, response.text
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(one() for _ in range(n)))
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def side_by_side(stream: bool, concurrency: int, latencies: dict[str, list[float]], cpu: dict[str, float]) -> dict:
    """One row of two variants measured in alternating rounds: p50 / p99 latency and CPU per request of each
    (keys ``<variant>_p50_ms``, ``<variant>_p99_ms``, ``<variant>_cpu_ms_per_request``)."""
    first = next(iter(latencies))
    row: dict = {"mode": "stream (16 chunks)" if stream else "non-stream", "concurrency": concurrency,
                 "requests": len(latencies[first])}
    for name, measured in latencies.items():
        row[f"{name}_p50_ms"] = 1000 * pct(measured, 0.5)
        row[f"{name}_p99_ms"] = 1000 * pct(measured, 0.99)
        row[f"{name}_cpu_ms_per_request"] = 1000 * cpu[name] / len(measured)
    return row
