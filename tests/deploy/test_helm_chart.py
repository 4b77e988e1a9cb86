"""deploy/helm/kvgate verified without a cluster: Helm's own render, lint and values-schema
validation (helm-python-sdk, in process), every built-in object against the Kubernetes JSON
schemas (kubernetes-validate, offline), CRD kinds structurally, and assertions on the objects.

What this cannot show: that the pods start, probes pass or the engines load on real nodes —
nothing here runs a container (README "Deploying on Kubernetes" says so).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from typer.main import get_command

from engines.spec import load_bundled_spec, reference_settings
from server.admin.schemas import PoolCreate, RetentionClassCreate, TenantCreate
from server.cli import create_cli
from tests.deploy.chart import (
    ALL_APIS, CHART, CI_VALUES, KUBE_VERSION, LWS_API, MONITORING_API, NAMESPACE, ROOT, Rendered, containers,
    gateway, hook, load_values, minimal, plan_name, pod_templates, pools_of, render, selector_matches, workload,
)

CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "LeaderWorkerSet"}
MI = 1 << 20


def test_ci_values_files_exist():
    assert [p.name for p in CI_VALUES] == ["cpu-trial.yaml", "gpu-8b-4-replicas.yaml", "multinode-70b.yaml"]


def test_chart_reads_the_engine_specs_and_dashboard_the_images_and_compose_use():
    # Links, not copies: the chart can only size pods from the very spec files both images bundle.
    assert (CHART / "files" / "specs").resolve() == (ROOT / "engines" / "specs").resolve()
    assert (CHART / "files" / "dashboards" / "kvgate.json").resolve() == (ROOT / "deploy/grafana/dashboards/kvgate.json").resolve()
    assert (CHART / "files" / "prometheus-rules.yml").resolve() == (ROOT / "deploy/prometheus-rules.yml").resolve()


# --- Helm: lint and values schema ------------------------------------------------------------


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_lint_is_clean(values_file):
    report = helm_python.lint(CHART, load_values(values_file), strict=True, namespace=NAMESPACE,
                              kube_version=f"v{KUBE_VERSION}.0")
    assert report["errors"] == []
    # severity 2 = warning, 3 = error; "icon is recommended" (1 = info) is all that may remain.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_schema_accepts_the_ci_values(chart, values_file):
    chart.validate_schema(load_values(values_file))


def test_defaults_render_with_only_the_secret_named(chart):
    objects = render(chart, minimal()).objects
    assert {o["kind"] for o in objects} >= {"Deployment", "StatefulSet", "Job", "ConfigMap", "NetworkPolicy"}


BAD_VALUES = {
    "no existing secret": {},
    "an inline admin token": minimal(secrets={"existingSecret": "s", "adminTokens": "ops:0123456789abcdef0123"}),
    "a database URL in values": minimal(postgres={"url": "postgresql://kvgate:hunter2hunter2@db/kvgate"}),
    "two gateways without redis": minimal(gateway={"replicas": 2}),
    "autoscaling without redis": minimal(gateway={"autoscaling": {"enabled": True}}),
    "an unknown redis mode": minimal(redis={"mode": "cluster"}),
    "a pool without replicas": minimal(pools=[{"name": "p", "spec": "reference-smollm2", "replicas": 0,
                                               "registry": {"model_name": "m"}}]),
    "a pool name that is no DNS label": minimal(pools=[{"name": "Big_Pool", "spec": "reference-smollm2", "replicas": 1,
                                                        "registry": {"model_name": "m"}}]),
    "a tenant with a key secret": minimal(registry={"tenants": [{"slug": "a", "display_name": "A", "pool": "reference",
                                                                 "retention_class": "chat", "api_key": "kvg_x_y"}]}),
    "a one-node multinode pool": minimal(pools=[{"name": "p", "spec": "reference-smollm2", "replicas": 1,
                                                 "registry": {"model_name": "m"}, "multinode": {"enabled": True, "nodes": 1}}]),
    "a read-only trace claim": minimal(gateway={"traces": {"persistence": {"enabled": True, "accessModes": ["ReadOnlyMany"]}}}),
    "a relative trace dir": minimal(gateway={"traces": {"mountPath": "kvgate-traces"}}),
    "a trace dir over /tmp": minimal(gateway={"traces": {"mountPath": "/tmp"}}),
    "a trace emptyDir limit that is no quantity": minimal(gateway={"traces": {"sizeLimit": "lots"}}),
    "a trace existingClaim without persistence": minimal(gateway={"traces": {"persistence": {"existingClaim": "traces"}}}),
    "a hint quota share above 1": minimal(registry={"retention_classes": [{"name": "c", "hint_quota_fraction": 1.5}]}),
    "a hint priority above 100": minimal(registry={"retention_classes": [{"name": "c", "hint_max_priority": 101}]}),
    "a non-boolean end demote switch": minimal(registry={"retention_classes": [
        {"name": "c", "conversation_end_demote_enabled": "yes"}]}),
    "an unknown trace key": minimal(gateway={"traces": {"persistence": {"enabled": True, "readOnly": False}}}),
    "a PDB minAvailable that is no count or percentage": minimal(gateway={"podDisruptionBudget": {"minAvailable": "two"}}),
}


@pytest.mark.parametrize("case", BAD_VALUES, ids=list(BAD_VALUES))
def test_schema_rejects_bad_values(chart, case):
    values = BAD_VALUES[case]
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(values)
    with pytest.raises(helm_python.HelmValuesError):  # render validates too, as `helm install` does
        render(chart, values)


def test_schema_rejects_a_bad_values_file(chart, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("secrets:\n  existingSecret: kvgate-secrets\n  keyPepper: not-a-reference-but-the-secret-itself\n")
    with pytest.raises(helm_python.HelmValuesError, match="keyPepper"):
        chart.validate_schema(load_values(bad))


def test_templates_refuse_what_the_schema_cannot_express(chart):
    gpu_pool = {"name": "g", "spec": "llama-3.1-8b-instruct-fp8kv", "replicas": 1, "registry": {"model_name": "m"}}
    with pytest.raises(helm_python.HelmRenderError, match="primary_blocks"):
        render(chart, minimal(pools=[gpu_pool]))
    with pytest.raises(helm_python.HelmRenderError, match="no engine spec"):
        render(chart, minimal(pools=[{**gpu_pool, "spec": "no-such-spec"}]))
    with pytest.raises(helm_python.HelmRenderError, match="divide"):
        render(chart, minimal(pools=[{**gpu_pool, "spec": "llama-3.1-70b-instruct-fp8-tp8", "multinode": {"enabled": True, "nodes": 3},
                                      "registry": {"model_name": "m", "primary_blocks": 1, "secondary_blocks": 1}}]))
    with pytest.raises(helm_python.HelmRenderError, match="sized from the spec"):
        render(chart, minimal(pools=[{**gpu_pool, "registry": {"model_name": "m", "primary_blocks": 1, "secondary_blocks": 1},
                                      "resources": {"requests": {"memory": "1Gi"}}}]))
    reference = {"name": "r", "spec": "reference-smollm2", "replicas": 1, "registry": {"model_name": "m"}}
    with pytest.raises(helm_python.HelmRenderError, match="listed twice"):
        render(chart, minimal(pools=[reference, reference]))
    with pytest.raises(helm_python.HelmRenderError, match="reference engine runs in one pod"):
        render(chart, minimal(pools=[{"name": "r", "spec": "reference-smollm2", "replicas": 1, "registry": {"model_name": "m"},
                                      "multinode": {"enabled": True, "nodes": 2}}]))


def test_schema_knows_the_admin_api_fields():
    """The registry's retention classes and tenants are the admin API's Create schemas, field for field."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    registry = schema["properties"]["registry"]["properties"]
    assert set(registry["retention_classes"]["items"]["properties"]) == set(RetentionClassCreate.model_fields)
    assert set(registry["tenants"]["items"]["properties"]) == set(TenantCreate.model_fields)
    pool_registry = schema["properties"]["pools"]["items"]["properties"]["registry"]["properties"]
    assert set(pool_registry) <= set(PoolCreate.model_fields)


# --- Kubernetes schemas ----------------------------------------------------------------------


def _structural_crd_check(obj: dict[str, Any]) -> None:
    """CRD kinds are not in the Kubernetes schemas: check the fields the operators read.

    Field names: prometheus-operator pkg/apis/monitoring/v1 (servicemonitor_types.go,
    podmonitor_types.go, prometheusrule_types.go); kubernetes-sigs/lws
    api/leaderworkerset/v1/leaderworkerset_types.go. The pod templates inside a
    LeaderWorkerSet are validated as Pods against the Kubernetes schema.
    """
    kind, spec = obj["kind"], obj["spec"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])
    if kind == "ServiceMonitor":
        assert obj["apiVersion"] == MONITORING_API
        assert set(spec) == {"selector", "endpoints"} and spec["selector"]["matchLabels"]
        for ep in spec["endpoints"]:
            assert set(ep) <= {"port", "path", "interval", "authorization"}
            if "authorization" in ep:
                assert ep["authorization"]["type"] == "Bearer" and set(ep["authorization"]["credentials"]) == {"name", "key"}
    elif kind == "PodMonitor":
        assert obj["apiVersion"] == MONITORING_API
        assert set(spec) == {"selector", "podMetricsEndpoints"}
        assert all(set(ep) <= {"port", "path", "interval"} for ep in spec["podMetricsEndpoints"])
    elif kind == "PrometheusRule":
        assert obj["apiVersion"] == MONITORING_API
        for group in spec["groups"]:
            assert set(group) <= {"name", "rules", "interval"}
            for rule in group["rules"]:
                if "record" in rule:
                    assert set(rule) <= {"record", "expr", "labels"} and rule["record"] and rule["expr"]
                else:
                    assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"} and rule["alert"] and rule["expr"]
    elif kind == "LeaderWorkerSet":
        assert obj["apiVersion"] == LWS_API
        assert set(spec) <= {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
        assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
        lwt = spec["leaderWorkerTemplate"]
        assert set(lwt) <= {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy"}
        assert lwt["restartPolicy"] in ("RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None")
        for template in pod_templates(obj):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"], "spec": template["spec"]}
            kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
    else:  # pragma: no cover - a new CRD kind needs its own check
        raise AssertionError(f"no structural check for {kind}")


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    checked_crds = set()
    for obj in rendered.objects:
        if obj["kind"] in CRD_KINDS:
            _structural_crd_check(obj)
            checked_crds.add(obj["kind"])
        else:
            # strict: additional properties are errors (a misspelt field fails here).
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    assert checked_crds  # every ci file renders at least one monitor


def test_the_validator_catches_a_misspelt_field(renders):
    deployment = copy.deepcopy(renders["cpu-trial"].get("Deployment", "kvgate-gateway"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


# --- the gateway -------------------------------------------------------------------------------


def _serving_routes() -> set[str]:
    from server.serving import build_serving_app
    from server.settings import Settings

    app = build_serving_app(Settings(dev=True, database_url="sqlite://"))
    return {getattr(route, "path", "") for route in app.routes}


def test_gateway_probes_hit_routes_the_app_serves(rendered):
    _, c = gateway(rendered)
    routes = _serving_routes()
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and "/healthz" in routes
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and "/readyz" in routes
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert c["command"][c["command"].index("--port") + 1] == str(port) == "8000"


def test_gateway_runs_non_root_read_only_with_resources(rendered):
    deployment, c = gateway(rendered)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001  # build/Dockerfile.gateway
    assert "10001" in (ROOT / "build/Dockerfile.gateway").read_text()
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"/tmp"} <= {m["mountPath"] for m in c["volumeMounts"]}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"


def test_every_container_states_cpu_and_memory(rendered):
    for obj in rendered.objects:
        for template in pod_templates(obj):
            for c in containers(template):
                resources = c.get("resources", {})
                assert "memory" in resources.get("requests", {}), (obj["metadata"]["name"], c["name"])
                assert "cpu" in resources.get("requests", {}), (obj["metadata"]["name"], c["name"])


def test_gateway_scaling_needs_and_gets_redis(renders):
    gpu, multi, cpu = renders["gpu-8b-4-replicas"], renders["multinode-70b"], renders["cpu-trial"]
    hpa = gpu.get("HorizontalPodAutoscaler", "kvgate-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvgate-gateway"}
    assert "replicas" not in gpu.get("Deployment", "kvgate-gateway")["spec"]  # the HPA owns it
    for r in (gpu, multi):
        deployment, c = gateway(r)
        env = {e["name"]: e for e in c["env"]}
        assert "KVGATE_REDIS_URL" in env
        assert env["KVGATE_ROUTING_SYNC"]["value"] == "true"  # gateway pods route on one another's dispatches
        pdb = r.get("PodDisruptionBudget", "kvgate-gateway")
        assert selector_matches(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    external = {e["name"]: e for e in gateway(gpu)[1]["env"]}["KVGATE_REDIS_URL"]
    assert external["valueFrom"]["secretKeyRef"] == {"name": "kvgate-secrets", "key": "redis-url"}
    bundled = {e["name"]: e for e in gateway(multi)[1]["env"]}["KVGATE_REDIS_URL"]
    assert bundled["value"] == "redis://kvgate-redis:6379/0"
    assert multi.get("Service", "kvgate-redis")
    # one gateway: no Redis, no PDB (a PDB over a single pod would block every node drain)
    assert not {"KVGATE_REDIS_URL", "KVGATE_ROUTING_SYNC"} & {e["name"] for e in gateway(cpu)[1]["env"]}
    assert not cpu.of_kind("PodDisruptionBudget")


def test_an_autoscaled_gateway_gets_a_pdb_only_when_it_can_let_a_pod_go(chart):
    """As without autoscaling: no PDB over what may be a single pod (minAvailable 1 of 1 blocks every
    node drain); a minAvailable as large as the pod count is refused rather than rendered."""
    def autoscaled(minimum: int, maximum: int = 4, **pdb: Any) -> dict[str, Any]:
        return minimal(redis={"mode": "bundled"}, gateway={
            "autoscaling": {"enabled": True, "minReplicas": minimum, "maxReplicas": maximum},
            **({"podDisruptionBudget": pdb} if pdb else {})})

    one = render(chart, autoscaled(1))
    assert one.get("HorizontalPodAutoscaler", "kvgate-gateway")["spec"]["minReplicas"] == 1
    assert not one.of_kind("PodDisruptionBudget")
    two = render(chart, autoscaled(2)).get("PodDisruptionBudget", "kvgate-gateway")
    assert two["spec"]["minAvailable"] == 1
    for blocking in (autoscaled(2, minAvailable=2), autoscaled(3, minAvailable="100%"), autoscaled(2, minAvailable="60%"),
                     minimal(redis={"mode": "bundled"}, gateway={"replicas": 2, "podDisruptionBudget": {"minAvailable": 3}})):
        with pytest.raises(helm_python.HelmRenderError, match=r"podDisruptionBudget\.minAvailable .* blocks every node drain"):
            render(chart, blocking)
    assert render(chart, autoscaled(3, minAvailable="50%")).get("PodDisruptionBudget", "kvgate-gateway")["spec"]["minAvailable"] == "50%"


def test_autoscaling_refuses_a_maximum_below_its_minimum(chart):
    values = minimal(redis={"mode": "bundled"}, gateway={"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}})
    with pytest.raises(helm_python.HelmRenderError,
                       match=r"gateway\.autoscaling\.maxReplicas \(2\) is below minReplicas \(5\)"):
        render(chart, values)
    equal = minimal(redis={"mode": "bundled"}, gateway={"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 3}})
    assert render(chart, equal).get("HorizontalPodAutoscaler", "kvgate-gateway")["spec"]["maxReplicas"] == 3


def test_forwarded_allow_ips_reaches_the_gateway(chart, monkeypatch):
    """gateway.forwardedAllowIps: the proxies whose X-Forwarded-Proto/-For uvicorn believes (the console's
    Secure cookie, its sign-in throttle's client address). Unset by default: uvicorn trusts 127.0.0.1 only."""
    from server.settings import Settings

    assert "KVGATE_FORWARDED_ALLOW_IPS" not in {e["name"] for e in gateway(render(chart, minimal()))[1]["env"]}
    r = render(chart, minimal(gateway={"forwardedAllowIps": "10.42.0.0/16,10.43.0.5"}))
    env = {e["name"]: e for e in gateway(r)[1]["env"]}
    assert env["KVGATE_FORWARDED_ALLOW_IPS"] == {"name": "KVGATE_FORWARDED_ALLOW_IPS", "value": "10.42.0.0/16,10.43.0.5"}
    monkeypatch.setenv("KVGATE_FORWARDED_ALLOW_IPS", env["KVGATE_FORWARDED_ALLOW_IPS"]["value"])
    assert Settings(dev=True, database_url="sqlite://").forwarded_allow_ips == "10.42.0.0/16,10.43.0.5"
    values_text = (CHART / "values.yaml").read_text()
    block = values_text[values_text.index("  forwardedAllowIps:") - 900:values_text.index("  forwardedAllowIps:")]
    assert "X-Forwarded-Proto" in block and "*" in block  # documented, with when "*" is safe


def test_the_commands_parse_with_the_real_cli(renders):
    """Every kvgate argv the chart runs parses with the CLI's own click parser (flags and types)."""
    cli = get_command(create_cli())
    seen, missing = set(), set()
    for r in renders.values():
        for obj in r.objects:
            for template in pod_templates(obj):
                for c in containers(template):
                    argv = c.get("command", [])
                    if not argv or argv[0] != "kvgate":
                        continue
                    group, path = cli, []
                    args = list(argv[1:])
                    while hasattr(group, "commands"):  # typer vendors click (typer._click): duck-type groups
                        name = args.pop(0)
                        path.append(name)
                        if name not in group.commands:
                            break
                        group = group.commands[name]
                    else:
                        group.make_context(" ".join(path), args)  # raises a UsageError on a bad flag or value
                        seen.add(" ".join(path))
                        continue
                    missing.add(" ".join(path))
    assert {"serve", "db upgrade", "engine serve", "build repo"} <= seen
    if missing == {"admin apply"}:
        pytest.skip("`kvgate admin apply` (branch i13-registry) is not in this tree yet; the rest parsed")
    assert not missing and "admin apply" in seen


# --- trace captures ------------------------------------------------------------------------------


def _trace_mount(r: Rendered) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(KVGATE_TRACE_DIR, its volumeMount, its volume) in the gateway pod."""
    deployment, c = gateway(r)
    env = {e["name"]: e for e in c["env"]}
    trace_dir = env["KVGATE_TRACE_DIR"]["value"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == trace_dir]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    return trace_dir, mount, volume


def test_gateway_writes_trace_captures_to_a_writable_mount(rendered, monkeypatch):
    """The root filesystem is read-only, so the capture directory must be a writable volume mounted
    exactly where KVGATE_TRACE_DIR (the setting the gateway really reads) points."""
    from server.settings import Settings

    _, c = gateway(rendered)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    trace_dir, mount, volume = _trace_mount(rendered)
    assert trace_dir.startswith("/") and not mount.get("readOnly", False)
    assert set(volume) & {"emptyDir", "persistentVolumeClaim"} and not volume.get("persistentVolumeClaim", {}).get("readOnly")
    monkeypatch.setenv("KVGATE_TRACE_DIR", trace_dir)
    assert Settings(dev=True, database_url="sqlite://").trace_dir.as_posix() == trace_dir


def test_trace_dir_defaults_to_a_bounded_emptydir(chart):
    r = render(chart, minimal())
    trace_dir, _, volume = _trace_mount(r)
    assert trace_dir == "/var/lib/kvgate/traces"
    assert volume == {"name": "traces", "emptyDir": {"sizeLimit": "4Gi"}}
    assert not r.of_kind("PersistentVolumeClaim")
    moved = render(chart, minimal(gateway={"traces": {"mountPath": "/data/traces", "sizeLimit": "500Mi"}}))
    trace_dir, _, volume = _trace_mount(moved)
    assert trace_dir == "/data/traces" and volume["emptyDir"] == {"sizeLimit": "500Mi"}


def test_trace_persistence_renders_a_kept_claim_the_gateway_mounts(chart, renders):
    persistence = {"enabled": True, "storageClassName": "shared-rwx", "size": "20Gi"}
    r = render(chart, minimal(redis={"mode": "bundled"}, gateway={"replicas": 3, "traces": {"persistence": persistence}}))
    claim = r.get("PersistentVolumeClaim", "kvgate-traces")
    kubernetes_validate.validate(claim, KUBE_VERSION, strict=True)
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "shared-rwx",
                             "resources": {"requests": {"storage": "20Gi"}}}
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # captures outlive an uninstall
    _, _, volume = _trace_mount(r)
    assert volume == {"name": "traces", "persistentVolumeClaim": {"claimName": "kvgate-traces"}}
    # the GPU example shares one claim among its autoscaled gateways
    _, _, volume = _trace_mount(renders["gpu-8b-4-replicas"])
    assert volume["persistentVolumeClaim"]["claimName"] == "kvgate-traces"
    assert renders["gpu-8b-4-replicas"].get("PersistentVolumeClaim", "kvgate-traces")["spec"]["accessModes"] == ["ReadWriteMany"]


def test_trace_existing_claim_is_mounted_not_created(chart):
    r = render(chart, minimal(gateway={"traces": {"persistence": {"enabled": True, "existingClaim": "captures"}}}))
    assert all(c["metadata"]["name"] != "kvgate-traces" for c in r.of_kind("PersistentVolumeClaim"))
    _, _, volume = _trace_mount(r)
    assert volume == {"name": "traces", "persistentVolumeClaim": {"claimName": "captures"}}


@pytest.mark.parametrize("mode", ["ReadWriteOnce", "ReadWriteOncePod"])
def test_a_single_node_trace_claim_refuses_several_gateways(chart, mode):
    rwo = {"traces": {"persistence": {"enabled": True, "accessModes": [mode]}}}
    for scaled in ({"replicas": 2}, {"autoscaling": {"enabled": True}}):
        with pytest.raises(helm_python.HelmRenderError, match=rf"accessModes \[{mode}\]: .*ReadWriteMany"):
            render(chart, minimal(redis={"mode": "bundled"}, gateway={**rwo, **scaled}))
    # one gateway may use it; several may with ReadWriteMany or a claim of their own choosing
    assert render(chart, minimal(gateway=rwo)).get("PersistentVolumeClaim", "kvgate-traces")["spec"]["accessModes"] == [mode]
    for ok in ({"accessModes": ["ReadWriteOnce", "ReadWriteMany"]}, {"existingClaim": "captures"}):
        persistence = {**rwo["traces"]["persistence"], **ok}
        render(chart, minimal(redis={"mode": "bundled"}, gateway={"replicas": 2, "traces": {"persistence": persistence}}))


@pytest.mark.parametrize("mode", ["ReadWriteOnce", "ReadWriteOncePod"])
def test_a_single_gateway_on_a_single_node_claim_is_replaced_not_surged(chart, mode):
    """A surge pod could not mount a ReadWriteOnce(Pod) claim the old pod holds (ReadWriteOncePod never,
    ReadWriteOnce on another node): the rollout would stall. Such a gateway is recreated instead."""
    rolling = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    rwo = render(chart, minimal(gateway={"traces": {"persistence": {"enabled": True, "accessModes": [mode]}}}))
    deployment = rwo.get("Deployment", "kvgate-gateway")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    # an existing claim declared single-node (accessModes describe it) is recreated too
    existing = render(chart, minimal(gateway={"traces": {"persistence": {
        "enabled": True, "existingClaim": "captures", "accessModes": [mode]}}}))
    assert existing.get("Deployment", "kvgate-gateway")["spec"]["strategy"] == {"type": "Recreate"}
    # ReadWriteMany, an emptyDir per pod, or several gateways (which need ReadWriteMany): a rolling update
    for values in (minimal(gateway={"traces": {"persistence": {"enabled": True}}}),
                   minimal(gateway={"traces": {"persistence": {"enabled": True, "accessModes": [mode, "ReadWriteMany"]}}}),
                   minimal(gateway={"traces": {"persistence": {"enabled": True, "existingClaim": "captures"}}}),
                   minimal(gateway={"traces": {"persistence": {"enabled": False, "accessModes": [mode]}}}),
                   minimal()):
        assert render(chart, values).get("Deployment", "kvgate-gateway")["spec"]["strategy"] == rolling


def test_notes_export_command_parses_with_the_real_cli(chart):
    """NOTES.txt tells the operator how to export captures: the argv must be one the CLI accepts,
    reading the directory the gateway writes."""
    cli = get_command(create_cli())
    export = cli.commands["trace"].commands["export"]
    for persistence, flag_dir in ((False, "--dir"), (True, None)):
        r = render(chart, minimal(gateway={"traces": {"persistence": {"enabled": persistence}}}))
        notes = next(text for path, text in r.manifests.items() if path.endswith("NOTES.txt"))
        (line,) = [ln for ln in notes.splitlines() if "kvgate trace export" in ln]
        argv = shlex.split(line[line.index("kvgate trace export"):])[3:]
        export.make_context("trace export", list(argv))  # raises a UsageError on a bad flag
        if flag_dir:
            assert flag_dir in argv  # the files were copied out of the pods
        else:  # run in a gateway pod: KVGATE_TRACE_DIR applies, the output lands on the shared mount
            assert argv[argv.index("-o") + 1].startswith(_trace_mount(r)[0] + "/")


# --- hooks -------------------------------------------------------------------------------------


def test_hooks_migrate_before_and_register_after(rendered):
    migrate_events, migrate_weight = hook(rendered.get("Job", "kvgate-migrate"))
    apply_events, apply_weight = hook(rendered.get("Job", "kvgate-registry-apply"))
    assert migrate_events == {"pre-install", "pre-upgrade"}
    assert apply_events == {"post-install", "post-upgrade"}
    assert migrate_weight < apply_weight
    # what the gateway and engines need at start is a normal release object, created between the hooks
    for kind, name in [("Deployment", "kvgate-gateway"), ("ConfigMap", "kvgate-registry")]:
        assert hook(rendered.get(kind, name))[0] == set()
    assert rendered.get("Job", "kvgate-migrate")["spec"]["template"]["spec"]["containers"][0]["command"] == ["kvgate", "db", "upgrade"]
    apply = rendered.get("Job", "kvgate-registry-apply")["spec"]["template"]["spec"]
    # by default it adds and updates only: an upgrade never deletes a pool made with the admin API
    assert apply["containers"][0]["command"] == ["kvgate", "admin", "apply", "-f", "/etc/kvgate/registry/registry.yaml"]
    assert apply["volumes"][0]["configMap"]["name"] == "kvgate-registry"


def test_bundled_postgres_exists_before_the_migration(renders):
    r = renders["cpu-trial"]
    _, migrate_weight = hook(r.get("Job", "kvgate-migrate"))
    for kind in ("StatefulSet", "Service"):
        events, weight = hook(r.get(kind, "kvgate-postgres"))
        assert events == {"pre-install"} and weight < migrate_weight
    assert not renders["gpu-8b-4-replicas"].of_kind("StatefulSet") or all(
        o["metadata"]["name"] != "kvgate-postgres" for o in renders["gpu-8b-4-replicas"].of_kind("StatefulSet"))


# --- engines -------------------------------------------------------------------------------------


def test_registry_replicas_match_the_engine_pods(rendered):
    registry = yaml.safe_load(rendered.get("ConfigMap", "kvgate-registry")["data"]["registry.yaml"])
    assert [p["name"] for p in registry["pools"]] == [p["name"] for p in pools_of(rendered)]
    for pool, entry in zip(pools_of(rendered), registry["pools"], strict=True):
        obj = workload(rendered, pool["name"])
        replicas = obj["spec"]["replicas"]
        assert replicas == pool["replicas"] == len(entry["replicas"])
        if obj["kind"] == "StatefulSet":
            service = rendered.get("Service", obj["spec"]["serviceName"])
            assert service["spec"]["clusterIP"] == "None"
            assert selector_matches({"matchLabels": service["spec"]["selector"]}, obj["spec"]["template"]["metadata"]["labels"])
            assert {"name": "grpc", "port": 8001, "targetPort": "grpc", "protocol": "TCP"} in service["spec"]["ports"]
            subdomain, serving = obj["spec"]["serviceName"], obj["spec"]["template"]
        else:  # the LWS controller names the shared headless Service after the LeaderWorkerSet
            subdomain, serving = obj["metadata"]["name"], obj["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
        grpc = [p for c in serving["spec"]["containers"] for p in c["ports"] if p["name"] == "grpc"]
        assert grpc == [{"name": "grpc", "containerPort": 8001, "protocol": "TCP"}]
        # pod i of a StatefulSet (leader i of an LWS) is <name>-i, resolvable as <name>-i.<subdomain>.<ns>.svc
        assert entry["replicas"] == [
            {"name": f"r{i}", "endpoint": f"{obj['metadata']['name']}-{i}.{subdomain}.{NAMESPACE}.svc.cluster.local:8001",
             "weight": 1, "state": "active"}
            for i in range(replicas)
        ]


def test_registry_pools_follow_the_spec_and_the_admin_schemas(rendered):
    registry = yaml.safe_load(rendered.get("ConfigMap", "kvgate-registry")["data"]["registry.yaml"])
    for pool, entry in zip(pools_of(rendered), registry["pools"], strict=True):
        spec = load_bundled_spec(pool["spec"])
        assert entry["engine_spec"] == spec.name and entry["triton_model"] == spec.triton.model_name
        assert entry["tokens_per_block"] == spec.build.tokens_per_block
        assert entry["secondary_offload_min_priority"] == spec.kv_cache.secondary_offload_min_priority
        if spec.backend == "reference":
            assert (entry["primary_blocks"], entry["secondary_blocks"]) == (spec.reference.primary_blocks, spec.reference.secondary_blocks)
        else:
            assert (entry["primary_blocks"], entry["secondary_blocks"]) == (pool["registry"]["primary_blocks"], pool["registry"]["secondary_blocks"])
        fields = {k: v for k, v in entry.items() if k != "replicas"}
        # PoolCreate still requires triton_url until the replicas migration lands; the first replica stands in.
        PoolCreate.model_validate({**fields, "triton_url": entry["replicas"][0]["endpoint"]})
        assert set(entry) <= set(PoolCreate.model_fields) | {"replicas"}
    for item in registry.get("retention_classes", []):
        RetentionClassCreate.model_validate(item)
    for item in registry.get("tenants", []):
        TenantCreate.model_validate(item)


def test_gpu_sizing_follows_the_spec(rendered):
    """GPUs = ranks per pod; memory = host_cache_size per rank (TensorRT-LLM allots each rank its
    own host pool) + /dev/shm + overhead; /dev/shm an in-memory emptyDir."""
    gpu_defaults = rendered.values.get("engines", {}).get("gpu", {})
    shm_gib, overhead_gib = gpu_defaults.get("shmSizeGiB", 2), gpu_defaults.get("hostMemoryOverheadGiB", 32)
    for pool in pools_of(rendered):
        spec = load_bundled_spec(pool["spec"])
        obj = workload(rendered, pool["name"])
        for template in pod_templates(obj):
            (c,) = template["spec"]["containers"]
            res = c["resources"]
            if spec.backend == "reference":
                assert "nvidia.com/gpu" not in res.get("requests", {}) | res.get("limits", {})
                continue
            nodes = pool.get("multinode", {}).get("nodes", 1) if pool.get("multinode", {}).get("enabled") else 1
            ranks = spec.build.world_size // nodes
            memory = math.ceil(spec.kv_cache.host_cache_size_per_rank * ranks / MI) + (shm_gib + overhead_gib) * 1024
            assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == ranks
            assert res["requests"]["memory"] == res["limits"]["memory"] == f"{memory}Mi"
            assert memory * MI > spec.kv_cache.host_cache_size_per_rank * ranks > 0
            dshm = {v["name"]: v for v in template["spec"]["volumes"]}["dshm"]
            assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}
            assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
            tolerations = template["spec"]["tolerations"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
            assert all(t in tolerations for t in pool.get("tolerations", []))


def test_triton_pods_serve_the_spec_after_the_builder(renders):
    r = renders["gpu-8b-4-replicas"]
    spec = load_bundled_spec("llama-3.1-8b-instruct-fp8kv")
    sts = workload(r, "llama8b")
    pod = sts["spec"]["template"]["spec"]
    (triton,) = pod["containers"]
    assert triton["image"] == "registry.example.com/kvgate/kvgate-triton:0.1.0"
    assert triton["command"] == ["tritonserver", "--model-repository=/models", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002"]
    assert triton["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert triton["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    wait, repo = pod["initContainers"]
    assert wait["command"][:2] == ["python3", "-c"] and wait["command"][-1] == spec.name
    assert "spec_hash" in wait["command"][2]
    assert repo["command"] == ["kvgate", "build", "repo", spec.name, "--output", "/models", "--engines-root", "/engines"]
    assert {"name": "engines", "persistentVolumeClaim": {"claimName": "kvgate-engines", "readOnly": True}} in pod["volumes"]
    (job,) = [j for j in r.of_kind("Job") if j["metadata"]["labels"]["app.kubernetes.io/component"] == "engine-builder"]
    build = job["spec"]["template"]["spec"]["containers"][0]
    assert build["command"] == ["kvgate-engine-builder"]
    # the Triton image installs the builder script under that name (build/Dockerfile.triton)
    assert "COPY build/engine_builder.sh /usr/local/bin/kvgate-engine-builder" in (ROOT / "build/Dockerfile.triton").read_text()
    assert {"name": "KVGATE_ENGINE_SPECS", "value": spec.name} in build["env"]
    assert build["resources"]["limits"]["nvidia.com/gpu"] == spec.build.world_size  # one pod holds every rank
    claim = r.get("PersistentVolumeClaim", "kvgate-engines")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # the gateway reads the GPU pool's tokenizer the builder leaves on the same volume
    gw = gateway(r)[1]
    assert {"name": "KVGATE_TOKENIZER_ROOT", "value": "/engines/tokenizers"} in gw["env"]


def test_the_triton_pod_renders_a_repository_with_guided_decoding(renders, tmp_path):
    """The init container's real `kvgate build repo` writes tokenizer_dir where the builder job saves the
    tokenizer (build/engine_builder.sh), so GuidedDecodingConfig is built on a GPU pool."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2
    from typer.testing import CliRunner

    r = renders["gpu-8b-4-replicas"]
    spec = load_bundled_spec("llama-3.1-8b-instruct-fp8kv")
    pod = workload(r, "llama8b")["spec"]["template"]["spec"]
    _, repo = pod["initContainers"]
    argv = list(repo["command"][1:])
    argv[argv.index("--output") + 1] = str(tmp_path)
    result = CliRunner().invoke(create_cli(), argv)
    assert result.exit_code == 0, result.output
    config = text_format.Parse((tmp_path / "kvgate_llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    tokenizer_dir = config.parameters["tokenizer_dir"].string_value
    assert tokenizer_dir == f"/engines/tokenizers/{spec.name}"
    builder = (ROOT / "build/engine_builder.sh").read_text()
    # what the builder job runs: the tokenizer saved where the rendered repository reads it
    assert 'save_spec_tokenizer(sys.argv[1], sys.argv[2])' in builder and '"$spec" /engines' in builder
    from engines.triton.repository import tokenizer_dir_for
    assert str(tokenizer_dir_for(spec, "/engines")) == tokenizer_dir
    assert {"name": "engines", "mountPath": "/engines", "readOnly": True} in pod["containers"][0]["volumeMounts"]


def test_builder_job_name_follows_the_spec_file(chart, renders):
    r = renders["gpu-8b-4-replicas"]
    (job,) = [j for j in r.of_kind("Job") if j["metadata"]["labels"]["app.kubernetes.io/component"] == "engine-builder"]
    again = render(chart, r.values, api_versions=ALL_APIS, is_upgrade=True)
    (job2,) = [j for j in again.of_kind("Job") if j["metadata"]["labels"]["app.kubernetes.io/component"] == "engine-builder"]
    assert job["metadata"]["name"] == job2["metadata"]["name"]  # nothing changed: the same (finished) Job
    assert re.fullmatch(r"kvgate-build-[0-9a-f]{10}", job["metadata"]["name"])


def test_cpu_engine_flags_match_the_reference_spec(renders):
    spec = load_bundled_spec("reference-smollm2")
    expected = reference_settings(spec)
    (c,) = workload(renders["cpu-trial"], "reference")["spec"]["template"]["spec"]["containers"]
    argv = c["command"]
    flags = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1, 2)}
    assert argv[:3] == ["kvgate", "engine", "serve"] and flags["--port"] == "8001"
    assert flags["--kv-dtype"] == expected["kv_dtype"]
    for flag, key in [("--primary-blocks", "primary_blocks"), ("--secondary-blocks", "secondary_blocks"),
                      ("--tokens-per-block", "tokens_per_block"), ("--offload-min-priority", "secondary_offload_min_priority"),
                      ("--max-batch-size", "max_batch_size"), ("--max-num-tokens", "max_num_tokens"),
                      ("--max-input-len", "max_input_len"), ("--max-output-len", "max_output_len")]:
        assert flags[flag] == str(expected[key]), flag
    assert "is_server_ready" in " ".join(c["readinessProbe"]["exec"]["command"])
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert not renders["cpu-trial"].of_kind("PersistentVolumeClaim")  # no TensorRT-LLM pool, no engines volume


def test_leaderworkerset_only_when_enabled(renders):
    assert not renders["cpu-trial"].of_kind("LeaderWorkerSet") and not renders["gpu-8b-4-replicas"].of_kind("LeaderWorkerSet")
    lws = workload(renders["multinode-70b"], "llama70b")
    assert lws["kind"] == "LeaderWorkerSet"
    spec = load_bundled_spec("llama-3.1-70b-instruct-fp8-tp8")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2
    gpus = [t["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for t in pod_templates(lws)]
    assert gpus == [4, 4] and sum(gpus) == spec.build.world_size
    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    assert "mpirun -np 1" in leader["args"][0] and ":4" in leader["args"][0]
    assert "readinessProbe" in leader and "readinessProbe" not in lwt["workerTemplate"]["spec"]["containers"][0]


# --- network -------------------------------------------------------------------------------------


def _pod_labels(r: Rendered) -> dict[str, dict[str, str]]:
    labels = {}
    for obj in r.objects:
        for i, template in enumerate(pod_templates(obj)):
            labels[f"{obj['kind']}/{obj['metadata']['name']}#{i}"] = template["metadata"]["labels"]
    return labels


def test_only_gateway_pods_reach_the_engines_grpc_port(rendered):
    policy = rendered.get("NetworkPolicy", "kvgate-engines")
    pods = _pod_labels(rendered)
    engine_pods = {k for k, v in pods.items() if v.get("app.kubernetes.io/component") == "engine"}
    assert engine_pods and {k for k, v in pods.items() if selector_matches(policy["spec"]["podSelector"], v)} == engine_pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    grpc_rules = [rule for rule in policy["spec"]["ingress"] if {"port": 8001, "protocol": "TCP"} in rule["ports"]]
    assert len(grpc_rules) == 1 and all(len(rule["ports"]) == 1 for rule in policy["spec"]["ingress"])
    (peer,) = grpc_rules[0]["from"]
    assert set(peer) == {"podSelector"}  # same namespace, pods only
    allowed = {k for k, v in pods.items() if selector_matches(peer["podSelector"], v)}
    assert allowed == {"Deployment/kvgate-gateway#0"}
    # Multi-node groups talk among themselves (MPI, NCCL), and only within their pool.
    for pool in pools_of(rendered):
        if pool.get("multinode", {}).get("enabled"):
            group = rendered.get("NetworkPolicy", f"{plan_name(pool['name'])}-group")
            (rule,) = group["spec"]["ingress"]
            members = {k for k, v in pods.items() if selector_matches(rule["from"][0]["podSelector"], v)}
            assert members == {k for k in engine_pods if pods[k]["kvgate.io/pool"] == pool["name"]}


def test_the_admin_api_is_separate_and_off_by_default(renders):
    cpu, gpu = renders["cpu-trial"], renders["gpu-8b-4-replicas"]
    assert not cpu.of_kind("Ingress") and all(s["metadata"]["name"] != "kvgate-admin" for s in cpu.of_kind("Service"))
    paths = {i["metadata"]["name"]: [p["path"] for rule in i["spec"]["rules"] for p in rule["http"]["paths"]] for i in gpu.of_kind("Ingress")}
    assert paths == {"kvgate-gateway": ["/v1"], "kvgate-admin": ["/admin/v1"]}
    admin = gpu.get("Service", "kvgate-admin")
    assert selector_matches({"matchLabels": admin["spec"]["selector"]}, gpu.get("Deployment", "kvgate-gateway")["spec"]["template"]["metadata"]["labels"])


# --- monitoring ----------------------------------------------------------------------------------


def test_monitors_only_where_the_operator_crds_exist(chart):
    values = load_values(CHART / "ci" / "gpu-8b-4-replicas.yaml")
    without = render(chart, values)
    assert not {o["kind"] for o in without.objects} & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    with_crds = render(chart, values, api_versions=(MONITORING_API,))
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= {o["kind"] for o in with_crds.objects}


def _documented_metrics() -> set[str]:
    """The metric tables of deploy/README.md: what the dashboard reads and what only the rules read."""
    text = (ROOT / "deploy/README.md").read_text()
    names = set()
    for marker in ("metrics", "rule-metrics"):
        table = text.split(f"<!-- {marker}:begin -->")[1].split(f"<!-- {marker}:end -->")[0]
        names |= set(re.findall(r"^\| `(kvgate_[a-z_]+)`", table, re.M))
    return names


def test_monitors_select_the_gateway_and_triton(renders):
    r = renders["gpu-8b-4-replicas"]
    sm = r.get("ServiceMonitor", "kvgate-gateway")
    assert selector_matches(sm["spec"]["selector"], r.get("Service", "kvgate-gateway")["metadata"]["labels"])
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "http" and ep["path"] == "/metrics"
    assert ep["authorization"]["credentials"] == {"name": "kvgate-secrets", "key": "metrics-token"}  # KVGATE_METRICS_TOKEN
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pm = r.get("PodMonitor", "kvgate-triton")
    triton = workload(r, "llama8b")["spec"]["template"]
    assert selector_matches(pm["spec"]["selector"], triton["metadata"]["labels"])
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in {p["name"] for p in triton["spec"]["containers"][0]["ports"]}
    rules = [rule for group in r.get("PrometheusRule", "kvgate")["spec"]["groups"] for rule in group["rules"]]
    used = {m.removesuffix("_bucket") for rule in rules for m in re.findall(r"kvgate_[a-z_]+", rule["expr"])}
    assert used and used <= _documented_metrics()
    assert not renders["cpu-trial"].of_kind("PodMonitor")  # the reference engine has no metrics port
    # the PrometheusRule carries deploy/prometheus-rules.yml as shipped, plus the Kubernetes-only group
    groups = r.get("PrometheusRule", "kvgate")["spec"]["groups"]
    assert groups[:-1] == yaml.safe_load((ROOT / "deploy/prometheus-rules.yml").read_text())["groups"]
    assert groups[-1]["name"] == "kvgate-kubernetes"


def _chart_alerts(r: Rendered) -> set[str]:
    return {rule["alert"] for group in r.get("PrometheusRule", "kvgate")["spec"]["groups"] for rule in group["rules"]
            if "alert" in rule}


def test_the_readmes_name_the_alerts_that_exist(renders):
    """README "Metrics and dashboards" names every alert the chart ships, and only those; deploy/README.md
    names every alert of deploy/prometheus-rules.yml."""
    alerts = _chart_alerts(renders["gpu-8b-4-replicas"])
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("**Metrics and dashboards.**"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    assert set(re.findall(r"`(Kvgate[A-Za-z]+)`", paragraph)) == alerts
    shipped = {rule["alert"] for group in yaml.safe_load((ROOT / "deploy/prometheus-rules.yml").read_text())["groups"]
               for rule in group["rules"] if "alert" in rule}
    assert set(re.findall(r"`(Kvgate[A-Za-z]+)`", (ROOT / "deploy/README.md").read_text())) == shipped
    assert alerts == shipped | {"KvgateGatewayDown"}


def test_grafana_dashboard_configmap(rendered):
    cm = rendered.get("ConfigMap", "kvgate-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["kvgate.json"])
    original = json.loads((ROOT / "deploy/grafana/dashboards/kvgate.json").read_text())
    assert dashboard["uid"] == original["uid"] and len(dashboard["panels"]) == len(original["panels"])
    assert "kvgate-prometheus" not in cm["data"]["kvgate.json"]
    assert '"uid": "prometheus"' in cm["data"]["kvgate.json"]


def test_the_usage_journal_sync_reaches_the_gateway(chart):
    """gateway.usageJournalSync: fsync by default; write as asked; anything else refused by the schema."""
    def env(values):
        return {e["name"]: e.get("value") for e in gateway(render(chart, values))[1]["env"]}

    assert env(minimal())["KVGATE_USAGE_JOURNAL_SYNC"] == "fsync"
    assert env(minimal(gateway={"usageJournalSync": "write"}))["KVGATE_USAGE_JOURNAL_SYNC"] == "write"
    with pytest.raises(helm_python.HelmValuesError, match="usageJournalSync"):
        render(chart, minimal(gateway={"usageJournalSync": "sometimes"}))
