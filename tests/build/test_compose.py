"""docker-compose.yml, Dockerfiles and deploy/ validated statically (no Docker engine here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from engines.spec import bundled_spec_names, load_bundled_spec, reference_settings
from server.cli import create_cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
VAR = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")


def resolve(text: str) -> str:
    """Compose interpolation with every variable unset: defaults apply, ${X:?msg} stays visible."""
    return VAR.sub(lambda m: m.group(3) if m.group(2) == "-" else f"<required {m.group(1)}>", text)


def flags(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--") and not argv[i + 1].startswith("--")}


def cli_options(*command: str) -> set[str]:
    result = CliRunner().invoke(create_cli(), [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return set(re.findall(r"--[a-z][a-z-]*", result.output))


def test_services_and_profiles():
    assert set(SERVICES) == {"postgres", "migrate", "gateway", "engine-cpu", "engine-builder", "triton", "prometheus", "grafana",
                             "registry-apply"}
    profiles = {name: tuple(s.get("profiles", ())) for name, s in SERVICES.items()}
    assert profiles == {
        "postgres": (), "migrate": (), "gateway": (), "prometheus": (), "grafana": (),
        "engine-cpu": ("cpu",), "engine-builder": ("gpu",), "triton": ("gpu",), "registry-apply": ("registry",),
    }


def test_long_running_services_have_healthchecks_and_one_shots_do_not_restart():
    for name, service in SERVICES.items():
        if name in ("migrate", "engine-builder", "registry-apply"):
            assert service["restart"] == "no", name
            continue
        assert service["restart"] == "unless-stopped", name
        check = service["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL") and check["retries"] >= 3, name


def test_dependencies_wait_for_health_or_completion():
    gateway = SERVICES["gateway"]["depends_on"]
    assert gateway == {"postgres": {"condition": "service_healthy"}, "migrate": {"condition": "service_completed_successfully"}}
    assert SERVICES["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert SERVICES["triton"]["depends_on"] == {"engine-builder": {"condition": "service_completed_successfully"}}
    assert SERVICES["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}


def test_volumes_are_declared_and_bind_mounts_exist():
    declared = set(COMPOSE["volumes"])
    used = set()
    for name, service in SERVICES.items():
        for mount in service.get("volumes", []):
            source = resolve(mount).split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
            else:
                used.add(source)
    assert used == declared
    assert "pgdata:/var/lib/postgresql/data" in SERVICES["postgres"]["volumes"]
    assert "engines:/engines:ro" in SERVICES["triton"]["volumes"] and "models:/models:ro" in SERVICES["triton"]["volumes"]


def test_gateway_trace_dir_is_a_declared_volume_the_image_owns():
    """Live captures land in KVGATE_TRACE_DIR: it must be a named volume's mount (the files outlive
    the container) that the image creates owned by its non-root user (a new volume takes the
    ownership of the image's mount point; a path missing from the image would be root's)."""
    gateway = SERVICES["gateway"]
    trace_dir = gateway["environment"]["KVGATE_TRACE_DIR"]
    mounts = {m.split(":")[1]: m.split(":") for m in gateway["volumes"]}
    source, _, *mode = mounts[trace_dir]
    assert source in COMPOSE["volumes"] and "ro" not in mode
    dockerfile = (ROOT / "build/Dockerfile.gateway").read_text()
    user = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)[-1]
    assert re.search(rf"mkdir -p {re.escape(trace_dir)}\b", dockerfile)
    (owned,) = re.findall(rf"chown -R {user}:{user} (\S+)", dockerfile)
    assert trace_dir == owned or trace_dir.startswith(owned.rstrip("/") + "/")
    # the documented export reads the same directory
    readme = (ROOT / "README.md").read_text()
    assert "docker compose exec gateway kvgate trace export" in readme and f"-o {trace_dir}/" in readme


def test_images_build_from_files_that_exist():
    for name, service in SERVICES.items():
        if "build" in service:
            dockerfile = ROOT / service["build"]["context"] / service["build"]["dockerfile"]
            assert dockerfile.is_file(), name
            for line in dockerfile.read_text().splitlines():
                if line.startswith("COPY ") and "--from" not in line:
                    for source in line.split()[1:-1]:
                        assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} missing"


def test_gateway_image_runs_as_non_root():
    users = re.findall(r"^USER\s+(\S+)", (ROOT / "build/Dockerfile.gateway").read_text(), re.M)
    assert users and users[-1] not in ("root", "0")


def test_environment():
    env = {k: resolve(str(v)) for k, v in SERVICES["gateway"]["environment"].items()}
    assert env["KVGATE_DATABASE_URL"] == "postgresql+psycopg://kvgate:kvgate-local-only@postgres:5432/kvgate"
    assert env["KVGATE_ADMIN_TOKENS"] == "<required KVGATE_ADMIN_TOKENS>"  # no default secret
    assert env["KVGATE_KEY_PEPPER"] == "<required KVGATE_KEY_PEPPER>"
    assert resolve(SERVICES["migrate"]["environment"]["KVGATE_DATABASE_URL"]) == env["KVGATE_DATABASE_URL"]
    pg = SERVICES["postgres"]["environment"]
    assert (pg["POSTGRES_USER"], pg["POSTGRES_DB"]) == ("kvgate", "kvgate")
    assert resolve(SERVICES["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]) == "<required GRAFANA_ADMIN_PASSWORD>"
    assert "HF_TOKEN" in SERVICES["engine-builder"]["environment"]


def test_gateway_and_cpu_engine_commands_use_real_cli_flags():
    gateway = SERVICES["gateway"]["command"]
    assert gateway[:2] == ["kvgate", "serve"]
    assert {f for f in gateway if f.startswith("--")} <= cli_options("serve")
    engine = SERVICES["engine-cpu"]["command"]
    assert engine[:3] == ["kvgate", "engine", "serve"]
    assert {f for f in engine if f.startswith("--")} <= cli_options("engine", "serve")
    assert flags(engine)["--host"] == "0.0.0.0" and flags(engine)["--port"] == "8001"


def test_cpu_engine_flags_match_the_reference_spec():
    settings = reference_settings(load_bundled_spec("reference-smollm2"))
    given = flags(SERVICES["engine-cpu"]["command"])
    expected = {
        "--kv-dtype": settings["kv_dtype"],
        "--primary-blocks": settings["primary_blocks"],
        "--secondary-blocks": settings["secondary_blocks"],
        "--tokens-per-block": settings["tokens_per_block"],
        "--offload-min-priority": settings["secondary_offload_min_priority"],
        "--max-batch-size": settings["max_batch_size"],
        "--max-num-tokens": settings["max_num_tokens"],
        "--max-input-len": settings["max_input_len"],
        "--max-output-len": settings["max_output_len"],
    }
    assert {k: given[k] for k in expected} == {k: str(v) for k, v in expected.items()}


def test_both_profiles_expose_the_engine_under_one_name():
    for name in ("engine-cpu", "triton"):
        assert SERVICES[name]["networks"]["default"]["aliases"] == ["engine"]
    assert flags(SERVICES["triton"]["command"] + ["--x"]) == {}  # tritonserver uses --k=v
    assert "--grpc-port=8001" in SERVICES["triton"]["command"]


def test_gpu_services_reserve_nvidia_devices_and_pin_the_trtllm_image():
    for name in ("engine-builder", "triton"):
        devices = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}], name
        image_arg = resolve(SERVICES[name]["build"]["args"]["TRITON_IMAGE"])
        # the public NGC name (server r26.04 docs/introduction/compatibility.md); a bare
        # nvidia/... would resolve against Docker Hub
        assert image_arg == "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
    pins = {load_bundled_spec(n).tensorrt_llm.container for n in bundled_spec_names() if load_bundled_spec(n).tensorrt_llm}
    assert pins == {image_arg}
    dockerfile = (ROOT / "build/Dockerfile.triton").read_text()
    assert f"ARG TRITON_IMAGE={image_arg}" in dockerfile
    assert "COPY build/engine_builder.sh /usr/local/bin/kvgate-engine-builder" in dockerfile
    assert SERVICES["engine-builder"]["command"] == ["kvgate-engine-builder"]
    assert resolve(SERVICES["engine-builder"]["environment"]["KVGATE_ENGINE_SPECS"]) in bundled_spec_names()


def test_prometheus_scrapes_the_gateway_and_triton():
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets == {"kvgate-gateway": ["gateway:8000"], "triton": ["triton:8002"]}
    assert "--metrics-port=8002" in SERVICES["triton"]["command"]
    assert flags(SERVICES["gateway"]["command"])["--port"] == "8000"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard():
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    [ds] = datasource["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["uid"] == "kvgate-prometheus"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/kvgate.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in SERVICES["grafana"]["volumes"]


DASHBOARD = json.loads((ROOT / "deploy/grafana/dashboards/kvgate.json").read_text())
METRIC = re.compile(r"\bkvgate_[a-z_]+")


def dashboard_metrics() -> set[str]:
    names = set()
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            names |= set(METRIC.findall(target["expr"]))
    return {n.removesuffix("_bucket") for n in names}


def documented_metrics() -> set[str]:
    text = (ROOT / "deploy/README.md").read_text()
    table = text.split("<!-- metrics:begin -->")[1].split("<!-- metrics:end -->")[0]
    return set(re.findall(r"^\| `(kvgate_[a-z_]+)`", table, re.M))


def test_dashboard_covers_the_brief_and_uses_documented_metrics():
    titles = " | ".join(p["title"] for p in DASHBOARD["panels"])
    for needle in ("hit rate", "GPU tier", "host tier", "TTFT p50 / p99", "quota", "Evictions and offloads", "429"):
        assert needle in titles
    assert dashboard_metrics() <= documented_metrics()
    assert all(t["datasource"]["uid"] == "kvgate-prometheus" for p in DASHBOARD["panels"] for t in p["targets"])
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))


def test_the_gateway_exposes_every_documented_metric():
    metrics_module = pytest.importorskip("server.gateway.observe.metrics")
    from prometheus_client import CollectorRegistry, generate_latest

    from engines.pool_stats import PoolStatsReport, TierStats

    report = PoolStatsReport(tokens_per_block=32, primary=TierStats(8, 4, 4), secondary=TierStats(8, 8, 0), tenants={"t1": [1, 0]})
    snapshot = metrics_module.PoolSnapshot(pool="p", stats=report, tenant_slugs={"t1": "acme"}, tenant_quota_blocks={"acme": 4.0}, demoted={},
                                           replicas={"r0": report})
    registry = CollectorRegistry()
    gateway = metrics_module.GatewayMetrics(registry, snapshots=lambda: [snapshot], engine_up=lambda: {"p": True})
    from engines.contract import KvMetrics

    gateway.observe_request(tenant="acme", tenant_id=1, pool="p", status="ok", prompt_tokens=10, completion_tokens=3, ttft=0.1,
                            latency=0.3, kv=KvMetrics(reused_blocks=1, new_blocks=1, total_blocks=2, onboarded_blocks=1),
                            demoted=False, inter_token=0.1)
    gateway.rate_limited.labels(tenant="acme", limit="rpm").inc()
    gateway.cache_hints.labels(tenant="acme", pool="p", outcome="applied").inc()
    gateway.hinted_blocks.labels(tenant="acme", pool="p").inc()
    guard = metrics_module.SloGuardMetrics(registry, lambda: {"p": False})
    guard.observe(pool="p", arm="host", ttft=0.1, inter_token=0.01, cache="miss")
    from retention.types import DEFAULT_PLAN
    from server.gateway.observe.miss_ratio import MissRatioCollector, MissRatioCurves
    from tenants.snapshots import PoolSnapshot, ReplicaSnapshot

    curves = MissRatioCurves(1.0)
    pool = PoolSnapshot(id=1, name="p", model_name="m", triton_model="kvgate_llm", engine_spec="s", tokens_per_block=32,
                        primary_blocks=8, secondary_blocks=8, secondary_offload_min_priority=30,
                        replicas=(ReplicaSnapshot(id=1, name="r0", endpoint="h:1", state="active", weight=1),))
    for now in (0.0, 1.0):
        curves.observe(pool, [11 << 40, (12 << 40) | 1], DEFAULT_PLAN, now=now, num_tokens=70, tenant="t1")
    registry.register(MissRatioCollector(curves, lambda _pool: {"t1": "acme"}))
    exposed = set(re.findall(r"^(kvgate_[a-z_]+?)(?:_bucket|_count|_sum|_created)?[{ ]", generate_latest(registry).decode(), re.M))
    assert documented_metrics() <= exposed


@pytest.mark.parametrize("script", ["build/gpu_smoke.sh", "build/engine_builder.sh"])
def test_shell_scripts_parse_and_are_executable(script):
    path = ROOT / script
    assert os.access(path, os.X_OK)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_gpu_smoke_uses_services_that_exist():
    import shlex

    text = (ROOT / "build/gpu_smoke.sh").read_text().replace("\\\n", " ")
    used = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True) if line.strip().startswith("docker compose") else []
        if "run" in words:
            rest = words[words.index("run") + 1:]
            i = 0
            while rest[i].startswith("-"):
                i += 2 if rest[i] in ("-v", "--entrypoint") else 1
            used.append(rest[i])
        if "--wait" in words:
            used.append(words[-1])
    assert used == ["engine-builder", "triton", "gateway"]
    assert set(used) <= set(SERVICES)
    # the client the smoke script runs must at least import and parse its flags here
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "build/gpu_smoke_client.py"), "--help"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--prompt-tokens" in run.stdout, run.stderr


def test_registry_apply_one_shot_runs_the_real_command_on_the_mounted_example():
    """The optional `registry` profile applies the mounted file with `kvgate admin apply` after
    the migration, against the same database as the gateway; the default file is the example
    (which the registry tests apply twice)."""
    service = SERVICES["registry-apply"]
    command = service["command"]
    assert command[:3] == ["kvgate", "admin", "apply"]
    assert {f for f in command if f.startswith("-")} <= cli_options("admin", "apply") | {"-f"}
    source, target, mode = resolve(service["volumes"][0]).split(":")
    assert (source, mode) == ("./deploy/registry.example.yaml", "ro") and (ROOT / source).is_file()
    assert command[command.index("-f") + 1] == target
    assert resolve(service["environment"]["KVGATE_DATABASE_URL"]) == resolve(SERVICES["gateway"]["environment"]["KVGATE_DATABASE_URL"])
    assert service["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert service["restart"] == "no"


def test_the_gpu_profile_renders_a_repository_with_guided_decoding(tmp_path):
    """engine-builder runs build/engine_builder.sh: its `kvgate build repo` (real CLI here) must point the
    model's tokenizer_dir at the folder the same script saves the tokenizer to, on the volume Triton mounts."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    script = (ROOT / "build/engine_builder.sh").read_text()
    [repo_line] = [line for line in script.splitlines() if line.strip().startswith("kvgate build repo")]
    argv = repo_line.split()[1:]
    spec = SERVICES["engine-builder"]["environment"]["KVGATE_ENGINE_SPECS"]
    argv = [resolve(spec) if a == '"${specs[@]}"' else a for a in argv]
    argv[argv.index("--output") + 1] = str(tmp_path)
    result = CliRunner().invoke(create_cli(), argv)
    assert result.exit_code == 0, result.output
    config = text_format.Parse((tmp_path / "kvgate_llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    name = resolve(spec)
    assert config.parameters["tokenizer_dir"].string_value == f"/engines/tokenizers/{name}"
    # the builder saves the tokenizer with the same tokenizer_dir_for (test_the_builder_saves_the_tokenizer_...)
    assert "save_spec_tokenizer(sys.argv[1], sys.argv[2])" in script and '"$spec" /engines' in script
    assert "engines:/engines:ro" in SERVICES["triton"]["volumes"]


FAKE_TRANSFORMERS = """
import json, os
class _Tokenizer:
    def __init__(self, source):
        self.source = source
    def save_pretrained(self, directory):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer.json"), "w") as f:
            json.dump({"source": self.source}, f)
class AutoTokenizer:
    @staticmethod
    def from_pretrained(source):
        with open(os.environ["FAKE_TOKENIZER_LOG"], "a") as f:
            f.write(source + "\\n")
        return _Tokenizer(source)
"""


def test_the_builder_saves_the_tokenizer_of_a_spec_path_with_a_quote(tmp_path):
    """build/engine_builder.sh's tokenizer step, run by bash as the script has it: a YAML path (what
    `kvgate build engine` accepts) with a quote in it, saved to tokenizer_dir_for(spec), i.e. under the spec's
    name where `kvgate build repo` and the gateway look; downloaded once per tokenizer source."""
    script = (ROOT / "build/engine_builder.sh").read_text()
    [line] = [s.strip() for s in script.splitlines() if s.strip().startswith("python3 ")]
    assert line.endswith(' "$spec" /engines')
    fakes, shims = tmp_path / "fakes", tmp_path / "bin"
    (fakes / "transformers").mkdir(parents=True)
    (fakes / "transformers" / "__init__.py").write_text(FAKE_TRANSFORMERS)
    shims.mkdir()
    (shims / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (shims / "python3").chmod(0o755)
    data = load_bundled_spec("llama-3.1-8b-instruct-fp8kv").model_dump(mode="json")
    data["name"] = "custom-8b"
    data["model"]["tokenizer"] = "acme/o'brien \"tok\""
    spec_path = tmp_path / "it's specs" / "custom.yaml"
    spec_path.parent.mkdir()
    spec_path.write_text(yaml.safe_dump(data))
    log, engines = tmp_path / "downloads.log", tmp_path / "engines"
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "PYTHONPATH": f"{fakes}:{ROOT}",
           "FAKE_TOKENIZER_LOG": str(log)}

    def run() -> str:
        step = line.removesuffix("/engines") + '"$2"'
        done = subprocess.run(["bash", "-c", f"set -euo pipefail; spec=$1; {step}", "_", str(spec_path), str(engines)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "saved to" in run()
    saved = engines / "tokenizers" / "custom-8b" / "tokenizer.json"
    assert json.loads(saved.read_text()) == {"source": "acme/o'brien \"tok\""}
    assert "already in" in run() and log.read_text().splitlines() == ["acme/o'brien \"tok\""]
    data["model"]["tokenizer"] = "acme/other"
    spec_path.write_text(yaml.safe_dump(data))
    run()
    assert json.loads(saved.read_text()) == {"source": "acme/other"} and len(log.read_text().splitlines()) == 2
    assert sorted(p.name for p in (engines / "tokenizers").iterdir()) == ["custom-8b"]  # no staging leftovers
