"""One speculative request, one trace: client -> target -> config registry and draft service, with the
in-memory exporter. Round spans add up to the response's speculation statistics; a fallback is an event."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from specwire import telemetry
from specwire.client import AsyncTargetClient, ConfigClient, TargetClient
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.serving import GrpcServer, ServiceBinding
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.observability import FALLBACK_EVENT, REQUEST_SPAN, ROUND_SPAN
from tests.servers import free_port, threaded_server, wait_for
from tests.telemetry.conftest import BATCH, PROMPT, telemetry_for_module

TARGET = "/specwire.target.v1.TargetService/Generate"
GET_CONFIG = "/specwire.config.v1.ConfigService/GetConfig"
DRAFT = "/specwire.draft.v1.DraftService/Draft"


@pytest.fixture(scope="module")
def exported():
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    with telemetry_for_module("specwire-test", env={}, span_exporters=[spans], metric_readers=[reader]):
        yield spans, reader


@pytest.fixture(scope="module")
def stack(exported, loaded, tmp_path_factory):
    """Config, draft and target servers on loopback, all traced (in-process: one telemetry)."""
    db = tmp_path_factory.mktemp("registry") / "registry.db"
    with (
        threaded_server(lambda: build_config_server(str(db))) as config,
        threaded_server(lambda: build_draft_server(loaded)) as draft,
    ):
        with ConfigClient(config.address) as registry:
            registry.create(
                "spec-greedy",
                {
                    "max_new_tokens": 16,
                    "do_sample": False,
                    "num_assistant_tokens": 4,
                    "assistant_confidence_threshold": 0.0,
                },
            )
        policy = DraftPolicy(draft.address, round_timeout_s=30.0)
        with threaded_server(lambda: build_target_server(loaded, config.address, drafting=policy)) as target:
            yield target


@pytest.fixture()
def spans(exported):
    """The exporter, cleared once the previous test's spans stopped arriving.

    A cancelled stream's request and draft spans end after its test has returned; cleared too early,
    they would land in the next test's trace checks.
    """
    exporter, _ = exported
    seen, quiet_since = -1, time.monotonic()
    deadline = quiet_since + 10.0
    while time.monotonic() < deadline:
        count = len(exporter.get_finished_spans())
        if count != seen:
            seen, quiet_since = count, time.monotonic()
        elif time.monotonic() - quiet_since >= 0.3:
            break
        time.sleep(0.05)
    exporter.clear()
    return exporter


def _by_name(finished, name, kind=None):
    return [s for s in finished if s.name == name and (kind is None or s.kind == kind)]


def _one(finished, name, kind=None):
    found = _by_name(finished, name, kind)
    assert len(found) == 1, f"{name} {kind}: {[(s.name, s.kind) for s in finished]}"
    return found[0]


def _finished(spans, count_at_least: int, servers=(TARGET,), clients=()):
    # Server spans end a moment after the client has its answer (or its cancel reaches the server), and the draft
    # stream's spans (client and server) after the target's request thread closed the stream: slow on a loaded box.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        finished = spans.get_finished_spans()
        if (
            len(finished) >= count_at_least
            and all(_by_name(finished, s, SpanKind.SERVER) for s in servers)
            and all(_by_name(finished, c, SpanKind.CLIENT) for c in clients)
        ):
            return finished
        time.sleep(0.02)
    return spans.get_finished_spans()


def test_one_speculative_request_is_one_trace_across_the_three_services(stack, spans):
    with TargetClient(stack.address) as client:
        output = client.generate(PROMPT, generation_config="spec-greedy", proposer="draft_model")
    stats = output.speculation
    assert stats.proposer == "draft_model" and stats.rounds > 0 and stats.fallback_reason == ""
    finished = _finished(spans, 8, servers=(TARGET, DRAFT), clients=(DRAFT,))

    assert len({s.context.trace_id for s in finished}) == 1, [(s.name, s.kind) for s in finished]
    client_span = _one(finished, TARGET, SpanKind.CLIENT)
    server_span = _one(finished, TARGET, SpanKind.SERVER)
    request = _one(finished, REQUEST_SPAN)
    config_client, config_server = (
        _one(finished, GET_CONFIG, SpanKind.CLIENT),
        _one(finished, GET_CONFIG, SpanKind.SERVER),
    )
    draft_client, draft_server = (
        _one(finished, DRAFT, SpanKind.CLIENT),
        _one(finished, DRAFT, SpanKind.SERVER),
    )
    rounds = _by_name(finished, ROUND_SPAN)

    # The parent chain: client -> target server -> request -> {config call, draft stream, rounds}.
    assert client_span.parent is None
    assert server_span.parent.span_id == client_span.context.span_id
    assert request.parent.span_id == server_span.context.span_id
    assert config_client.parent.span_id == request.context.span_id
    assert config_server.parent.span_id == config_client.context.span_id
    # The draft stream is opened on the model's worker thread: the copied context makes it a child.
    assert draft_client.parent.span_id == request.context.span_id
    assert draft_server.parent.span_id == draft_client.context.span_id
    assert all(r.parent.span_id == request.context.span_id for r in rounds)

    # Round spans add up to the response's statistics.
    assert len(rounds) == stats.rounds
    assert sum(r.attributes["specwire.speculation.drafted_tokens"] for r in rounds) == stats.drafted_tokens
    assert sum(r.attributes["specwire.speculation.accepted_tokens"] for r in rounds) == stats.accepted_tokens
    for r in rounds:
        a = r.attributes
        assert a["specwire.speculation.proposer"] == "draft_model" and a["specwire.speculation.rows"] == 1
        assert 0 < a["specwire.speculation.drafted_tokens"] <= a["specwire.speculation.draft_length_asked"]
        assert a["specwire.speculation.draft_seconds"] >= 0 and a["specwire.speculation.verify_seconds"] > 0
        assert request.start_time <= r.start_time < r.end_time <= request.end_time

    a = request.attributes
    generated = output.sequences.shape[1] - len(PROMPT)
    assert a["gen_ai.request.model"] == output.model_id and a["specwire.rows"] == 1
    assert a["specwire.config.name"] == "spec-greedy" and a["specwire.config.version"] == 1
    assert a["specwire.speculation.proposer"] == "draft_model"
    assert a["specwire.speculation.draft_length_source"] == stats.draft_length_source
    assert a["specwire.speculation.tokens_without_draft"] == stats.tokens_without_draft
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT) and a["gen_ai.usage.output_tokens"] == generated
    assert list(a["gen_ai.response.finish_reasons"]) == output.finish_reasons
    assert not [e for e in request.events if e.name == FALLBACK_EVENT]


def test_batch_round_spans_and_counters_match_the_response(stack, spans, exported):
    _, reader = exported
    before = _counters(reader)
    with TargetClient(stack.address) as client:
        output = client.generate(BATCH, generation_config="spec-greedy", proposer="draft_model")
    stats = output.speculation
    finished = _finished(spans, 8)
    rounds = _by_name(finished, ROUND_SPAN)
    assert len(rounds) == stats.rounds and all(r.attributes["specwire.speculation.rows"] == 3 for r in rounds)
    assert sum(r.attributes["specwire.speculation.drafted_tokens"] for r in rounds) == stats.drafted_tokens
    assert sum(r.attributes["specwire.speculation.accepted_tokens"] for r in rounds) == stats.accepted_tokens
    drafts = sum(r.attributes["specwire.speculation.drafts"] for r in rounds)
    assert stats.rounds <= drafts <= 3 * stats.rounds

    after = _counters(reader)
    key = (output.model_id, "draft_model", "spec-greedy")
    delta = {
        name: after.get((name, *key), 0) - before.get((name, *key), 0)
        for name in ("drafts", "draft_tokens", "accepted_tokens")
    }
    assert delta == {
        "drafts": drafts,
        "draft_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
    }
    for position, count in enumerate(stats.accepted_by_position):
        name = ("per_position", *key, str(position))
        assert after.get(name, 0) - before.get(name, 0) == count


def _counters(reader) -> dict:
    names = {
        "specwire_spec_decode_drafts_total": "drafts",
        "specwire_spec_decode_draft_tokens_total": "draft_tokens",
        "specwire_spec_decode_accepted_tokens_total": "accepted_tokens",
        "specwire_spec_decode_accepted_tokens_per_position_total": "per_position",
    }
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name in names:
                    for point in metric.data.data_points:
                        labels = point.attributes
                        key = (
                            names[metric.name],
                            labels["model"],
                            labels["proposer"],
                            labels["config"],
                            *([labels["position"]] if "position" in labels else []),
                        )
                        out[key] = point.value
    return out


def test_fallback_to_plain_decoding_is_an_event_with_the_reason(loaded, spans):
    policy = DraftPolicy(f"127.0.0.1:{free_port()}", round_timeout_s=5.0)  # nothing listens there
    with threaded_server(lambda: build_target_server(loaded, drafting=policy)) as target:
        with TargetClient(target.address) as client:
            output = client.generate(PROMPT, max_new_tokens=8, proposer="draft_model")
    reason = output.speculation.fallback_reason
    assert reason.startswith("draft")
    request = _one(_finished(spans, 3), REQUEST_SPAN)
    events = [e for e in request.events if e.name == FALLBACK_EVENT]
    assert len(events) == 1 and events[0].attributes["specwire.speculation.fallback_reason"] == reason
    assert events[0].attributes["specwire.speculation.proposer"] == "draft_model"


def test_sync_stream_carries_the_trace_and_still_cancels(stack, spans):
    tracer = telemetry.get_tracer("tests")
    with tracer.start_as_current_span("caller") as caller, TargetClient(stack.address) as client:
        for item in client.stream(PROMPT, max_new_tokens=200, proposer="prompt_lookup"):
            if hasattr(item, "row"):
                break  # cancels the call (the tracing interceptor keeps the call's cancel())
    finished = _finished(spans, 1, servers=("/specwire.target.v1.TargetService/GenerateStream",))
    server = _one(finished, "/specwire.target.v1.TargetService/GenerateStream", SpanKind.SERVER)
    assert server.parent.span_id == caller.get_span_context().span_id
    assert server.context.trace_id == caller.get_span_context().trace_id
    request = _one(finished, REQUEST_SPAN)
    assert request.attributes.get("error.type") == "cancelled"


def test_a_request_closed_by_another_task_ends_its_span_without_a_detach_error(spans, caplog):
    """A stream the client cancelled can have its handler's generator closed by another task (the event loop's
    async-generator finalizer): the request's span still ends, and no "Failed to detach context" error is logged."""
    from specwire.target.v1 import target_service_pb2 as pb
    from specwire.target_service.observability import RequestObserver, SpecDecodeMetrics

    observer = RequestObserver(
        SpecDecodeMetrics(telemetry.get_meter()), "tiny", "GenerateStream", pb.GenerateStreamRequest()
    )

    async def main(observer):
        async def request():
            observer.__enter__()
            await asyncio.sleep(3600)

        task = asyncio.create_task(request())
        await asyncio.sleep(0)  # the request enters, then waits
        task.cancel()
        observer.__exit__(asyncio.CancelledError, asyncio.CancelledError(), None)  # here, in another task

    gc.collect()  # earlier tests' garbage is collected before, not blamed on this request
    asyncio.run(main(observer))
    del observer
    gc.collect()  # nothing the request made current is left for the garbage collector to undo (and fail to)
    assert [r.getMessage() for r in caplog.records if r.name == "opentelemetry.context"] == []
    assert _one(spans.get_finished_spans(), REQUEST_SPAN).attributes.get("error.type") == "cancelled"


def test_a_stream_cancelled_while_its_message_waits_ends_its_span_without_a_detach_error(spans, caplog):
    """A stream cancelled while its handler waits at a `yield` (the client stopped reading; gRPC's flow control holds
    the message) is closed in its own task: the server span ends, and no "Failed to detach context" is logged. gRPC
    alone leaves that generator to the event loop's finalizer, in another context (`StreamsCloseInTheirTask`)."""
    closed = threading.Event()

    async def flood(request, context):
        try:
            while True:
                yield b"x" * (4 << 20)  # a few of these fill the flow-control windows
        finally:
            closed.set()

    method = grpc.unary_stream_rpc_method_handler(flood)
    handlers = grpc.method_handlers_generic_handler("test.Flood", {"Flood": method})
    binding = ServiceBinding(lambda servicer, server: server.add_generic_rpc_handlers((handlers,)), None, "test.Flood")
    with threaded_server(lambda: GrpcServer([binding])) as server:
        with grpc.insecure_channel(server.address) as channel:
            call = channel.unary_stream("/test.Flood/Flood")(b"", timeout=60)
            next(call)
            time.sleep(0.5)  # the handler fills the windows and waits at its yield
            call.cancel()
        wait_for(closed.is_set, timeout=30)
        for _ in range(3):  # what the finalizer would close, closed now
            gc.collect()
            server.run(asyncio.sleep(0.1))
    # (gRPC itself may log the failed write as an ExecuteBatchError, when it sees the write fail before the cancel.)
    assert [r.getMessage() for r in caplog.records if r.name == "opentelemetry.context"] == []
    assert len(_by_name(spans.get_finished_spans(), "/test.Flood/Flood", SpanKind.SERVER)) == 1


def test_async_client_joins_the_trace(stack, spans):
    async def call():
        async with AsyncTargetClient(stack.address) as client:
            return await client.generate(PROMPT, max_new_tokens=6)

    with telemetry.get_tracer("tests").start_as_current_span("caller") as caller:
        asyncio.run(call())
    finished = _finished(spans, 4)
    assert {s.context.trace_id for s in finished} == {caller.get_span_context().trace_id}
    assert _one(finished, TARGET, SpanKind.CLIENT).parent.span_id == caller.get_span_context().span_id


def test_errors_keep_their_codes_and_field_violations_when_traced(stack, spans):
    from specwire.client.errors import SpecwireRpcError

    with TargetClient(stack.address) as client, pytest.raises(SpecwireRpcError) as raised:
        client.generate(PROMPT, max_new_tokens=4, temperature=-1.0, do_sample=True)
    assert raised.value.code().name == "INVALID_ARGUMENT"
    assert any("temperature" in v.field for v in raised.value.violations)
    finished = _finished(spans, 2)
    server = _one(finished, TARGET, SpanKind.SERVER)
    assert server.attributes["rpc.grpc.status_code"] == 3  # INVALID_ARGUMENT (a caller's error: status stays UNSET)
    request = _one(finished, REQUEST_SPAN)
    assert request.status.status_code.name == "ERROR" and request.events[0].name == "exception"
