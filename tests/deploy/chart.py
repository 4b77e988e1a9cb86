"""Render deploy/helm/kvgate with Helm's own engine, in process, without a cluster.

``helm-python-sdk`` binds libhelm_c (Helm v4's Go SDK behind a C ABI) with ctypes: render,
lint and values-schema validation run the same Go code ``helm template`` / ``helm lint``
run, and nothing is downloaded. Its public ``Chart.render`` has no ``api_versions`` option,
but the C ABI's render options do (helm-c-sdk RenderOptions: name, namespace, revision,
is_install, is_upgrade, kube_version, api_versions — the library 0.2.2 ships), so
:func:`render` calls that entry point to stand in for ``helm template --api-versions``:
it is how the tests see a cluster with and without the Prometheus Operator CRDs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python
import yaml
from helm_python import _native

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvgate"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE, NAMESPACE = "kvgate", "llm"
# Helm v4.2's default capabilities (what `helm template` assumes without a cluster).
KUBE_VERSION = "1.36"
MONITORING_API = "monitoring.coreos.com/v1"
LWS_API = "leaderworkerset.x-k8s.io/v1"
ALL_APIS = (MONITORING_API, LWS_API)


@dataclass(slots=True)
class Rendered:
    """One render: the objects (NOTES.txt excluded, as `helm template` does) by kind and name."""

    values: dict[str, Any]
    manifests: dict[str, str]
    objects: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for path, text in sorted(self.manifests.items()):
            if path.endswith("NOTES.txt"):
                continue
            self.objects.extend(doc for doc in yaml.safe_load_all(text) if doc)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
        return found[0]


def load_chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def render(chart: helm_python.Chart, values: dict[str, Any], *, api_versions: tuple[str, ...] = (),
           is_upgrade: bool = False) -> Rendered:
    """``helm template kvgate CHART -n llm -f values [--api-versions ...]`` through libhelm_c.

    Raises helm_python.HelmValuesError (schema) or HelmRenderError (a template's ``fail``).
    """
    opts: dict[str, Any] = {"name": RELEASE, "namespace": NAMESPACE, "api_versions": list(api_versions)}
    if is_upgrade:
        opts["is_upgrade"] = True
    payload = _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts))
    return Rendered(values=values, manifests=json.loads(payload))


def pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of a workload (LeaderWorkerSet: leader and worker)."""
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [spec["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [t for t in (lwt.get("leaderTemplate"), lwt["workerTemplate"]) if t]
    return []


def containers(template: dict[str, Any], *, init: bool = True) -> list[dict[str, Any]]:
    spec = template["spec"]
    return [*(spec.get("initContainers", []) if init else []), *spec["containers"]]


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels AND matchExpressions); {} matches everything."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def gateway(r: Rendered) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gateway Deployment and its one container."""
    deployment = r.get("Deployment", "kvgate-gateway")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def minimal(**overrides: Any) -> dict[str, Any]:
    """The smallest values a render needs (secrets from an existing Secret), with ``overrides``."""
    values: dict[str, Any] = {"secrets": {"existingSecret": "kvgate-secrets"}}
    values.update(overrides)
    return values


def plan_name(pool: str) -> str:
    return f"kvgate-engine-{pool}"


def workload(r: Rendered, pool: str) -> dict[str, Any]:
    found = [o for o in r.objects if o["kind"] in ("StatefulSet", "LeaderWorkerSet") and o["metadata"]["name"] == plan_name(pool)]
    assert len(found) == 1
    return found[0]


def hook(obj: dict[str, Any]) -> tuple[set[str], int]:
    """An object's Helm hook events and weight (empty, 0: a normal release object)."""
    annotations = obj["metadata"].get("annotations", {})
    return set(filter(None, annotations.get("helm.sh/hook", "").split(","))), int(annotations.get("helm.sh/hook-weight", "0"))


def pools_of(r: Rendered) -> list[dict[str, Any]]:
    return r.values["pools"]
