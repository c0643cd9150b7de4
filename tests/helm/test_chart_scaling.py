"""Scaling the target: the headless target Service for client-side load balancing, and the HPA on the
target's load gauges (Pods metrics through the Prometheus adapter), rendered and validated."""

from __future__ import annotations

import pytest

from specwire.vocabulary import METRIC_KV_SLOT_USAGE, METRIC_REQUESTS_QUEUED, METRIC_REQUESTS_RUNNING
from tests.helm.rendering import (
    CHART,
    KUBE_VERSIONS,
    NAMESPACE,
    PORTS,
    RELEASE,
    Rendered,
    helm,
    kubernetes_validate,
    template,
)

HEADLESS = f"{RELEASE}-specwire-target-headless"


def headless(r: Rendered) -> list[dict]:
    return [d for d in r.all("Service") if d["metadata"]["name"] == HEADLESS]


def test_headless_target_service_next_to_the_cluster_ip_one(renders):
    r = renders["default"]
    (svc,) = headless(r)
    spec = svc["spec"]
    assert spec["clusterIP"] == "None"
    assert spec["selector"] == r.get("Service", "target")["spec"]["selector"]
    assert spec["selector"] == r.get("Deployment", "target")["spec"]["selector"]["matchLabels"]
    # gRPC only: the ServiceMonitor selects Services by labels and scrapes their `metrics` port, so a
    # metrics port here would scrape every target pod twice (and double a per-pod sum).
    assert spec["ports"] == [
        {"name": "grpc", "port": PORTS["target"], "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}
    ]
    assert svc["metadata"]["namespace"] == NAMESPACE
    assert r.get("Service", "target")["spec"].get("clusterIP") is None  # the ClusterIP Service stays


def test_notes_name_the_headless_address(tools):
    """NOTES.txt is not a manifest: read it from a client-side dry-run install."""
    out = helm(tools, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE).stdout
    notes = out[out.index("NOTES:") :]
    assert f"dns:///{HEADLESS}.{NAMESPACE}.svc.cluster.local:{PORTS['target']}" in notes


def test_headless_target_service_is_optional_and_takes_annotations(tools):
    assert not headless(Rendered(template(tools, "--set", "target.service.headless.enabled=false").stdout))
    r = Rendered(template(tools, "--set", "target.service.headless.annotations.team=ml").stdout)
    assert headless(r)[0]["metadata"]["annotations"]["team"] == "ml"


def test_the_address_a_client_dials_is_a_round_robin_target(renders):
    from specwire.security.channels import load_balancing_policy

    address = f"dns:///{HEADLESS}.{NAMESPACE}.svc.cluster.local:{PORTS['target']}"
    assert load_balancing_policy(address) == "round_robin"


LOAD = [
    "--set",
    "metrics.enabled=true,target.autoscaling.enabled=true,target.autoscaling.targetCPUUtilizationPercentage=null",
    "--set-string",
    "target.autoscaling.load.requestsQueued=2,target.autoscaling.load.requestsRunning=12,"
    "target.autoscaling.load.kvSlotUsage=800m",
]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_hpa_scales_on_the_target_load_gauges(tools, kube_version):
    text = template(tools, *LOAD, kube_version=kube_version).stdout
    hpa = Rendered(text).get("HorizontalPodAutoscaler", "target")
    metrics = {m["pods"]["metric"]["name"]: m for m in hpa["spec"]["metrics"]}
    # The names the target exports (specwire.vocabulary), as the adapter rule in the README keeps them.
    assert set(metrics) == {METRIC_REQUESTS_QUEUED, METRIC_REQUESTS_RUNNING, METRIC_KV_SLOT_USAGE}
    assert all(m["type"] == "Pods" for m in metrics.values())
    assert metrics[METRIC_REQUESTS_QUEUED]["pods"]["target"] == {"type": "AverageValue", "averageValue": "2"}
    assert metrics[METRIC_KV_SLOT_USAGE]["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}
    proc = kubernetes_validate(tools, text, kube_version)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_load_metrics_alone_are_enough_and_extra_metrics_follow(tools, renders):
    r = Rendered(template(tools, *LOAD[:2], "--set-string", "target.autoscaling.load.requestsQueued=3").stdout)
    (metric,) = r.get("HorizontalPodAutoscaler", "target")["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == METRIC_REQUESTS_QUEUED
    example = renders["gpu-cluster"].get("HorizontalPodAutoscaler", "target")["spec"]["metrics"]
    names = [m["pods"]["metric"]["name"] for m in example]
    assert names == [METRIC_REQUESTS_QUEUED, METRIC_KV_SLOT_USAGE, "DCGM_FI_DEV_GPU_UTIL"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--set", "target.autoscaling.enabled=true", "--set-string", "target.autoscaling.load.requestsQueued=2"],
            "target.autoscaling.load.requestsQueued needs metrics.enabled=true",
        ),
        (
            ["--set", "target.autoscaling.enabled=true,target.autoscaling.targetCPUUtilizationPercentage=null"],
            "set targetCPUUtilizationPercentage, metrics or load",
        ),
    ],
)
def test_inconsistent_load_values_fail_with_a_hint(tools, args, message):
    proc = template(tools, *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args, complaint",
    [
        (["--set-string", "target.autoscaling.load.requestsQueud=2"], "requestsQueud"),
        (["--set-string", "target.autoscaling.load.kvSlotUsage=most"], "kvSlotUsage"),
        (["--set-string", "draft.autoscaling.load.requestsQueued=2"], "load"),
        (["--set", "target.service.headless.enable=true"], "enable"),
    ],
)
def test_schema_rejects_bad_scaling_values(tools, args, complaint):
    proc = template(tools, *args, check=False)
    assert proc.returncode != 0, f"{args} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert complaint in proc.stderr
