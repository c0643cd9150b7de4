"""The chart's hardening (#20 items 4 and 6): the registry in PostgreSQL with several replicas, a
certificate Secret per service, NetworkPolicies, and bounded local storage. Each render is validated
strictly against the Kubernetes schemas, then checked object by object."""

from __future__ import annotations

import re

import pytest

from tests.helm.rendering import (
    COMPONENTS,
    KUBE_VERSIONS,
    PORTS,
    RELEASE,
    VARIANTS,
    Rendered,
    kubernetes_validate,
    pods,
    template,
)

POSTGRESQL = ["--set", "config.postgresql.existingSecret=registry-pg", "--set", "config.replicaCount=3"]
NETWORK_POLICY = [
    "--set", "networkPolicy.enabled=true",
    "--set", "networkPolicy.clientNamespaces[0]=gateway",
    "--set-string", "networkPolicy.adminNamespaceSelector.matchLabels.specwire-admin=true",
]  # fmt: skip


def render_validated(tools, *args: str) -> Rendered:
    """Render with `args`, validate strictly on the oldest and newest Kubernetes, and parse."""
    text = template(tools, *args).stdout
    for version in KUBE_VERSIONS:
        proc = kubernetes_validate(tools, text, version)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return Rendered(text)


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def volumes_of(spec: dict) -> dict[str, dict]:
    return {v["name"]: v for v in spec.get("volumes", [])}


# --- the registry in PostgreSQL ------------------------------------------------------------------


def test_postgresql_registry_with_three_replicas(tools):
    r = render_validated(tools, *POSTGRESQL, "--set", "config.postgresql.secretKey=dsn")
    deployment = r.get("Deployment", "config")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    container = r.container("config")
    # The URL (with its password) comes from the Secret, as the server's --db default: not on the
    # command line, not in the ConfigMap.
    assert env_of(container)["SPECWIRE_DB"]["valueFrom"]["secretKeyRef"] == {"name": "registry-pg", "key": "dsn"}
    assert "--db" not in container["args"] and "$(SPECWIRE_DB)" not in container["args"]
    assert "SPECWIRE_DB" not in r.settings("config")
    # No volume for a database file, no claim.
    assert not r.all("PersistentVolumeClaim")
    assert "data" not in volumes_of(r.pod_spec("config"))
    assert "data" not in {m["name"] for m in container["volumeMounts"]}


def test_sqlite_registry_keeps_its_file_volume_and_recreate(renders):
    """Control for the test above: without PostgreSQL the registry is one pod on its volume."""
    r = renders["default"]
    assert r.get("Deployment", "config")["spec"]["strategy"] == {"type": "Recreate"}
    assert "--db" in r.container("config")["args"] and "SPECWIRE_DB" not in env_of(r.container("config"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "config.replicaCount=2"],
            "config.replicaCount is 2 but the registry is on SQLite, which has one writer on one ReadWriteOnce "
            "volume: set config.replicaCount=1, or store the registry in PostgreSQL with "
            "config.postgresql.existingSecret",
        ),
        (
            [*POSTGRESQL, "--set", "config.persistence.existingClaim=old-db"],
            "config.persistence.existingClaim is set but config.postgresql.existingSecret",
        ),
    ],
)
def test_registry_storage_contradictions_fail_the_render(tools, args, message):
    proc = template(tools, *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# --- a certificate per service -------------------------------------------------------------------


def test_each_service_can_have_its_own_certificate(tools):
    per_service = [arg for c in COMPONENTS for arg in ("--set", f"{c}.tls.secretName={c}-cert")]
    r = render_validated(tools, "--set", "tls.enabled=true", *per_service)
    for c in COMPONENTS:
        assert volumes_of(r.pod_spec(c))["tls"]["secret"]["secretName"] == f"{c}-cert"
    # The helm test pod is a client: it presents the target's certificate (valid for client auth).
    (test_pod,) = r.all("Pod")
    assert volumes_of(test_pod["spec"])["tls"]["secret"]["secretName"] == "target-cert"


def test_the_shared_certificate_is_the_default(tools):
    r = render_validated(tools, "--set", "tls.enabled=true,tls.secretName=shared", "--set", "draft.tls.secretName=own")
    secrets = {c: volumes_of(r.pod_spec(c))["tls"]["secret"]["secretName"] for c in COMPONENTS}
    assert secrets == {"config": "shared", "draft": "own", "target": "shared"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "tls.enabled=true", "--set", "config.tls.secretName=a", "--set", "target.tls.secretName=b"],
            "tls.enabled needs a certificate Secret for draft: set tls.secretName",
        ),
        (["--set", "target.tls.secretName=b"], "target.tls.secretName is set but tls.enabled is false"),
    ],
)
def test_certificate_contradictions_fail_the_render(tools, args, message):
    proc = template(tools, *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# --- NetworkPolicy -------------------------------------------------------------------------------


def policy(r: Rendered, component: str) -> dict:
    return r.get("NetworkPolicy", component)["spec"]


def grpc_sources(r: Rendered, component: str) -> list[dict]:
    (rule,) = [
        i for i in policy(r, component)["ingress"] if i["ports"] == [{"port": PORTS[component], "protocol": "TCP"}]
    ]
    return rule["from"]


def component_peer(component: str) -> dict:
    return {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "specwire",
                "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": component,
            }
        }
    }


def test_network_policy_is_opt_in(renders):
    for variant in ("default", "minimal-cpu", "gpu-cluster"):
        assert not renders[variant].all("NetworkPolicy"), variant


def test_network_policies_allow_only_the_service_flows(tools):
    r = render_validated(tools, *NETWORK_POLICY, *POSTGRESQL)
    assert len(r.all("NetworkPolicy")) == 3
    for c in COMPONENTS:
        spec = policy(r, c)
        # Each policy selects exactly its service's pods, and governs both directions.
        assert spec["podSelector"]["matchLabels"] == r.get("Deployment", c)["spec"]["selector"]["matchLabels"]
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        dns = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
        assert spec["egress"][0] == dns, c
        # The ports opened are the containers' ports.
        assert PORTS[c] in {p["containerPort"] for p in r.container(c)["ports"]}
    test_pod = component_peer("test")
    # Targets: labelled clients of this namespace and every pod of the listed namespaces.
    assert grpc_sources(r, "target") == [
        {"podSelector": {"matchLabels": {"specwire-client": "true"}}},
        {
            "namespaceSelector": {
                "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["gateway"]}]
            }
        },
        test_pod,
    ]
    # Draft: the targets only.
    assert grpc_sources(r, "draft") == [component_peer("target"), test_pod]
    # Registry: the targets (reads) and the admin namespaces (writes); not the target's clients.
    assert grpc_sources(r, "config") == [
        component_peer("target"),
        {"namespaceSelector": {"matchLabels": {"specwire-admin": "true"}}},
        test_pod,
    ]
    # Egress: the target reaches the draft and the registry; the registry reaches PostgreSQL.
    target_egress = policy(r, "target")["egress"][1:]
    assert target_egress == [
        {"to": [component_peer("draft")], "ports": [{"port": PORTS["draft"], "protocol": "TCP"}]},
        {"to": [component_peer("config")], "ports": [{"port": PORTS["config"], "protocol": "TCP"}]},
    ]
    assert policy(r, "config")["egress"][1:] == [{"ports": [{"port": 5432, "protocol": "TCP"}]}]
    assert policy(r, "draft")["egress"][1:] == []


def test_network_policy_optional_flows(tools):
    args = [
        *NETWORK_POLICY,
        "--set", "metrics.enabled=true",
        "--set", "otel.enabled=true,otel.endpoint=http://collector.obs:4317",
        "--set", "networkPolicy.otlpTo[0].namespaceSelector.matchLabels.name=obs",
        "--set", "networkPolicy.allowHttpsEgress=true",
        "--set", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
        "--set", "target.configAddress=registry.elsewhere:50051",
        "--set", "networkPolicy.extraEgress[0].ports[0].port=50051",
        "--set", "helmTest.enabled=false",
    ]  # fmt: skip
    r = render_validated(tools, *args)
    otlp = {
        "ports": [{"port": 4317, "protocol": "TCP"}, {"port": 4318, "protocol": "TCP"}],
        "to": [{"namespaceSelector": {"matchLabels": {"name": "obs"}}}],
    }
    https = {"ports": [{"port": 443, "protocol": "TCP"}]}
    extra = {"ports": [{"port": 50051}]}
    metrics = {
        "ports": [{"port": 9464, "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
    }
    for c in COMPONENTS:
        spec = policy(r, c)
        assert metrics in spec["ingress"], c
        assert otlp in spec["egress"] and extra in spec["egress"], c
        assert (https in spec["egress"]) == (c != "config"), c
        assert component_peer("test") not in grpc_sources(r, c), "helmTest is off"
    # An external registry is not opened by the policy itself (extraEgress does it).
    target_peers = [p for rule in policy(r, "target")["egress"] for p in rule.get("to", [])]
    assert component_peer("config") not in target_peers and component_peer("draft") in target_peers


# --- bounded local storage -----------------------------------------------------------------------

UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(value) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", str(value)).groups()
    return int(number) * UNITS[unit]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_emptydir_and_container_has_a_storage_limit(renders, variant):
    checked = 0
    for name, spec in pods(renders[variant]):
        empty_dirs = [v["emptyDir"] for v in spec.get("volumes", []) if "emptyDir" in v]
        for volume in empty_dirs:
            assert "sizeLimit" in volume, f"{name}: an emptyDir without sizeLimit"
        for container in spec["containers"]:
            resources = container["resources"]
            request = quantity(resources["requests"]["ephemeral-storage"])
            limit = quantity(resources["limits"]["ephemeral-storage"])
            assert 0 < request <= limit, name
            # The pod is evicted past its containers' limits, emptyDirs included: they must fit.
            assert limit > sum(quantity(v["sizeLimit"]) for v in empty_dirs), name
            checked += 1
    assert checked >= 3


def test_storage_limits_follow_the_values(tools):
    args = [
        "--set", "config.persistence.enabled=false,config.persistence.emptyDirSizeLimit=300Mi",
        "--set", "target.tmpSizeLimit=3Gi,helmTest.tmpSizeLimit=32Mi",
        "--set", "draft.resources.limits.ephemeral-storage=20Gi",
    ]  # fmt: skip
    r = render_validated(tools, *args)
    assert volumes_of(r.pod_spec("config"))["data"]["emptyDir"] == {"sizeLimit": "300Mi"}
    assert volumes_of(r.pod_spec("target"))["tmp"]["emptyDir"] == {"sizeLimit": "3Gi"}
    (test_pod,) = r.all("Pod")
    assert volumes_of(test_pod["spec"])["tmp"]["emptyDir"] == {"sizeLimit": "32Mi"}
    assert r.container("draft")["resources"]["limits"]["ephemeral-storage"] == "20Gi"


def test_production_example_combines_them(renders):
    r = renders["production-ha"]
    assert r.get("Deployment", "config")["spec"]["replicas"] == 3
    assert env_of(r.container("config"))["SPECWIRE_DB"]["valueFrom"]["secretKeyRef"]["name"] == "specwire-registry-db"
    secrets = {volumes_of(r.pod_spec(c))["tls"]["secret"]["secretName"] for c in COMPONENTS}
    assert secrets == {"specwire-config-tls", "specwire-draft-tls", "specwire-target-tls"}
    assert len(r.all("NetworkPolicy")) == 3 and r.get("PodDisruptionBudget", "config")
