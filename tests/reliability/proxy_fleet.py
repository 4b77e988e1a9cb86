"""Counting proxies for a pool of replicas, in a process of their own.

Why a process: in the 1,000-stream chaos run the proxies shared one event loop with the
1,000 clients, so every engine call waited on the clients' loop (measured: lag p99 1.2 s,
max 2.6 s; engine arrival to first token p99 2.6 s, max 27 s) and calls missed the
gateway's first-token deadline for reasons that were the harness', not the product's.

The child starts one :class:`CountingProxy` per replica, all sharing their per-tenant
counters (one view of the pool), prints ``{"ports": {name: port}}`` on one line, and then
answers one command per stdin line with one JSON line: ``calls`` (every call of every
proxy: tenant, prompt length, output ids, final, arrival / first response / end on
``time.monotonic()``, which is one clock for every process of the host) and
``max_in_flight``. EOF on stdin stops it.

    python -m tests.reliability.proxy_fleet r0=127.0.0.1:9001 r1=127.0.0.1:9002
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.reliability.proxies import CountingProxy, EngineCall, start_counting_proxy

ROOT = Path(__file__).resolve().parents[2]
_SHARED = ("in_flight", "max_in_flight", "started", "finished", "responses")


def _call_json(name: str, call: EngineCall) -> dict:
    return {"replica": name, "tenant_id": call.tenant_id, "prompt_len": len(call.input_ids),
            "output_ids": list(call.output_ids), "final": call.final, "arrived": call.arrived,
            "first_response": call.first_response, "ended": call.ended}


async def _serve(upstreams: dict[str, str]) -> None:
    proxies: dict[str, CountingProxy] = {}
    servers = []
    ports = {}
    shared = None
    for name, upstream in upstreams.items():
        server, proxy, port = await start_counting_proxy(upstream)
        if shared is None:
            shared = proxy
        else:
            for attr in _SHARED:
                setattr(proxy, attr, getattr(shared, attr))
        proxies[name], ports[name] = proxy, port
        servers.append(server)
    print(json.dumps({"ports": ports}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            command = line.strip()
            if command == "calls":
                answer = {"calls": [_call_json(n, c) for n, p in proxies.items() for c in p.calls]}
            elif command == "max_in_flight":
                answer = {"max_in_flight": dict(shared.max_in_flight)}
            else:
                answer = {"error": f"unknown command {command!r}"}
            print(json.dumps(answer), flush=True)
    finally:
        for server in servers:
            await server.stop(0)


@dataclass
class ProxyFleet:
    """The parent's handle on the proxy process."""

    proc: subprocess.Popen
    ports: dict[str, int]

    @classmethod
    def start(cls, upstreams: dict[str, str], log: Path) -> ProxyFleet:
        proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.proxy_fleet",
                                 *(f"{n}={u}" for n, u in upstreams.items())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "ab"),
                                cwd=ROOT, text=True)
        ports = json.loads(proc.stdout.readline())["ports"]
        return cls(proc, ports)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def main() -> None:
    upstreams = dict(arg.split("=", 1) for arg in sys.argv[1:])
    asyncio.run(_serve(upstreams))


if __name__ == "__main__":
    main()
