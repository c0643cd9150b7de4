"""The chart's pods: GPU pools, probes and shutdown, labels and selectors, the config registry's
storage, scaling and disruption, secrets, telemetry and metrics."""

from __future__ import annotations

import argparse
import re

import pytest

from tests.helm.rendering import (
    CHART,
    COMPONENTS,
    HEALTH_NAMES,
    NAMESPACE,
    PORTS,
    RELEASE,
    SELECTOR_KEYS,
    USER_LABELS,
    VARIANTS,
    Rendered,
    template,
)

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


def test_tensor_parallel_target_takes_one_gpu_per_rank(tools):
    """`target.tensorParallel: 2`: 2 GPUs per pod, `--tensor-parallel 2` on the command line (parsed by the
    target's real CLI), the chart's scheduler (batched by default, sequential when asked), and a
    memory-backed /dev/shm for NCCL."""
    from specwire.target_service.__main__ import build_parser

    def parsed_args(*values: str) -> argparse.Namespace:
        rendered = Rendered(template(tools, "--set", "target.gpu.enabled=true", *values).stdout)
        data = rendered.settings("target")
        args = [re.sub(r"\$\((\w+)\)", lambda m: data[m.group(1)], a) for a in rendered.container("target")["args"]]
        return build_parser().parse_args(args)

    r = Rendered(template(tools, "--set", "target.gpu.enabled=true", "--set", "target.tensorParallel=2").stdout)
    assert gpu_count(r.container("target")) == (2, 2)
    parsed = parsed_args("--set", "target.tensorParallel=2")
    assert (parsed.tensor_parallel, parsed.scheduler, parsed.device) == (2, "batched", "cuda")
    sequential = parsed_args("--set", "target.tensorParallel=2", "--set", "target.scheduler.mode=sequential")
    assert (sequential.tensor_parallel, sequential.scheduler) == (2, "sequential")
    volumes = {v["name"]: v for v in r.pod_spec("target")["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in r.container("target")["volumeMounts"]
    # One rank (the default): no flag, no shared-memory volume, the GPU count as asked.
    default = Rendered(template(tools, "--set", "target.gpu.enabled=true").stdout)
    assert "--tensor-parallel" not in default.container("target")["args"]
    assert "dshm" not in {v["name"] for v in default.pod_spec("target")["volumes"]}
    assert gpu_count(default.container("target")) == (1, 1)


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


def test_config_registry_volume_is_kept_on_uninstall_unless_turned_off(renders, tools):
    pvc = renders["default"].get("PersistentVolumeClaim", "config-data")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    args = ["--set", "config.persistence.keepOnUninstall=false", "--set", "config.persistence.annotations.team=a"]
    pvc = Rendered(template(tools, *args).stdout).get("PersistentVolumeClaim", "config-data")
    assert pvc["metadata"]["annotations"] == {"team": "a"}


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


def test_admin_token_reaches_the_registry_only_and_plaintext_tokens_are_asked_for(tools):
    secrets = ["--set", "auth.existingSecret=reader", "--set", "auth.adminExistingSecret=admin"]
    r = Rendered(template(tools, *secrets, "--set", "auth.allowInsecureToken=true").stdout)
    admin = env_of(r.container("config"))["SPECWIRE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert admin == {"name": "admin", "key": "token"}
    for c in COMPONENTS:
        # The target holds the reader token only: it reads the registry, it never writes it.
        assert ("SPECWIRE_ADMIN_TOKEN" in env_of(r.container(c))) == (c == "config")
        assert env_of(r.container(c))["SPECWIRE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "reader"
        # Without TLS the servers serve (and the target sends) the tokens in plaintext only when asked.
        assert r.settings(c)["SPECWIRE_ALLOW_INSECURE_TOKEN"] == "true"
    tls = ["--set", "tls.enabled=true", "--set", "tls.secretName=specwire-tls"]
    r = Rendered(template(tools, *secrets, *tls, "--set", "auth.allowInsecureToken=true").stdout)
    assert not any("SPECWIRE_ALLOW_INSECURE_TOKEN" in r.settings(c) for c in COMPONENTS)


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


def test_target_plugins_value_becomes_the_plugins_flag(tools, renders):
    r = Rendered(template(tools, "--set", "target.plugins={ban_tokens,max_sentences}").stdout)
    assert r.settings("target")["SPECWIRE_TARGET_PLUGINS"] == "ban_tokens,max_sentences"
    args = r.container("target")["args"]
    assert args[args.index("--plugins") + 1] == "$(SPECWIRE_TARGET_PLUGINS)"
    # None by default: no flag, no setting.
    assert "--plugins" not in renders["default"].container("target")["args"]
