"""A real Prometheus scrapes a live gateway: every dashboard query and shipped rule must work.

Nothing is mocked: Debian's ``prometheus`` binary (``.ci/run`` installs it when missing)
scrapes the gateway of a real stack (reference engine process + gateway over HTTP), loads
``deploy/prometheus-rules.yml`` as shipped, and answers over its HTTP API:

* ``promtool check rules`` / ``check config`` accept the shipped rules and a config using them;
* every recording and alert rule evaluates with health ``ok``, and every recording rule
  returns series once traffic has flowed;
* every Grafana panel query (``$pool`` = all) parses and returns series;
* killing the engine turns ``kvgate_engine_up`` to 0 and ``KvgateEngineDown`` pending.

Traffic is shaped so that each series exists: distinct long prompts overflow a small GPU
pool (evictions, offloads to host), a repeat of the oldest prompt comes back from the host
tier (``host_hit``), a repeat of the newest from GPU (``gpu_hit``), and a tenant with an
rpm limit of 1 is refused (429).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server.gateway.stack import build_stack, free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus-rules.yml"
DASHBOARD = ROOT / "deploy/grafana/dashboards/kvgate.json"
TPB = 16
ENGINE_ARGS = ["--tokens-per-block", str(TPB), "--primary-blocks", "64", "--secondary-blocks", "128",
               "--max-input-len", "512", "--max-output-len", "32", "--max-batch-size", "4"]

pytestmark = pytest.mark.slow


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found: install Debian's 'prometheus' package (.ci/run does when missing)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    built = build_stack(tmp_path_factory.mktemp("promstack"), engine_args=ENGINE_ARGS, tokens_per_block=TPB,
                        primary=64, secondary=128, offload_min_priority=30, settings={"mrc_sample_rate": 1.0})
    yield built
    built.gateway.stop()
    built.engine.kill()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    binary = _binary("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    gateway = stack.gateway.base_url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "kvgate-gateway", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [gateway]}]}],
    }
    config_path = tmp / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    promtool = _binary("promtool")
    checked = subprocess.run([promtool, "check", "config", str(config_path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={config_path}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            try:
                if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def query(base: str, expr: str) -> list[dict]:
    body = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _prompt(i: int) -> str:
    # ~300 tokens per prompt, distinct from the first token on: 4 of them fill the 64-block GPU pool.
    return f"Document {i}: " + " ".join(f"item{i}-{j}" for j in range(60))


def _chat(client: httpx.Client, key: str, system: str) -> httpx.Response:
    body = {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}]}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        text = response.read().decode()
    # A streamed request that fails after the headers reports the error in the stream.
    assert response.status_code != 200 or '"error"' not in text, text[-500:]
    return response


def test_promtool_accepts_the_shipped_rules():
    promtool = _binary("promtool")
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_dashboards_and_rules_against_a_live_gateway(stack, prometheus):
    key = stack.add_tenant("acme", kv_quota_fraction=1.0)  # over a quota its new blocks would be demoted and dropped, not offloaded
    limited = stack.add_tenant("limited", rpm_limit=1)
    wait_for(lambda: query(prometheus, 'up{job="kvgate-gateway"} == 1'), 30, "the first scrape")
    with httpx.Client(base_url=stack.gateway.base_url, timeout=120) as client:
        for i in range(7):  # overflow the GPU tier: the oldest prompts are offloaded to host
            assert _chat(client, key, _prompt(i)).status_code == 200
        assert _chat(client, key, _prompt(0)).status_code == 200  # back from the host tier
        assert _chat(client, key, _prompt(6)).status_code == 200  # still in GPU memory
        assert _chat(client, limited, _prompt(9)).status_code == 200
        assert _chat(client, limited, _prompt(9)).status_code == 429

    # Every outcome label the traffic produced is visible (hit quality, not hit counts).
    outcomes = wait_for(lambda: {r["metric"]["cache"] for r in query(prometheus, "kvgate_ttft_by_cache_seconds_count")}
                        >= {"miss", "gpu_hit", "host_hit"} and
                        {r["metric"]["cache"] for r in query(prometheus, "kvgate_ttft_by_cache_seconds_count")},
                        30, "TTFT series for gpu_hit, host_hit and miss")
    assert outcomes == {"miss", "gpu_hit", "host_hit"}

    groups = json.loads(httpx.get(f"{prometheus}/api/v1/rules", timeout=10).text)["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    shipped = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert len(rules) == len(shipped)
    records = [r["record"] for r in shipped if "record" in r]

    def recorded_everything():
        return all(query(prometheus, name) for name in records)

    try:
        wait_for(recorded_everything, 60, "every recording rule to return series")
    except AssertionError:
        missing = [name for name in records if not query(prometheus, name)]
        raise AssertionError(f"recording rules without series: {missing}") from None
    groups = json.loads(httpx.get(f"{prometheus}/api/v1/rules", timeout=10).text)["data"]["groups"]
    for group in groups:
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))

    def finite_p99():
        # A recording evaluated before two scrapes saw the traffic holds NaN (no rate yet):
        # wait for an evaluation (every 15 s) that covers it.
        found = query(prometheus, 'kvgate:ttft_seconds:p99_5m{pool="reference"}')
        return found and math.isfinite(float(found[0]["value"][1])) and float(found[0]["value"][1]) > 0

    wait_for(finite_p99, 45, "a finite p99 TTFT recording")
    # The error ratio is a real 0 (nothing failed), the engine is up, no alert fires.
    [errors] = query(prometheus, 'kvgate:requests:error_ratio_5m{pool="reference"}')
    assert float(errors["value"][1]) == 0.0
    assert query(prometheus, 'ALERTS{alertname="KvgateEngineDown"}') == []

    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$pool", ".*")
            # A rate() over a series the last request created (the 429 counter) has no value
            # until two scrapes hold it; the waits above may all have been met in under a second.
            wait_for(lambda: query(prometheus, expr), 20, f"panel {panel['title']!r} to return series: {expr}")

    # The engine dies: the gauge drops to 0 and the alert goes pending (its `for` is 1m).
    stack.engine.kill()
    wait_for(lambda: query(prometheus, 'kvgate_engine_up{pool="reference"} == 0'), 30, "kvgate_engine_up to drop")
    wait_for(lambda: query(prometheus, 'ALERTS{alertname="KvgateEngineDown", alertstate="pending"}'), 40,
             "KvgateEngineDown to go pending")
