"""Traces and metrics of the target service's generation requests.

Statistics stay apart from exporters: the decoding loop fills a `SpeculationStats` (also returned in
every response); after each request `RequestObserver` turns it into one span per speculative round
(children of the request's span) and feeds `SpecDecodeMetrics`, which only calls the OpenTelemetry
metrics API. Where the numbers go (OTLP, a Prometheus scrape endpoint, nowhere) is
`specwire.telemetry`'s business.

Formulas (per proposer and config, over any window of the counters):

    acceptance rate          = accepted_tokens / draft_tokens
    mean acceptance length   = 1 + accepted_tokens / drafts     (tokens gained per draft, bonus included)
    acceptance at position i = accepted_tokens_per_position{position=i} / drafts
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Status, StatusCode

from specwire import telemetry
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.speculation.stats import SpeculationStats
from specwire.vocabulary import (
    LABEL_CONFIG,
    LABEL_MODEL,
    LABEL_POSITION,
    LABEL_PROPOSER,
    METRIC_ACCEPTED_PER_POSITION,
    METRIC_ACCEPTED_TOKENS,
    METRIC_DRAFT_TOKENS,
    METRIC_DRAFTS,
    METRIC_KV_SLOT_USAGE,
    METRIC_KV_SLOTS,
    METRIC_KV_SLOTS_USED,
    METRIC_REQUEST_DURATION,
    METRIC_REQUESTS_QUEUED,
    METRIC_REQUESTS_RUNNING,
    METRIC_TIME_PER_OUTPUT_TOKEN,
    METRIC_TIME_TO_FIRST_TOKEN,
    PROPOSER_NONE,
)

# Bucket boundaries the GenAI semantic conventions recommend for these histograms.
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]

REQUEST_SPAN = "specwire.generate"
ROUND_SPAN = "specwire.speculative_round"
FALLBACK_EVENT = "speculation.fallback"
_STOPPED = (GeneratorExit, asyncio.CancelledError)  # the client went away: not an error of ours


class SpecDecodeMetrics:
    """Speculative-decoding counters and request-latency histograms, labelled model/proposer/config.

    Args:
        meter (`Meter`): where the instruments live (`specwire.telemetry.get_meter()`; a no-op meter
            when telemetry is off).
    """

    def __init__(self, meter: Any):
        self.drafts = meter.create_counter(
            METRIC_DRAFTS, unit="{draft}", description="Drafts: one per row per speculative round with a draft"
        )
        self.draft_tokens = meter.create_counter(
            METRIC_DRAFT_TOKENS, unit="{token}", description="Draft tokens proposed"
        )
        self.accepted_tokens = meter.create_counter(
            METRIC_ACCEPTED_TOKENS, unit="{token}", description="Draft tokens accepted by the target"
        )
        self.accepted_per_position = meter.create_counter(
            METRIC_ACCEPTED_PER_POSITION, unit="{token}", description="Accepted draft tokens by position (0-based)"
        )
        self.request_duration = meter.create_histogram(
            METRIC_REQUEST_DURATION,
            unit="s",
            description="Generation request duration in the target service",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.time_to_first_token = meter.create_histogram(
            METRIC_TIME_TO_FIRST_TOKEN,
            unit="s",
            description="Time from arrival to the first generated token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.time_per_output_token = meter.create_histogram(
            METRIC_TIME_PER_OUTPUT_TOKEN,
            unit="s",
            description="Time per output token after the first",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )

    def record_speculation(self, stats: SpeculationStats, labels: dict[str, str]) -> None:
        """Add one request's speculation statistics (nothing for requests that did not speculate)."""
        if stats.proposer == PROPOSER_NONE:
            return
        drafts = sum(r.drafted_rows for r in stats.round_log)
        self.drafts.add(drafts, labels)
        self.draft_tokens.add(stats.drafted_tokens, labels)
        self.accepted_tokens.add(stats.accepted_tokens, labels)
        for position, count in enumerate(stats.accepted_by_position):
            self.accepted_per_position.add(count, {**labels, LABEL_POSITION: str(position)})

    def record_latency(
        self,
        labels: dict[str, str],
        duration_s: float,
        ttft_s: float | None,
        tpot_s: float | None,
        error: str | None = None,
    ) -> None:
        self.request_duration.record(duration_s, {**labels, "error.type": error} if error else labels)
        if error:
            return
        if ttft_s is not None:
            self.time_to_first_token.record(ttft_s, labels)
        if tpot_s is not None:
            self.time_per_output_token.record(tpot_s, labels)


class LoadGauges:
    """The load of this process's engines as observable gauges (`EngineLoad`), the autoscaling signals.

    Read at each collection (a Prometheus scrape, an OTLP export), never pushed: a scrape sees the queue
    as it is now. One set of gauges per meter (an instrument registered twice keeps its first
    callbacks), summing every live engine of a model, so a second server in one process (tests) counts
    too; engines are held weakly. Use `load_gauges(meter).watch(engine, model_id)`.
    """

    def __init__(self, meter: Any):
        self._engines: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

        def gauge(name: str, unit: str, description: str, read: Callable[[dict[str, list[int]], str], float | None]):
            meter.create_observable_gauge(
                name, callbacks=[lambda options: self._observe(read, options)], unit=unit, description=description
            )

        gauge(METRIC_REQUESTS_QUEUED, "{request}", "Requests waiting for KV slots", lambda t, m: t[m][1])
        gauge(METRIC_REQUESTS_RUNNING, "{request}", "Requests generating", lambda t, m: t[m][0])
        gauge(METRIC_KV_SLOTS_USED, "{slot}", "KV-cache slots taken (one per running row)", lambda t, m: t[m][2])
        gauge(METRIC_KV_SLOTS, "{slot}", "KV-cache slots in all", lambda t, m: t[m][3])
        gauge(
            METRIC_KV_SLOT_USAGE,
            "1",
            "Share of the KV-cache slots taken, 0 to 1",
            lambda t, m: t[m][2] / t[m][3] if t[m][3] else None,
        )

    def watch(self, engine: Any, model_id: str) -> None:
        """Report `engine`'s load (its `load()`) under the `model` label `model_id` while it lives."""
        with self._lock:
            self._engines[engine] = model_id

    def _observe(self, read: Callable[[dict[str, list[int]], str], float | None], _options: CallbackOptions):
        with self._lock:
            engines = list(self._engines.items())
        totals: dict[str, list[int]] = {}
        for engine, model in engines:
            load = engine.load()
            total = totals.setdefault(model, [0, 0, 0, 0])
            for i, value in enumerate((load.running, load.queued, load.kv_slots_used, load.kv_slots)):
                total[i] += value
        observations = []
        for model in totals:
            value = read(totals, model)
            if value is not None:
                observations.append(Observation(value, {LABEL_MODEL: model}))
        return observations


_load_gauges: dict[int, tuple[Any, LoadGauges]] = {}  # id(meter) -> (meter, its gauges)
_load_gauges_lock = threading.Lock()


def load_gauges(meter: Any) -> LoadGauges:
    """The `LoadGauges` of `meter`, created on first use."""
    with _load_gauges_lock:
        found = _load_gauges.get(id(meter))
        if found is None or found[0] is not meter:
            found = (meter, LoadGauges(meter))
            _load_gauges[id(meter)] = found
        return found[1]


def config_label(request: Any, job: Any) -> str:
    """The `config` label: the registry name, or `inline` / `default` for configs not from the registry."""
    if job is not None and job.resolved is not None:
        return job.resolved.name
    return "inline" if request.WhichOneof("config_source") == "config" else "default"


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop
        return None


class RequestObserver:
    """The span and metrics of one Generate/GenerateStream request.

    Use as a context manager around the whole request (config resolution included, so the registry
    call is a child of the request span); call `job_ready(job)` once the job is built, `item(x)` for
    every step event and the result. On exit the round spans, the fallback event, the request's
    attributes and its metrics are recorded.
    """

    def __init__(self, metrics: SpecDecodeMetrics, model_id: str, rpc: str, request: Any):
        self.metrics = metrics
        self.model_id = model_id
        self.rpc = rpc
        self.request = request
        self.job: Any = None
        self.result: GenerationResult | None = None
        self.tokens_per_row: list[int] = []
        self.first_token: float | None = None
        self.span: Any = None
        self._attached: Any = None  # the token of the context that makes the span current, attached in __enter__
        self._task: asyncio.Task | None = None  # the task that entered it (None: no event loop)

    def __enter__(self) -> RequestObserver:
        self.started = time.perf_counter()
        self.span = telemetry.get_tracer().start_span(
            REQUEST_SPAN,
            kind=trace.SpanKind.INTERNAL,
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.provider.name": "specwire",
                "gen_ai.request.model": self.model_id,
                "specwire.rpc": self.rpc,
            },
        )
        self._attached = otel_context.attach(trace.set_span_in_context(self.span))
        self._task = _current_task()
        return self

    def job_ready(self, job: Any) -> None:
        self.job = job

    def item(self, item: StepEvent | GenerationResult) -> None:
        if isinstance(item, GenerationResult):
            self.result = item
            return
        if not self.tokens_per_row:
            self.tokens_per_row = [0] * len(item.tokens)
        for row, tokens in enumerate(item.tokens):
            self.tokens_per_row[row] += len(tokens)
        if self.first_token is None and any(item.tokens):
            self.first_token = time.perf_counter()

    def __exit__(self, exc_type, exc, tb) -> None:
        ended = time.perf_counter()
        try:
            self._finish(exc, ended)
        finally:
            # A stream the client cancelled can have its generator closed by another task (the event loop's
            # finalizer of async generators), whose context the span was never made current in: there is nothing
            # to undo there, and OpenTelemetry logs the failed detach as an error with a traceback. (A token, not
            # `trace.use_span`: a context manager left unexited would detach when the garbage collector closes it.)
            if _current_task() is self._task:
                otel_context.detach(self._attached)
            self.span.end()

    def _labels(self, stats: SpeculationStats | None) -> dict[str, str]:
        return {
            LABEL_MODEL: self.model_id,
            LABEL_PROPOSER: stats.proposer if stats is not None else PROPOSER_NONE,
            LABEL_CONFIG: config_label(self.request, self.job),
        }

    def _finish(self, exc: BaseException | None, ended: float) -> None:
        job, span = self.job, self.span
        stats = job.speculation if job is not None else None
        labels = self._labels(stats)
        # Closing the request's generator after its result (GeneratorExit) is the normal end.
        stopped = exc is None or isinstance(exc, _STOPPED)
        error = None if self.result is not None and stopped else ("cancelled" if stopped else type(exc).__name__)
        duration = ended - self.started
        ttft = None if self.first_token is None else self.first_token - self.started
        longest = max(self.tokens_per_row, default=0)
        tpot = None
        if self.first_token is not None and longest > 1:
            tpot = (ended - self.first_token) / (longest - 1)
        self.metrics.record_latency(labels, duration, ttft, tpot, error)
        if stats is not None:
            self.metrics.record_speculation(stats, labels)
        if not span.is_recording():
            return
        if not stopped:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        elif error:
            span.set_attribute("error.type", error)
        if job is None:
            return
        assert stats is not None  # a job always carries its SpeculationStats
        attributes: dict[str, Any] = {
            "specwire.request_id": job.request_id,
            "specwire.rows": int(job.input_ids.shape[0]),
            "specwire.config.name": labels[LABEL_CONFIG],
            "gen_ai.usage.input_tokens": int(job.attention_mask.sum())
            if job.attention_mask is not None
            else int(job.input_ids.numel()),
            "gen_ai.usage.output_tokens": sum(self.tokens_per_row),
        }
        if job.resolved is not None:
            attributes["specwire.config.version"] = job.resolved.version
        if self.result is not None:
            attributes["gen_ai.response.finish_reasons"] = [str(r) for r in self.result.finish_reasons]
        if ttft is not None:
            attributes["specwire.time_to_first_token_s"] = ttft
        attributes.update(
            {
                "specwire.speculation.proposer": stats.proposer,
                "specwire.speculation.rounds": stats.rounds,
                "specwire.speculation.drafted_tokens": stats.drafted_tokens,
                "specwire.speculation.accepted_tokens": stats.accepted_tokens,
                "specwire.speculation.acceptance_rate": stats.acceptance_rate,
            }
        )
        if stats.decided_by:  # who chose the draft lengths (each round span has the length it asked)
            attributes["specwire.speculation.draft_length_source"] = stats.decided_by
            attributes["specwire.speculation.tokens_without_draft"] = stats.tokens_without_draft
            attributes["specwire.speculation.probes"] = stats.probes
        span.set_attributes(attributes)
        self._round_spans(stats)
        if stats.fallback_reason:
            span.add_event(
                FALLBACK_EVENT,
                {
                    "specwire.speculation.proposer": stats.proposer,
                    "specwire.speculation.fallback_reason": stats.fallback_reason,
                },
            )

    def _round_spans(self, stats: SpeculationStats) -> None:
        tracer = telemetry.get_tracer()
        parent = trace.set_span_in_context(self.span)
        for index, r in enumerate(stats.round_log):
            start = r.start_ns or None
            round_span = tracer.start_span(
                ROUND_SPAN,
                context=parent,
                start_time=start,
                attributes={
                    "specwire.speculation.proposer": stats.proposer,
                    "specwire.speculation.round": index,
                    "specwire.speculation.rows": r.rows,
                    "specwire.speculation.drafts": r.drafted_rows,
                    "specwire.speculation.draft_length_asked": r.asked,
                    "specwire.speculation.drafted_tokens": r.drafted,
                    "specwire.speculation.accepted_tokens": r.accepted,
                    "specwire.speculation.draft_seconds": r.draft_s,
                    "specwire.speculation.verify_seconds": r.verify_s,
                },
            )
            round_span.end(end_time=r.end_ns or None)
