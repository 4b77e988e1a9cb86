"""The chart's operations: the registry apply hook's pruning, the engine builder Job (its name, placement
and GPUs), the gateway's shutdown, and values that must reach every pod."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from engines.spec import load_bundled_spec
from server.cli import create_cli
from tests.deploy.chart import ALL_APIS, CHART, ROOT, Rendered, gateway, hook, minimal, pod_templates, pools_of, render, workload


# --- registry pruning ------------------------------------------------------------------------------


def _apply_argv(r: Rendered, path: Path) -> list[str]:
    """The apply hook's argv (after `kvgate`), reading ``path`` instead of the mounted ConfigMap."""
    (c,) = r.get("Job", "kvgate-registry-apply")["spec"]["template"]["spec"]["containers"]
    argv = list(c["command"])
    assert argv[:3] == ["kvgate", "admin", "apply"]
    argv[argv.index("-f") + 1] = str(path)
    return argv[1:]


def test_registry_apply_prunes_only_the_kinds_the_chart_declares(chart, tmp_path, monkeypatch):
    """The apply hook, run by the real CLI on a real registry: a pool dropped from values and the replica
    of a scaled-down pool are deleted; a retention class and a tenant made with the admin API are kept
    while values list none; once values list tenants and classes, the chart owns those kinds too."""
    from typer.testing import CliRunner

    monkeypatch.setenv("KVGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'registry.db'}")
    monkeypatch.setenv("KVGATE_KEY_PEPPER", "chart-test-pepper-0123456789abcdef")
    monkeypatch.delenv("KVGATE_DEV", raising=False)
    runner, cli = CliRunner(), create_cli()

    def run(*args: str, code: int = 0) -> str:
        result = runner.invoke(cli, list(args))
        assert result.exit_code == code, (args, result.output)
        return result.output

    def apply(values: dict[str, Any], code: int = 0) -> str:
        values = {**values, "registry": {**values.get("registry", {}), "prune": True}}
        r = render(chart, values)
        path = tmp_path / "registry.yaml"
        path.write_text(r.get("ConfigMap", "kvgate-registry")["data"]["registry.yaml"])
        return run(*_apply_argv(r, path), code=code)

    def names(kind: str) -> set[str]:
        page = json.loads(run("admin", kind, "list"))
        return {item.get("name", item.get("slug")) for item in page["items"]}

    reference = {"name": "reference", "spec": "reference-smollm2", "registry": {"model_name": "smollm2-135m-instruct"}}
    extra = {"name": "extra", "spec": "reference-smollm2", "replicas": 1, "registry": {"model_name": "other"}}
    run("db", "upgrade")
    apply(minimal(pools=[{**reference, "replicas": 2}, extra]))
    assert names("pools") == {"reference", "extra"}
    run("admin", "classes", "create", "gold")
    run("admin", "tenants", "create", "walkin", "--pool", "reference", "--class", "gold")

    out = apply(minimal(pools=[{**reference, "replicas": 1}]))
    assert "- pool extra" in out and "- replica reference/r1" in out
    assert names("pools") == {"reference"}
    assert [r["name"] for r in json.loads(run("admin", "replicas", "list", "reference"))] == ["r0"]
    assert names("classes") == {"gold"} and names("tenants") == {"walkin"}  # not the chart's: kept
    assert "no changes" in apply(minimal(pools=[{**reference, "replicas": 1}]))
    # a pool a tenant still uses is not pruned: the apply fails and writes nothing
    assert "pool_in_use" in apply(minimal(pools=[extra]), code=1)
    assert names("pools") == {"reference"}

    owned = {"retention_classes": [{"name": "chat"}],
             "tenants": [{"slug": "demo", "display_name": "Demo", "pool": "reference", "retention_class": "chat"}]}
    out = apply(minimal(pools=[{**reference, "replicas": 1}], registry=owned))
    assert "- tenant walkin" in out and "- retention_class gold" in out
    assert names("classes") == {"chat"} and names("tenants") == {"demo"}


def test_the_registry_file_declares_tenants_and_classes_only_when_values_list_them(chart):
    registry = yaml.safe_load(render(chart, minimal()).get("ConfigMap", "kvgate-registry")["data"]["registry.yaml"])
    assert set(registry) == {"pools"}
    owned = {"retention_classes": [{"name": "chat"}], "tenants": []}
    registry = yaml.safe_load(render(chart, minimal(registry=owned)).get("ConfigMap", "kvgate-registry")["data"]["registry.yaml"])
    assert set(registry) == {"pools", "retention_classes"}
    # registry.prune false (the default): apply adds and updates, never deletes; true: --prune
    for prune, argv in ((False, False), (True, True)):
        r = render(chart, minimal(registry={"prune": prune}))
        command = r.get("Job", "kvgate-registry-apply")["spec"]["template"]["spec"]["containers"][0]["command"]
        assert ("--prune" in command) is argv


# --- the engine builder ------------------------------------------------------------------------------


def _builders(r: Rendered) -> dict[str, dict[str, Any]]:
    """The engine-builder Jobs by the spec they build."""
    jobs = [j for j in r.of_kind("Job") if j["metadata"]["labels"]["app.kubernetes.io/component"] == "engine-builder"]
    return {j["metadata"]["labels"]["kvgate.io/spec"]: j for j in jobs}


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _chart_copy(tmp_path: Path) -> Path:
    """A copy of the chart with its links resolved, to change Chart.yaml or a spec file."""
    copied = tmp_path / "kvgate"
    shutil.copytree(CHART, copied, symlinks=False)
    return copied


def test_builder_job_name_covers_everything_in_the_job(chart, renders, tmp_path):
    """A Job's pod template is immutable: anything that changes it must give the Job a new name, or
    `helm upgrade` fails patching it (a new image, chart version, resources, placement). The spec
    file's own content is in the name too, so a changed spec gets a new build."""
    base = renders["gpu-8b-4-replicas"]
    job = _builders(base)["llama-3.1-8b-instruct-fp8kv"]
    variants = {
        "triton image": {"engines": {"tritonImage": {"tag": "0.2.0"}}},
        "pull policy": {"engines": {"tritonImage": {"pullPolicy": "Always"}}},
        "builder resources": {"engines": {"builder": {"resources": {"requests": {"cpu": "16", "memory": "128Gi"}}}}},
        "builder deadline": {"engines": {"builder": {"activeDeadlineSeconds": 3600}}},
        "gpu placement": {"engines": {"gpu": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}}}},
        "hf token key": {"secrets": {"keys": {"hfToken": "hf-token-2"}}},
    }
    for what, override in variants.items():
        other = _builders(render(chart, _merged(base.values, override), api_versions=ALL_APIS))["llama-3.1-8b-instruct-fp8kv"]
        assert other["spec"] != job["spec"], what
        assert other["metadata"]["name"] != job["metadata"]["name"], what
    copied = _chart_copy(tmp_path)
    chart_yaml = copied / "Chart.yaml"
    chart_yaml.write_text(chart_yaml.read_text().replace("version: 0.1.0", "version: 0.1.1", 1))
    with helm_python.Chart.load(copied) as bumped:
        other = _builders(render(bumped, base.values, api_versions=ALL_APIS))["llama-3.1-8b-instruct-fp8kv"]
    assert other["spec"]["template"]["metadata"]["labels"]["helm.sh/chart"] == "kvgate-0.1.1"
    assert other["metadata"]["name"] != job["metadata"]["name"]
    chart_yaml.write_text(chart_yaml.read_text().replace("version: 0.1.1", "version: 0.1.0", 1))
    spec_file = copied / "files" / "specs" / "llama-3.1-8b-instruct-fp8kv.yaml"
    spec_file.write_text(spec_file.read_text() + "\n# edited\n")
    with helm_python.Chart.load(copied) as edited:
        other = _builders(render(edited, base.values, api_versions=ALL_APIS))["llama-3.1-8b-instruct-fp8kv"]
    assert other["spec"] == job["spec"] and other["metadata"]["name"] != job["metadata"]["name"]
    # a normal release object, not a hook: created with the engine pods, which wait for its manifest
    assert "helm.sh/hook" not in job["metadata"].get("annotations", {})


def test_builder_runs_where_its_pool_runs(rendered):
    """The builder lands on the nodes its pool's engine pods use (the same nodeSelector and tolerations)
    and asks for the GPUs one engine pod holds: a multi-node pool's nodes need not have the world size."""
    builders = _builders(rendered)
    seen = set()
    for pool in pools_of(rendered):
        spec = load_bundled_spec(pool["spec"])
        if spec.backend != "tensorrt_llm" or spec.name in seen:
            continue
        seen.add(spec.name)  # the first pool of a spec places its build
        job = builders[spec.name]["spec"]["template"]["spec"]
        (build,) = job["containers"]
        for template in pod_templates(workload(rendered, pool["name"])):
            engine = template["spec"]
            assert job.get("nodeSelector") == engine.get("nodeSelector")
            assert job["tolerations"] == engine["tolerations"]
            assert all(t in job["tolerations"] for t in pool.get("tolerations", []))
            gpus = engine["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
            assert build["resources"]["requests"]["nvidia.com/gpu"] == build["resources"]["limits"]["nvidia.com/gpu"] == gpus
            dshm = {v["name"]: v for v in engine["volumes"]}["dshm"]
            assert {v["name"]: v for v in job["volumes"]}["dshm"] == dshm
    assert seen == set(builders)


def test_builder_gpus_beyond_one_engine_pod_are_refused(chart, renders):
    values = renders["multinode-70b"].values
    with pytest.raises(helm_python.HelmRenderError, match=r"engines.builder.gpus: 8 .* 4 GPUs"):
        render(chart, _merged(values, {"engines": {"builder": {"gpus": 8}}}), api_versions=ALL_APIS)
    fewer = render(chart, _merged(values, {"engines": {"builder": {"gpus": 2}}}), api_versions=ALL_APIS)
    (build,) = _builders(fewer)["llama-3.1-70b-instruct-fp8-tp8"]["spec"]["template"]["spec"]["containers"]
    assert build["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_builder_resources_keep_their_limits(chart, renders):
    values = _merged(renders["gpu-8b-4-replicas"].values,
                     {"engines": {"builder": {"resources": {"requests": {"cpu": "8", "memory": "128Gi"},
                                                            "limits": {"memory": "192Gi"}}}}})
    (build,) = _builders(render(chart, values))["llama-3.1-8b-instruct-fp8kv"]["spec"]["template"]["spec"]["containers"]
    assert build["resources"] == {"requests": {"cpu": "8", "memory": "128Gi", "nvidia.com/gpu": 1},
                                  "limits": {"memory": "192Gi", "nvidia.com/gpu": 1}}


# --- gateway shutdown -----------------------------------------------------------------------------


def test_gateway_keeps_serving_until_the_endpoints_drop_it(chart, rendered):
    """preStop sleeps before SIGTERM, so the gateway (which refuses new requests on SIGTERM) is out of
    the Service endpoints and ingress backends first; the grace period covers the sleep and the drain.
    An exec `sleep`: the `sleep` lifecycle action needs Kubernetes 1.30 and the chart supports 1.29."""
    deployment, c = gateway(rendered)
    pod = deployment["spec"]["template"]["spec"]
    drain = int({e["name"]: e for e in c["env"]}["KVGATE_DRAIN_TIMEOUT"]["value"])
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}
    assert pod["terminationGracePeriodSeconds"] >= 10 + drain + 10
    assert "1.29" in yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert re.search(r"^FROM python:[0-9.]+-slim$", (ROOT / "build/Dockerfile.gateway").read_text(), re.M)  # Debian: has sleep
    custom = render(chart, minimal(gateway={"preStopSleepSeconds": 25, "drainTimeoutSeconds": 60}))
    deployment, c = gateway(custom)
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "25"]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 25 + 60 + 10
    off = render(chart, minimal(gateway={"preStopSleepSeconds": 0}))
    assert "lifecycle" not in gateway(off)[1]


# --- values that must reach the pods --------------------------------------------------------------


def test_pull_secrets_and_policies_reach_every_pod(chart):
    values = minimal(imagePullSecrets=[{"name": "regcred"}],
                     postgres={"bundled": True, "image": {"repository": "postgres", "tag": "17.5", "pullPolicy": "Always"}},
                     redis={"mode": "bundled", "image": {"repository": "redis", "tag": "8.2.1", "pullPolicy": "Never"}},
                     gateway={"replicas": 2})
    r = render(chart, values)
    pods = [(obj, template) for obj in r.objects for template in pod_templates(obj)]
    assert {obj["metadata"]["name"] for obj, _ in pods} >= {"kvgate-postgres", "kvgate-redis", "kvgate-gateway"}
    for obj, template in pods:
        assert template["spec"].get("imagePullSecrets") == [{"name": "regcred"}], obj["metadata"]["name"]
    (pg,) = r.get("StatefulSet", "kvgate-postgres")["spec"]["template"]["spec"]["containers"]
    (redis,) = r.get("Deployment", "kvgate-redis")["spec"]["template"]["spec"]["containers"]
    assert (pg["imagePullPolicy"], redis["imagePullPolicy"]) == ("Always", "Never")
    default = render(chart, minimal(postgres={"bundled": True}, redis={"mode": "bundled"}, gateway={"replicas": 2}))
    (pg,) = default.get("StatefulSet", "kvgate-postgres")["spec"]["template"]["spec"]["containers"]
    assert pg["imagePullPolicy"] == "IfNotPresent"


def test_bundled_postgres_is_install_only_and_says_so(renders):
    """The bundled PostgreSQL is a pre-install hook (the migration hook needs it before the release's
    objects exist), so `helm upgrade` never changes it: values.yaml says so where postgres.* is set."""
    r = renders["cpu-trial"]
    assert hook(r.get("StatefulSet", "kvgate-postgres"))[0] == {"pre-install"}
    values_text = (CHART / "values.yaml").read_text()
    block = values_text[values_text.index("\npostgres:"):values_text.index("\nmigration:")]
    assert "install only" in block and "helm upgrade" in block
