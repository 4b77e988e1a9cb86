"""The README's admin walk-through runs verbatim against `kvgate serve --dev` (what `make serve` runs).

The only change made to the commands is the port (a free one instead of 8000), so the
test does not collide with a server a developer has running. The server runs as
``make serve`` runs it (dev mode, demo tenant seeded) except ``--no-engine``: the
walk-through only talks to the admin API, and loading the model would only slow the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _walkthrough(name: str = "walkthrough") -> str:
    readme = (ROOT / "README.md").read_text()
    block = re.search(rf"<!-- {name}:start -->\s*```bash\n(.*?)```\s*<!-- {name}:end -->", readme, re.S)
    assert block, f"README lost its {name} block"
    return block.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None, reason="curl or jq not installed")
def test_readme_walkthrough_verbatim(tmp_path: Path) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    kvgate = Path(sys.executable).with_name("kvgate")
    server = subprocess.Popen(
        [str(kvgate), "serve", "--dev", "--no-engine", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"server exited: {server.stdout.read() if server.stdout else ''}")
                time.sleep(0.1)
        # The roles walk-through continues the first in the same shell (it uses $A, $KVGATE_ADMIN, acme).
        script = (_walkthrough() + _walkthrough("roles-walkthrough")).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        outputs = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        pool, added, drained, replicas, cls, tenant, view, key, audit, *roles = outputs
        assert (pool["name"], cls["name"], tenant["slug"]) == ("gpu-a", "chat-gold", "acme")
        assert (added["name"], drained["name"], drained["state"]) == ("r1", "r0", "draining")
        assert [(r["name"], r["state"]) for r in replicas] == [("r0", "draining"), ("r1", "active")]
        assert [s["tier_on_eviction"] for s in view["segments"]] == ["host", "host", "dropped", "dropped"]
        assert key["key"].startswith(f"kvg_{key['prefix']}_")
        # Newest first: our six changes.
        assert [e["action"] for e in audit["items"]] == [
            "api_key.create",
            "tenant.create",
            "retention_class.create",
            "pool_replica.drain",
            "pool_replica.create",
            "pool.create",
        ]
        whoami, own_key, own_keys, foreign, listed, capped, raised, above, refused = roles
        assert whoami == {"name": "acme-ops", "role": "tenant-admin", "tenants": ["acme"]}
        assert own_key["key"].startswith("kvg_") and [k["name"] for k in own_keys["items"]] == ["first-key", "ci"]
        assert foreign == {"error": {"code": "tenant_not_found", "message": "tenant 'demo' does not exist",
                                     "field": None}}
        assert [t["slug"] for t in listed["items"]] == ["acme"] and listed["total"] == 1
        assert capped["limit_caps"] == {"rpm_limit": 1200} and raised["rpm_limit"] == 1200
        assert above["error"]["code"] == "limit_above_cap"
        assert refused == 401
    finally:
        server.terminate()
        try:
            out, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            out, _ = server.communicate()
    assert "DEV MODE" in out and (tmp_path / ".kvgate-dev-admin-token").exists() and (tmp_path / "kvgate.db").exists()
