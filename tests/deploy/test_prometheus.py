"""A real Prometheus scrapes a live gateway: every dashboard query and shipped rule must work.

Nothing is mocked: Debian's ``prometheus`` binary (``.ci/run`` installs it when missing)
scrapes the gateway of a real stack (reference engine process + gateway over HTTP), loads
``deploy/prometheus-rules.yml`` as shipped, and answers over its HTTP API:

* ``promtool check rules`` / ``check config`` accept the shipped rules and a config using them;
* every recording and alert rule evaluates with health ``ok``, and every recording rule
  returns series once traffic has flowed;
* every Grafana panel query (``$pool`` = all) parses and returns series;
* killing the engine turns ``kvgate_engine_up`` to 0 and ``KvgateEngineDown`` pending.

What each alert means is checked apart, with ``promtool test rules`` on synthetic series
written as several gateway pods export them (engine figures repeated per gateway, request
counters per gateway): which alerts fire, which stay quiet, and that engine figures are not
multiplied by the gateway count in the rules or on the dashboard.

Traffic is shaped so that each series exists: distinct long prompts overflow a small GPU
pool (evictions, offloads to host), a repeat of the oldest prompt comes back from the host
tier (``host_hit``), a repeat of the newest from GPU (``gpu_hit``), and a tenant with an
rpm limit of 1 is refused (429).
"""

from __future__ import annotations

import json
import math
import os
import re
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


# --- what the rules mean: `promtool test rules` on synthetic series --------------------------------
#
# Series are written as N gateways export them: every gateway pod polls the same engines, so an
# engine-level series (pool blocks and counters, tenant blocks) arrives N times with the same value,
# once per `instance`; per-gateway series (requests, 429s) each count that gateway's own requests.
# Engine counters are per replica (`replica`): a pool's rate adds its replicas' up.

GATEWAYS = ("gw-0", "gw-1", "gw-2")
RATE_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


def _series(metric: str, values: str, *, gateways: tuple[str, ...] = GATEWAYS, **labels: str) -> list[dict]:
    """``metric{labels}`` as each gateway of ``gateways`` exports it (promtool input_series)."""
    out = []
    for instance in gateways:
        inner = ", ".join(f'{k}="{v}"' for k, v in {**labels, "job": "kvgate-gateway", "instance": instance}.items())
        out.append({"series": f"{metric}{{{inner}}}", "values": values})
    return out


def _shipped_rules() -> dict[str, dict]:
    return {rule["alert"]: rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
            if "alert" in rule}


def _firing(alert: str, **labels: str) -> dict:
    """The exp_alerts entry promtool compares: the rule's labels and its annotations (promtool
    compares them all) templated with ``labels``."""
    rule = _shipped_rules()[alert]
    annotations = {}
    for name, text in rule["annotations"].items():
        for key, value in labels.items():
            text = text.replace(f"{{{{ $labels.{key} }}}}", value)
        assert "{{" not in text, text
        annotations[name] = text
    return {"exp_labels": {**labels, **rule["labels"]}, "exp_annotations": annotations}


def _promtool_test(tmp_path: Path, tests: list[dict], rule_files: tuple[Path, ...] = (RULES,)) -> None:
    promtool = _binary("promtool")
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(p) for p in rule_files], "evaluation_interval": "1m",
                                    "tests": tests}, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_engine_counters_are_not_multiplied_by_the_gateway_count(tmp_path):
    """One engine offloading 6 blocks/s, scraped through 3 gateways, offloads 6 blocks/s: under the
    thrash alert's 10 blocks/s floor (its ratio, 24 offloads per onboard, is over 20), so it does not fire.
    At 12 blocks/s it does."""
    def thrash(offloads_per_min: int) -> list[dict]:
        return [*_series("kvgate_pool_offloaded_blocks_total", f"0+{offloads_per_min}x40", pool="p", replica="r0"),
                *_series("kvgate_pool_onboarded_blocks_total", "0+15x40", pool="p", replica="r0")]  # 0.25 blocks/s

    _promtool_test(tmp_path, [
        {"interval": "1m", "input_series": thrash(360),
         "promql_expr_test": [
             {"expr": "kvgate:pool_offloaded_blocks:rate_5m", "eval_time": "30m",
              "exp_samples": [{"labels": 'kvgate:pool_offloaded_blocks:rate_5m{pool="p"}', "value": 6}]},
             {"expr": "kvgate:pool_offloads_per_onboard:ratio_5m", "eval_time": "30m",
              "exp_samples": [{"labels": 'kvgate:pool_offloads_per_onboard:ratio_5m{pool="p"}', "value": 24}]},
         ],
         "alert_rule_test": [{"alertname": "KvgateHostTierThrash", "eval_time": "35m", "exp_alerts": []}]},
        {"interval": "1m", "input_series": thrash(720),
         "alert_rule_test": [{"alertname": "KvgateHostTierThrash", "eval_time": "35m",
                              "exp_alerts": [_firing("KvgateHostTierThrash", pool="p")]}]},
    ])


def _exported_series(scrapes: list[dict], names: tuple[str, ...]) -> list[dict]:
    """The ``names`` series of one scrape a minute (``Fleet.scrape``) as each gateway of GATEWAYS
    exports them: every gateway polls the same engines. ``_`` where a scrape lacked the series."""
    keys = sorted({key for scrape in scrapes for key in scrape if key[0] in names})
    assert keys, f"no {names} series exported"
    out = []
    for name, labels in keys:
        values = " ".join(f"{scrape[(name, labels)]:.0f}" if (name, labels) in scrape else "_" for scrape in scrapes)
        out += _series(name, values, **dict(labels))
    return out


def test_the_offload_rate_stays_right_while_a_replica_leaves_rotation_and_restarts(tmp_path):
    """Two replicas each offload 4 blocks/s (240 a minute, 40 per onboard). From minute 10 to 30 r0
    flaps in and out of rotation (a request times out there, a later one is served), at minute 30
    its engine restarts. The series are the ones the gateway really exports for that (real
    routing, pool monitor and collector over fake engines): the pool offloads 8 blocks/s
    throughout, under the thrash alert's 10 blocks/s floor. A counter the gateway exported as the
    sum over the replicas in rotation went down each time r0 left and jumped by r0's whole total
    each time it came back: Prometheus read resets and rate() hundreds of blocks/s."""
    import asyncio

    from tests.server.gateway.test_pool_counters import COUNTERS, Fleet

    async def run() -> list[dict]:
        fleet = Fleet({"r0": 50_000, "r1": 40_000})
        scrapes = []
        for minute in range(41):
            out = 10 <= minute < 30 and (minute // 2) % 2 == 1
            r0 = fleet.replica("r0")
            if out and r0.breaker.closed:
                fleet.time_out("r0")
            elif not out and not r0.breaker.closed:
                fleet.serve("r0")
            if minute == 30:
                fleet.engines["r0"].restart()
            await fleet.minute()
            scrapes.append(fleet.scrape())
        return scrapes

    series = _exported_series(asyncio.run(run()), COUNTERS)
    rate = "kvgate:pool_offloaded_blocks:rate_5m"
    ratio = "kvgate:pool_offloads_per_onboard:ratio_5m"
    _promtool_test(tmp_path, [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [
            *({"expr": rate, "eval_time": f"{t}m", "exp_samples": [{"labels": f'{rate}{{pool="p"}}', "value": 8}]}
              for t in (9, 12, 15, 20, 25, 29, 32, 35, 40)),
            *({"expr": ratio, "eval_time": f"{t}m", "exp_samples": [{"labels": f'{ratio}{{pool="p"}}', "value": 40}]}
              for t in (9, 20, 32, 40)),
        ],
        "alert_rule_test": [{"alertname": "KvgateHostTierThrash", "eval_time": f"{t}m", "exp_alerts": []}
                            for t in (29, 35, 40)],
    }])


def test_gateway_down_fires_for_a_pod_down_and_for_no_pod_scraped_at_all(chart, tmp_path):
    """The chart's KvgateGatewayDown: a gateway pod scraped and failing, and every gateway pod gone
    (deployment scaled to 0, pods unschedulable or out of the service's endpoints), when no `up`
    series is left to compare with 0. Another namespace's gateway does not hide the absence. With
    the ServiceMonitor off nothing of the chart scrapes the gateway, so absence means nothing."""
    from tests.deploy.chart import ALL_APIS, NAMESPACE, minimal, render

    def rules(**monitoring) -> Path:
        r = render(chart, minimal(monitoring={"prometheusRule": {"enabled": True}, **monitoring}), api_versions=ALL_APIS)
        path = tmp_path / f"chart-rules-{len(monitoring)}.yml"
        path.write_text(yaml.safe_dump({"groups": r.get("PrometheusRule", "kvgate")["spec"]["groups"]}))
        return path

    def up(pod: str, values: str, namespace: str = NAMESPACE) -> dict:
        return {"series": f'up{{namespace="{namespace}", service="kvgate-gateway", job="kvgate-gateway", '
                          f'endpoint="http", pod="{pod}"}}', "values": values}

    scoped = {"namespace": NAMESPACE, "service": "kvgate-gateway", "severity": "critical"}
    _promtool_test(tmp_path, [
        {"name": "one pod of two down", "interval": "1m",
         "input_series": [up("kvgate-gateway-a", "0x10"), up("kvgate-gateway-b", "1x10")],
         "alert_rule_test": [{"alertname": "KvgateGatewayDown", "eval_time": "10m", "exp_alerts": [{
             "exp_labels": {**scoped, "job": "kvgate-gateway", "endpoint": "http", "pod": "kvgate-gateway-a"},
             "exp_annotations": {"summary": "kvgate gateway kvgate-gateway-a is not scraped"}}]}]},
        {"name": "every pod up", "interval": "1m",
         "input_series": [up("kvgate-gateway-a", "1x30"), up("kvgate-gateway-b", "1x30")],
         "alert_rule_test": [{"alertname": "KvgateGatewayDown", "eval_time": "20m", "exp_alerts": []}]},
        {"name": "every pod gone after 2 minutes; another namespace's gateway still up", "interval": "1m",
         "input_series": [up("kvgate-gateway-a", "1x2"), up("kvgate-gateway-b", "1x2"),
                          up("kvgate-gateway-x", "1x30", namespace="other")],
         "alert_rule_test": [
             {"alertname": "KvgateGatewayDown", "eval_time": "5m", "exp_alerts": []},  # `for` 5m
             {"alertname": "KvgateGatewayDown", "eval_time": "20m", "exp_alerts": [{
                 "exp_labels": scoped,
                 "exp_annotations": {"summary": "no kvgate gateway pod is scraped: none runs, or none is in "
                                                "the endpoints of service kvgate-gateway"}}]}]},
    ], rule_files=(rules(),))
    _promtool_test(tmp_path, [
        {"name": "no ServiceMonitor: nothing of the chart scrapes the gateway", "interval": "1m", "input_series": [],
         "alert_rule_test": [{"alertname": "KvgateGatewayDown", "eval_time": "20m", "exp_alerts": []}]},
    ], rule_files=(rules(serviceMonitor={"enabled": False}),))


def test_a_replica_down_alerts_on_its_own_and_the_pool_alert_says_the_pool(tmp_path):
    """KvgateReplicaDown: an active replica whose breaker is open on every gateway (r1). Not a replica
    only one gateway cannot reach (r2), nor one drained on purpose (r3). KvgateEngineDown stays quiet:
    the pool still answers through r0 and r2."""
    replicas = {"r0": ("1", "1", "1"), "r1": ("0", "0", "0"), "r2": ("0", "1", "1"), "r3": ("0", "0", "0")}
    series = []
    for replica, healthy in replicas.items():
        for instance, value in zip(GATEWAYS, healthy, strict=True):
            series += _series("kvgate_replica_healthy", f"{value}x20", gateways=(instance,), pool="p", replica=replica)
        state = "draining" if replica == "r3" else "active"
        series += _series("kvgate_replica_state", "1x20", pool="p", replica=replica, state=state)
    series += _series("kvgate_engine_up", "1x20", pool="p")
    _promtool_test(tmp_path, [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": "kvgate:replica_healthy:max", "eval_time": "10m", "exp_samples": [
            {"labels": f'kvgate:replica_healthy:max{{pool="p", replica="{r}"}}', "value": v}
            for r, v in (("r0", 1), ("r1", 0), ("r2", 1))]}],
        "alert_rule_test": [
            {"alertname": "KvgateReplicaDown", "eval_time": "10m", "exp_alerts": [_firing("KvgateReplicaDown", pool="p", replica="r1")]},
            {"alertname": "KvgateEngineDown", "eval_time": "10m", "exp_alerts": []},
        ],
    }])
    rules = _shipped_rules()
    assert "pool cannot serve" in rules["KvgateEngineDown"]["annotations"]["summary"]
    assert "other replicas" in rules["KvgateReplicaDown"]["annotations"]["summary"]


def test_a_full_gpu_kv_tier_alerts(tmp_path):
    """Under 2 % of a pool's GPU blocks free for 10 minutes (the same gauges from 3 gateways)."""
    series = []
    for pool, free in (("full", "10"), ("roomy", "100")):
        series += _series("kvgate_pool_blocks", f"{free}x30", pool=pool, tier="primary", state="free")
        series += _series("kvgate_pool_blocks", "1000x30", pool=pool, tier="primary", state="max")
        series += _series("kvgate_pool_blocks", "0x30", pool=pool, tier="secondary", state="free")  # no host tier left: not the GPU's
    _promtool_test(tmp_path, [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": "kvgate:pool_gpu_kv_free:ratio", "eval_time": "15m", "exp_samples": [
            {"labels": 'kvgate:pool_gpu_kv_free:ratio{pool="full"}', "value": 0.01},
            {"labels": 'kvgate:pool_gpu_kv_free:ratio{pool="roomy"}', "value": 0.1}]}],
        "alert_rule_test": [
            {"alertname": "KvgateGpuKvTierFull", "eval_time": "5m", "exp_alerts": []},  # not yet: `for` 10m
            {"alertname": "KvgateGpuKvTierFull", "eval_time": "15m", "exp_alerts": [_firing("KvgateGpuKvTierFull", pool="full")]},
        ],
    }])


def test_sustained_rate_limiting_alerts(tmp_path):
    """Over 10 % of a tenant's requests refused by its own limits for 15 minutes, summed over the gateways
    (each counts its own). acme: half refused; solo: every request refused (no served series at all);
    beta: a few in many; gamma: refused only because the limit store was down (503), not rate limiting."""
    series = [
        *_series("kvgate_rate_limited_total", "0+60x40", tenant="acme", limit="requests_per_minute"),
        *_series("kvgate_requests_total", "0+60x40", tenant="acme", pool="p", status="ok"),
        *_series("kvgate_rate_limited_total", "0+6x40", tenant="solo", limit="max_concurrent"),
        *_series("kvgate_rate_limited_total", "0+1x40", tenant="beta", limit="tokens_per_minute"),
        *_series("kvgate_requests_total", "0+600x40", tenant="beta", pool="p", status="ok"),
        *_series("kvgate_rate_limited_total", "0+60x40", tenant="gamma", limit="admission"),
        *_series("kvgate_requests_total", "0+60x40", tenant="gamma", pool="p", status="ok"),
    ]
    _promtool_test(tmp_path, [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": 'kvgate:tenant_rate_limited:ratio_5m{tenant=~"acme|solo|gamma"}', "eval_time": "30m",
                               "exp_samples": [{"labels": 'kvgate:tenant_rate_limited:ratio_5m{tenant="acme"}', "value": 0.5},
                                               {"labels": 'kvgate:tenant_rate_limited:ratio_5m{tenant="solo"}', "value": 1}]}],
        "alert_rule_test": [{"alertname": "KvgateTenantRateLimited", "eval_time": "30m", "exp_alerts": [
            _firing("KvgateTenantRateLimited", tenant="acme"), _firing("KvgateTenantRateLimited", tenant="solo")]}],
    }])
    assert set(RATE_LIMITS) | {"admission"} <= set(re.findall(r'limit="([a-z_]+)"', (ROOT / "server/gateway/admission.py").read_text()))


# Usage billing: each gateway its own recorder and journal (backlog and counters summed); the
# foreign-segment count is of a directory gateways may share (taken once).
USAGE = {"backlog": "kvgate_usage_backlog_rows", "failures": "kvgate_usage_flush_failures_total",
         "quarantined": "kvgate_usage_quarantined_batches_total", "unreadable": "kvgate_usage_unreadable_lines_total",
         "foreign": "kvgate_usage_foreign_segments"}


def _usage(minutes: int, **per_gateway: dict[str, str]) -> list[dict]:
    """kvgate_usage_* of the gateways named (``gw_0={"failures": "0+30x40"}``), every series not given held at 0."""
    out = []
    for gateway, given in per_gateway.items():
        for key, metric in USAGE.items():
            out += _series(metric, given.get(key, f"0x{minutes}"), gateways=(gateway.replace("_", "-"),))
    return out


def test_usage_not_reaching_the_registry_alerts_and_clears_once_it_does(tmp_path):
    """KvgateUsageFlushFailing: one gateway's flushes fail (30 a minute, one per 2 s flush) for 10 minutes
    with rows waiting. Quiet once the failures stop and the backlog drains, once they stop while traffic
    keeps rows in the open batches (within the 5-minute window), and for one failed flush."""
    fire = _firing("KvgateUsageFlushFailing")
    quiet = {"backlog": "20x42"}  # the other gateways: their open batches, flushed fine
    _promtool_test(tmp_path, [
        {"name": "registry away for gw-0", "interval": "1m",
         "input_series": _usage(40, gw_0={"failures": "0+30x40", "backlog": "800x40"}, gw_1=quiet, gw_2=quiet),
         "promql_expr_test": [
             {"expr": "kvgate:usage_flush_failures:increase_5m", "eval_time": "15m",
              "exp_samples": [{"labels": "kvgate:usage_flush_failures:increase_5m", "value": 150}]},
             {"expr": "kvgate:usage_backlog_rows:sum", "eval_time": "15m",
              "exp_samples": [{"labels": "kvgate:usage_backlog_rows:sum", "value": 840}]}],
         "alert_rule_test": [{"alertname": "KvgateUsageFlushFailing", "eval_time": "5m", "exp_alerts": []},  # `for` 10m
                             {"alertname": "KvgateUsageFlushFailing", "eval_time": "15m", "exp_alerts": [fire]}]},
        {"name": "registry back at minute 12, backlog drained", "interval": "1m",
         "input_series": _usage(42, gw_0={"failures": "0+30x12 360x30", "backlog": "800x12 0x30"}, gw_1={}, gw_2={}),
         "alert_rule_test": [{"alertname": "KvgateUsageFlushFailing", "eval_time": "12m", "exp_alerts": [fire]},
                             *({"alertname": "KvgateUsageFlushFailing", "eval_time": f"{t}m", "exp_alerts": []}
                               for t in (14, 30))]},  # one evaluation behind the recording
        {"name": "registry back at minute 12, traffic keeps rows in the open batches", "interval": "1m",
         "input_series": _usage(42, gw_0={"failures": "0+30x12 360x30", "backlog": "800x12 30x30"}, gw_1=quiet, gw_2=quiet),
         "alert_rule_test": [{"alertname": "KvgateUsageFlushFailing", "eval_time": "14m", "exp_alerts": [fire]},
                             *({"alertname": "KvgateUsageFlushFailing", "eval_time": f"{t}m", "exp_alerts": []}
                               for t in (18, 30))]},
        {"name": "one failed flush", "interval": "1m",
         "input_series": _usage(36, gw_0={"failures": "0x5 1x30", "backlog": "30x36"}, gw_1=quiet, gw_2=quiet),
         "alert_rule_test": [{"alertname": "KvgateUsageFlushFailing", "eval_time": f"{t}m", "exp_alerts": []}
                             for t in (8, 12, 20)]},
    ])


def test_a_quarantined_usage_batch_is_critical_for_an_hour(tmp_path):
    """KvgateUsageBatchQuarantined: any batch refused for good, by a running gateway (gw-1 at minute 71)
    or by a new pod before its first scrape (its series appears at 1). Not a counter a restart reset."""
    fire = _firing("KvgateUsageBatchQuarantined")
    assert fire["exp_labels"] == {"severity": "critical"}
    _promtool_test(tmp_path, [
        {"name": "gw-1 quarantines a batch", "interval": "1m",
         "input_series": _usage(140, gw_0={}, gw_1={"quarantined": "0x70 1x70"}, gw_2={}),
         "alert_rule_test": [{"alertname": "KvgateUsageBatchQuarantined", "eval_time": "65m", "exp_alerts": []},
                             {"alertname": "KvgateUsageBatchQuarantined", "eval_time": "72m", "exp_alerts": [fire]},
                             {"alertname": "KvgateUsageBatchQuarantined", "eval_time": "125m", "exp_alerts": [fire]},
                             {"alertname": "KvgateUsageBatchQuarantined", "eval_time": "135m", "exp_alerts": []}]},
        {"name": "a new pod quarantined a replayed batch before its first scrape", "interval": "1m",
         "input_series": _usage(140, gw_0={}, gw_1={}, gw_3={key: "_x70 " + ("1x70" if key == "quarantined" else "0x70")
                                                             for key in USAGE}),
         "promql_expr_test": [{"expr": "kvgate:usage_quarantined_batches:increase_1h", "eval_time": "75m",
                               "exp_samples": [{"labels": "kvgate:usage_quarantined_batches:increase_1h", "value": 1}]}],
         "alert_rule_test": [{"alertname": "KvgateUsageBatchQuarantined", "eval_time": "75m", "exp_alerts": [fire]},
                             {"alertname": "KvgateUsageBatchQuarantined", "eval_time": "140m", "exp_alerts": []}]},
        {"name": "gw-0 restarted: its counter went from 2 back to 0", "interval": "1m",
         "input_series": _usage(140, gw_0={"quarantined": "2x70 0x70"}, gw_1={}, gw_2={}),
         "alert_rule_test": [{"alertname": "KvgateUsageBatchQuarantined", "eval_time": f"{t}m", "exp_alerts": []}
                             for t in (75, 100)]},
    ])
    description = _shipped_rules()["KvgateUsageBatchQuarantined"]["annotations"]["description"]
    for needed in ("quarantine/", "KVGATE_USAGE_JOURNAL_DIR", "flush id", "at most once", "emptyDir"):
        assert needed in description, needed


def test_unreadable_journal_lines_and_foreign_segments_warn(tmp_path):
    """KvgateUsageJournalUnreadable: lines skipped at replay, by a new pod as it starts (gw-3) or by a running
    one adopting a later chunk (gw-0). KvgateUsageForeignSegments: two gateways sharing a directory both see
    its 2 foreign segments: 2, not 4."""
    unreadable, foreign = _firing("KvgateUsageJournalUnreadable"), _firing("KvgateUsageForeignSegments")
    _promtool_test(tmp_path, [
        {"name": "skipped lines and foreign segments", "interval": "1m",
         "input_series": _usage(140, gw_0={"unreadable": "0x70 3x70"}, gw_1={"foreign": "2x140"},
                                gw_2={"foreign": "2x140"},
                                gw_3={key: "_x10 " + ("2x130" if key == "unreadable" else "0x130") for key in USAGE}),
         "promql_expr_test": [
             {"expr": "kvgate:usage_unreadable_lines:increase_1h", "eval_time": "15m",
              "exp_samples": [{"labels": "kvgate:usage_unreadable_lines:increase_1h", "value": 2}]},
             {"expr": "kvgate:usage_foreign_segments:max", "eval_time": "15m",
              "exp_samples": [{"labels": "kvgate:usage_foreign_segments:max", "value": 2}]}],
         "alert_rule_test": [
             *({"alertname": "KvgateUsageJournalUnreadable", "eval_time": f"{t}m", "exp_alerts": [unreadable]}
               for t in (15, 75)),
             {"alertname": "KvgateUsageJournalUnreadable", "eval_time": "140m", "exp_alerts": []},
             {"alertname": "KvgateUsageForeignSegments", "eval_time": "5m", "exp_alerts": [foreign]}]},
        {"name": "a clean journal", "interval": "1m", "input_series": _usage(90, gw_0={}, gw_1={}, gw_2={}),
         "alert_rule_test": [{"alertname": name, "eval_time": f"{t}m", "exp_alerts": []}
                             for name in ("KvgateUsageJournalUnreadable", "KvgateUsageForeignSegments",
                                          "KvgateUsageBatchQuarantined", "KvgateUsageFlushFailing")
                             for t in (30, 90)]},
    ])
    description = _shipped_rules()["KvgateUsageForeignSegments"]["annotations"]["description"]
    for needed in ("KVGATE_USAGE_JOURNAL_DIR", "KVGATE_DATABASE_URL", "flush id"):
        assert needed in description, needed


# Engine-level series as 3 gateways export them, and what each dashboard panel reading them must show:
# the engine's figures once, whatever the number of gateways.
ENGINE_SERIES = [
    *_series("kvgate_pool_blocks", "900x40", pool="p", tier="primary", state="used"),
    *_series("kvgate_pool_blocks", "100x40", pool="p", tier="primary", state="free"),
    *_series("kvgate_pool_blocks", "1000x40", pool="p", tier="primary", state="max"),
    *_series("kvgate_pool_offloaded_blocks_total", "0+180x40", pool="p", replica="r0"),  # 3 blocks/s each
    *_series("kvgate_pool_offloaded_blocks_total", "0+180x40", pool="p", replica="r1"),
    *_series("kvgate_pool_evicted_blocks_total", "0+20x40", pool="p", replica="r0"),
    *_series("kvgate_pool_evicted_blocks_total", "0+40x40", pool="p", replica="r1"),
    *_series("kvgate_tenant_kv_blocks", "300x40", tenant="acme", pool="p", tier="primary"),
    *_series("kvgate_tenant_kv_blocks", "40x40", tenant="acme", pool="p", tier="secondary"),
    *_series("kvgate_tenant_kv_quota_ratio", "0.5x40", tenant="acme", pool="p"),
    *_series("kvgate_engine_up", "1x40", pool="p"),
    *_series("kvgate_slo_guard_tripped", "0x40", pool="p"),
]
ENGINE_PANELS = {
    ("KV quota use per tenant (primary blocks held / allowed)", "A"): [('{pool="p", tenant="acme"}', 0.5)],
    ("KV blocks per tenant and tier", "A"): [('{tenant="acme", tier="primary"}', 300), ('{tenant="acme", tier="secondary"}', 40)],
    ("Pool blocks by tier and state", "A"): [('{pool="p", state="free", tier="primary"}', 100),
                                             ('{pool="p", state="used", tier="primary"}', 900)],
    ("Evictions and offloads per pool (blocks/s)", "A"): [('{pool="p"}', 1)],
    ("Evictions and offloads per pool (blocks/s)", "B"): [('{pool="p"}', 6)],
    ("Engine answering the stats call (1 = up)", "A"): [('{pool="p"}', 1)],
    ("SLO guard: host tier rolled back (1 = tripped)", "A"): [('{pool="p"}', 0)],
}
ENGINE_METRICS = re.compile(r"kvgate_(pool_[a-z_]+|tenant_kv_[a-z_]+|engine_up|slo_guard_tripped)\b")


def test_dashboard_shows_engine_figures_once_whatever_the_gateway_count(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    targets = {(p["title"], t["refId"]): t["expr"] for p in dashboard["panels"] for t in p["targets"]}
    # every panel reading an engine-level series is checked here
    assert {key for key, expr in targets.items() if ENGINE_METRICS.search(expr)} == set(ENGINE_PANELS)
    _promtool_test(tmp_path, [{
        "interval": "1m", "input_series": ENGINE_SERIES,
        "promql_expr_test": [
            {"expr": targets[key].replace("$pool", ".*"), "eval_time": "30m",
             "exp_samples": [{"labels": labels, "value": value} for labels, value in samples]}
            for key, samples in ENGINE_PANELS.items()],
    }])


def test_every_series_the_rules_read_is_one_the_gateway_exports():
    """The names and labels the rules select are the gateway's own (metrics.py collectors, fed as the
    services feed them), so a rule cannot silently select nothing."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from engines.contract import KvMetrics
    from engines.pool_stats import PoolStatsReport, TierStats
    from server.gateway.observe import metrics
    from server.gateway.usage import UsageRecorder

    report = PoolStatsReport(tokens_per_block=32, primary=TierStats(8, 4, 4), secondary=TierStats(8, 8, 0),
                             tenants={"t1": [1, 0]}, offloaded_blocks=3, onboarded_blocks=1)
    snapshot = metrics.PoolSnapshot(pool="p", stats=report, tenant_slugs={"t1": "acme"},
                                    tenant_quota_blocks={"acme": 4.0}, demoted={}, replicas={"r0": report})
    registry = CollectorRegistry()
    gateway = metrics.GatewayMetrics(registry, snapshots=lambda: [snapshot], engine_up=lambda: {"p": True})
    gateway.watch_replicas(lambda: [metrics.ReplicaRow("p", "r0", "active", True, 0, "precise")])
    metrics.SloGuardMetrics(registry, lambda: {"p": False})
    gateway.observe_request(tenant="acme", tenant_id=1, pool="p", status="ok", prompt_tokens=10, completion_tokens=3, ttft=0.1,
                            latency=0.3, kv=KvMetrics(reused_blocks=1, new_blocks=1, total_blocks=2, onboarded_blocks=1),
                            demoted=False, inter_token=0.1)
    for limit in RATE_LIMITS:
        gateway.rate_limited.labels(tenant="acme", limit=limit).inc()
    usage = {"backlog_rows": 5, "pending_batches": 1, "pending_segments": 2, "flush_failures": 3,
             "quarantined_batches": 1, "unreadable_lines": 4, "foreign_segments": 6}
    assert set(usage) == set(UsageRecorder(lambda: None).stats())  # fed as the gateway feeds it
    gateway.watch_usage(lambda: usage)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}
    shipped = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    used = {name for rule in shipped for name in re.findall(r"\bkvgate_[a-z_]+", rule["expr"])}
    assert used and used <= {name for name, _ in samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("kvgate_replica_state", pool="p", replica="r0", state="active") == 1
    assert value("kvgate_replica_healthy", pool="p", replica="r0") == 1
    assert value("kvgate_pool_blocks", pool="p", tier="primary", state="free") == 4
    assert value("kvgate_pool_blocks", pool="p", tier="primary", state="max") == 8
    assert value("kvgate_pool_offloaded_blocks_total", pool="p", replica="r0") == 3
    assert value("kvgate_pool_onboarded_blocks_total", pool="p", replica="r0") == 1
    for limit in RATE_LIMITS:
        assert value("kvgate_rate_limited_total", tenant="acme", limit=limit) == 1
    for name, key in (("kvgate_usage_backlog_rows", "backlog_rows"), ("kvgate_usage_foreign_segments", "foreign_segments"),
                      ("kvgate_usage_flush_failures_total", "flush_failures"),
                      ("kvgate_usage_quarantined_batches_total", "quarantined_batches"),
                      ("kvgate_usage_unreadable_lines_total", "unreadable_lines")):
        assert value(name) == usage[key]
