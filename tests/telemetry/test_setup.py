"""`specwire.telemetry.setup_telemetry`: what the OTEL_* and SPECWIRE_PROMETHEUS_* variables turn on."""

from __future__ import annotations

import urllib.request

import pytest
from opentelemetry import trace

from specwire import telemetry
from specwire.security.channels import secure_channel
from specwire.serving import GrpcServer
from tests.telemetry.conftest import telemetry_for_module


@pytest.fixture(autouse=True)
def _fresh():
    telemetry.shutdown_telemetry()
    yield
    telemetry.shutdown_telemetry()


def test_unconfigured_process_sets_up_nothing():
    state = telemetry.setup_telemetry("specwire-test", env={}, set_global=False)
    assert not state.tracing and not state.metrics and state.prometheus_address is None
    assert not telemetry.tracing_enabled()
    assert isinstance(telemetry.get_tracer(), trace.NoOpTracer)
    # No interceptors anywhere: servers and channels are exactly what they were without telemetry.
    assert telemetry.server_interceptors() == [] and telemetry.aio_client_interceptors() == []
    channel = secure_channel("127.0.0.1:1")
    assert type(channel).__module__.startswith("grpc")
    channel.close()


def test_sdk_disabled_wins_over_an_otlp_endpoint():
    env = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    state = telemetry.setup_telemetry("specwire-test", env=env, set_global=False)
    assert not state.tracing and not state.metrics


def test_tracing_on_adds_the_supported_interceptors_and_is_idempotent():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    with telemetry_for_module("specwire-test", env={}, span_exporters=[InMemorySpanExporter()]) as state:
        assert telemetry.setup_telemetry("other-name", env={}) is state  # second call: same state
        assert state.tracing and len(telemetry.server_interceptors()) == 1
        assert len(telemetry.aio_client_interceptors()) == 4
        channel = secure_channel("127.0.0.1:1")
        assert "opentelemetry" in type(channel).__module__
        channel.close()
        # GrpcServer puts the tracing interceptor first.
        server = GrpcServer([], port=0)
        assert server.interceptors == []  # only the extra ones are stored; start() adds telemetry's


def test_resource_from_env_service_name_and_attributes():
    env = {
        "OTEL_SERVICE_NAME": "specwire-target-canary",
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=llm,deployment.environment=ci%20run",
    }
    resource = telemetry.resource_from_env("specwire-target", env)
    assert resource.attributes["service.name"] == "specwire-target-canary"
    assert resource.attributes["k8s.namespace.name"] == "llm"
    assert resource.attributes["deployment.environment"] == "ci run"
    assert resource.attributes["service.namespace"] == "specwire"
    assert telemetry.resource_from_env("specwire-target", {}).attributes["service.name"] == "specwire-target"


@pytest.mark.parametrize(
    ("name", "arg", "want"),
    [
        (None, None, "ParentBased{root:AlwaysOnSampler"),
        ("always_off", None, "AlwaysOffSampler"),
        ("traceidratio", "0.25", "TraceIdRatioBased{0.25}"),
        ("parentbased_traceidratio", "0.5", "ParentBased{root:TraceIdRatioBased{0.5}"),
    ],
)
def test_sampler_from_env(name, arg, want):
    env = {k: v for k, v in {"OTEL_TRACES_SAMPLER": name, "OTEL_TRACES_SAMPLER_ARG": arg}.items() if v}
    assert telemetry.sampler_from_env(env).get_description().startswith(want)


def test_bad_settings_are_refused_with_the_variable_named():
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER"):
        telemetry.sampler_from_env({"OTEL_TRACES_SAMPLER": "sometimes"})
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        telemetry.setup_telemetry(
            "t",
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon",
            },
            set_global=False,
        )


def test_http_protobuf_endpoints_get_the_signal_paths():
    assert (
        telemetry._endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "traces", "http/protobuf")
        == "http://c:4318/v1/traces"
    )
    assert telemetry._endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "metrics", "grpc") == "http://c:4317"


def test_prometheus_binds_loopback_by_default_even_with_the_sdk_disabled():
    # The Helm chart sets OTEL_SDK_DISABLED=true whenever OTLP is off, also when it asks for metrics.
    env = {"SPECWIRE_PROMETHEUS_PORT": "0", "OTEL_SDK_DISABLED": "true"}
    with telemetry_for_module("specwire-test", env=env) as state:
        assert not state.tracing and state.metrics
        host, port = state.prometheus_address
        assert host == "127.0.0.1" and port > 0
        telemetry.get_meter().create_counter("specwire_test_things_total").add(2, {"kind": "x"})
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'specwire_test_things_total{kind="x"' in text and "target_info" in text
    with pytest.raises(OSError):  # shut down: nothing listens any more
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
