"""Rendering the Helm chart (helm/specwire) for the tests: where things are, `helm template`, and
lookups into the rendered objects. The fixtures that use them (`tools`, `renders`) are in conftest.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specwire"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
TOOLS = Path(os.environ.get("TOOLS", ROOT / ".tools"))
RELEASE = "rel"
NAMESPACE = "specwire-test"
# Oldest version the chart is validated for, and the newest that kubernetes-validate ships.
KUBE_VERSIONS = ["1.33.0", "1.37.0"]

COMPONENTS = ("config", "draft", "target")
HEALTH_NAMES = {
    "config": "specwire.config.v1.ConfigService",
    "draft": "specwire.draft.v1.DraftService",
    "target": "specwire.target.v1.TargetService",
}
PORTS = {"config": 50051, "target": 50052, "draft": 50053}
SELECTOR_KEYS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"}
# User labels and annotations that must reach metadata but never a selector.
USER_LABELS = [
    "--set",
    "commonLabels.team=ml-platform",
    "--set",
    "commonLabels.cost-center=gpu-42",
    "--set-string",
    "target.podLabels.canary=true",
    "--set",
    "draft.podLabels.app\\.kubernetes\\.io/component=hijacked",
    "--set",
    "commonAnnotations.owner=ml",
]


def helm(tools, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([tools["helm"], *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stderr}"
    return proc


def template(tools, *args: str, check: bool = True, kube_version: str = KUBE_VERSIONS[0]):
    return helm(
        tools,
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        kube_version,
        *args,
        check=check,
    )


def parse(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


class Rendered:
    """The objects of one render, with lookups by kind and component."""

    def __init__(self, text: str):
        self.text = text
        self.docs = parse(text)

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, component: str | None = None) -> dict:
        name = f"{RELEASE}-specwire" + (f"-{component}" if component else "")
        found = [d for d in self.all(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def container(self, component: str) -> dict:
        (container,) = self.get("Deployment", component)["spec"]["template"]["spec"]["containers"]
        return container

    def pod_spec(self, component: str) -> dict:
        return self.get("Deployment", component)["spec"]["template"]["spec"]

    def settings(self, component: str) -> dict:
        return self.get("ConfigMap", component)["data"]


# Renders shared by many tests: the default values and every example, each rendered once.
VARIANTS = {"default": []} | {p.stem: ["-f", str(p)] for p in EXAMPLES}


def kubernetes_validate(tools, text: str, kube_version: str = KUBE_VERSIONS[0]) -> subprocess.CompletedProcess:
    """`kubernetes-validate --strict` on rendered objects: every field checked against the Kubernetes schema."""
    return subprocess.run(
        [tools["kubernetes-validate"], "--strict", "--quiet", "-k", kube_version, "-"],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )


def pods(r: Rendered) -> list[tuple[str, dict]]:
    """(name, pod spec) of every Deployment's pod template and of every bare Pod (the `helm test` pod)."""
    found = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in r.all("Deployment")]
    return found + [(d["metadata"]["name"], d["spec"]) for d in r.all("Pod")]
