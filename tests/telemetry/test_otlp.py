"""Traces and metrics reach a real OTLP/gRPC receiver on loopback through the OTel exporters."""

from __future__ import annotations

import pytest

from specwire import telemetry
from specwire.client import TargetClient
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.observability import REQUEST_SPAN, ROUND_SPAN
from tests.otlp_sink import OtlpSink, attributes
from tests.servers import threaded_server
from tests.telemetry.conftest import PROMPT, telemetry_for_module


@pytest.fixture(scope="module")
def sink():
    with OtlpSink() as sink:
        yield sink


def test_traces_and_metrics_arrive_over_otlp_grpc(sink, loaded):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "specwire-target-ci",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=ci",
    }
    with telemetry_for_module("specwire-target", env=env) as state:
        assert state.tracing and state.metrics
        with threaded_server(lambda: build_draft_server(loaded)) as draft:
            policy = DraftPolicy(draft.address, round_timeout_s=30.0)
            with (
                threaded_server(lambda: build_target_server(loaded, drafting=policy)) as target,
                TargetClient(target.address) as client,
            ):
                output = client.generate(PROMPT, max_new_tokens=12, proposer="draft_model", num_assistant_tokens=3)
        telemetry.current().force_flush()
        assert sink.wait(lambda: any(s["name"] == REQUEST_SPAN for _, s in sink.spans()))
        assert sink.wait(lambda: "specwire_spec_decode_draft_tokens_total" in sink.metric_names())

    stats = output.speculation
    assert stats.proposer == "draft_model" and stats.rounds > 0
    spans = sink.spans()
    resource, request = next((r, s) for r, s in spans if s["name"] == REQUEST_SPAN)
    assert resource["service.name"] == "specwire-target-ci" and resource["deployment.environment"] == "ci"
    rounds = [s for _, s in spans if s["name"] == ROUND_SPAN]
    assert len(rounds) == stats.rounds
    assert {s["traceId"] for s in rounds} == {request["traceId"]}
    assert {s["parentSpanId"] for s in rounds} == {request["spanId"]}
    drafted = sum(int(attributes(s)["specwire.speculation.drafted_tokens"]) for s in rounds)
    assert drafted == stats.drafted_tokens
    server = next(s for _, s in spans if s["name"] == "/specwire.target.v1.TargetService/Generate")
    assert server["traceId"] == request["traceId"] and request["parentSpanId"] == server["spanId"]

    assert {
        "specwire_spec_decode_drafts_total",
        "specwire_spec_decode_draft_tokens_total",
        "specwire_spec_decode_accepted_tokens_total",
        "specwire_spec_decode_accepted_tokens_per_position_total",
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
    } <= sink.metric_names()
