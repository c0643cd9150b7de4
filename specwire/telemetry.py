"""OpenTelemetry for every specwire process: traces and metrics, configured by the standard OTEL_* variables.

`setup_telemetry(service_name)` is called once by each server's and the CLI's `main()` (calling it again
returns the same `Telemetry`). What it turns on comes from the environment (as the Helm chart sets it):

- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT`) and
  `OTEL_EXPORTER_OTLP_PROTOCOL` (`grpc`, the default, or `http/protobuf`): traces and metrics are
  exported over OTLP. `OTEL_TRACES_EXPORTER` / `OTEL_METRICS_EXPORTER` (`otlp`, `console`, `none`)
  choose explicitly (`OTEL_METRICS_EXPORTER=prometheus` alone serves the scrape endpoint on 9464);
  headers, certificates, timeouts and `OTEL_METRIC_EXPORT_INTERVAL` are read by the OTel exporters.
- `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` win over the name and attributes given here.
- `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`: the standard samplers (default `parentbased_always_on`).
- `SPECWIRE_PROMETHEUS_PORT`: serve the metrics for scraping on this port (0 = any free one), bound to
  `SPECWIRE_PROMETHEUS_HOST` (default `127.0.0.1`; set `0.0.0.0` in a pod so Prometheus can reach it).
- `OTEL_SDK_DISABLED=true`: no tracing and no OTLP export. The Prometheus endpoint is an explicit opt-in
  of its own and is still served when its port is set (the Helm chart disables the SDK whenever OTLP is
  off, including when it asks for Prometheus metrics).

With none of these set nothing is set up: the tracer and meter are OpenTelemetry's no-op ones, servers
get no tracing interceptor and channels no tracing interceptor, so an unconfigured process pays nothing.

specwire code never reads OpenTelemetry's global providers: it uses `get_tracer()` / `get_meter()` from
here. `setup_telemetry(..., set_global=True)` (the default) also installs the providers globally so an
application's own instrumentation shares them; tests pass `set_global=False` and `shutdown_telemetry()`
afterwards, so nothing leaks between test modules.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import metrics, trace

log = logging.getLogger("specwire.telemetry")

PROMETHEUS_PORT_ENV = "SPECWIRE_PROMETHEUS_PORT"
PROMETHEUS_HOST_ENV = "SPECWIRE_PROMETHEUS_HOST"
DEFAULT_PROMETHEUS_HOST = "127.0.0.1"
DEFAULT_PROMETHEUS_PORT = "9464"  # the OTel Prometheus exporter's usual port (OTEL_METRICS_EXPORTER=prometheus)
INSTRUMENTATION_SCOPE = "specwire"


@dataclass
class Telemetry:
    """What `setup_telemetry` set up for this process.

    Attributes:
        service_name (`str`): the `service.name` resource attribute in effect.
        tracer_provider (`TracerProvider`, *optional*): the SDK provider; None when tracing is off.
        meter_provider (`MeterProvider`, *optional*): the SDK provider; None when metrics are off.
        prometheus_address (`tuple[str, int]`, *optional*): where the scrape endpoint listens.
    """

    service_name: str = ""
    tracer_provider: Any = None
    meter_provider: Any = None
    prometheus_address: tuple[str, int] | None = None
    _prometheus_server: Any = field(default=None, repr=False)

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    @property
    def metrics(self) -> bool:
        return self.meter_provider is not None

    @property
    def prometheus_port(self) -> int | None:
        return None if self.prometheus_address is None else self.prometheus_address[1]

    def tracer(self, name: str = INSTRUMENTATION_SCOPE) -> trace.Tracer:
        if self.tracer_provider is None:
            return trace.NoOpTracer()
        return self.tracer_provider.get_tracer(name, _version())

    def meter(self, name: str = INSTRUMENTATION_SCOPE) -> metrics.Meter:
        if self.meter_provider is None:
            return metrics.NoOpMeter(name)
        return self.meter_provider.get_meter(name, _version())

    def force_flush(self, timeout_ms: int = 10_000) -> None:
        """Export everything buffered now (spans in batch processors, metrics in periodic readers)."""
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(timeout_ms)
        if self.meter_provider is not None:
            self.meter_provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Flush and stop the exporters and the scrape endpoint."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()
        if self._prometheus_server is not None:
            server, thread = self._prometheus_server
            server.shutdown()
            server.server_close()
            thread.join(5)
            self._prometheus_server = None


_DISABLED = Telemetry()
_current: Telemetry = _DISABLED
_lock = threading.Lock()


def current() -> Telemetry:
    """The process' telemetry (a disabled one before `setup_telemetry`)."""
    return _current


def tracing_enabled() -> bool:
    """Whether spans are recorded: servers and channels add the gRPC tracing interceptors only then."""
    return _current.tracer_provider is not None


def get_tracer(name: str = INSTRUMENTATION_SCOPE) -> trace.Tracer:
    return _current.tracer(name)


def get_meter(name: str = INSTRUMENTATION_SCOPE) -> metrics.Meter:
    return _current.meter(name)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("specwire")
    except Exception:  # noqa: BLE001 - not installed (source checkout)
        return "0"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _exporter_names(env: Mapping[str, str], variable: str, signal_endpoint: str) -> list[str]:
    raw = env.get(variable)
    if raw is not None and raw.strip():
        return [name.strip().lower() for name in raw.split(",") if name.strip()]
    # The spec's default is `otlp`, but exporting to a collector nobody configured would only log
    # connection errors: OTLP is on when an endpoint is given.
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(signal_endpoint):
        return ["otlp"]
    return []


def _endpoint(env: Mapping[str, str], signal: str, protocol: str) -> str | None:
    specific = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if specific:
        return specific
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        return None
    return base if protocol == "grpc" else f"{base.rstrip('/')}/v1/{signal}"


def _protocol(env: Mapping[str, str], signal: str) -> str:
    protocol = (
        (env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
        .strip()
        .lower()
    )
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: specwire exports OTLP as 'grpc' or 'http/protobuf'"
        )
    return protocol


def sampler_from_env(env: Mapping[str, str] = os.environ):
    """The sampler OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG name (default parentbased_always_on)."""
    from opentelemetry.sdk.trace import sampling

    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    arg = env.get("OTEL_TRACES_SAMPLER_ARG")
    try:
        rate = float(arg) if arg not in (None, "") else 1.0
    except ValueError as exc:
        raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: expected a number in [0, 1]") from exc
    samplers: dict[str, Callable[[], Any]] = {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(rate),
        "parentbased_always_on": lambda: sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: sampling.ParentBasedTraceIdRatio(rate),
    }
    if name not in samplers:
        raise ValueError(f"OTEL_TRACES_SAMPLER={name!r}: choose one of {', '.join(samplers)}")
    return samplers[name]()


def resource_from_env(
    service_name: str, env: Mapping[str, str] = os.environ, attributes: Mapping[str, Any] | None = None
):
    """`service.name` etc.; OTEL_RESOURCE_ATTRIBUTES, then OTEL_SERVICE_NAME, win over what is given here."""
    from opentelemetry.sdk.resources import Resource

    base = {
        "service.name": service_name,
        "service.namespace": "specwire",
        "service.version": _version(),
        **(attributes or {}),
    }
    from_env: dict[str, Any] = {}
    for item in (env.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            from urllib.parse import unquote

            from_env[key.strip()] = unquote(value.strip())
    if env.get("OTEL_SERVICE_NAME"):
        from_env["service.name"] = env["OTEL_SERVICE_NAME"]
    return Resource.create(base).merge(Resource(from_env))


def _span_exporter(name: str, env: Mapping[str, str]):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: specwire supports otlp, console or none")
    protocol = _protocol(env, "traces")
    endpoint = _endpoint(env, "traces", protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint)


def _metric_reader(name: str, env: Mapping[str, str]):
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    if name == "console":
        return PeriodicExportingMetricReader(ConsoleMetricExporter())
    if name != "otlp":
        raise ValueError(
            f"OTEL_METRICS_EXPORTER={name!r}: specwire supports otlp, console or none "
            f"(Prometheus: set {PROMETHEUS_PORT_ENV})"
        )
    protocol = _protocol(env, "metrics")
    endpoint = _endpoint(env, "metrics", protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    return PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint))


def _start_prometheus(env: Mapping[str, str]):
    """A PrometheusMetricReader on its own registry and the HTTP server that serves it."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    try:
        port = int(env[PROMETHEUS_PORT_ENV])
    except ValueError as exc:
        raise ValueError(f"{PROMETHEUS_PORT_ENV}={env[PROMETHEUS_PORT_ENV]!r}: expected a port number") from exc
    host = (env.get(PROMETHEUS_HOST_ENV) or DEFAULT_PROMETHEUS_HOST).strip()
    registry = CollectorRegistry(auto_describe=True)
    reader = PrometheusMetricReader(registry=registry)
    server, thread = start_http_server(port, addr=host, registry=registry)
    address = (host, server.server_address[1])
    log.info("Prometheus metrics on http://%s:%d/metrics", *address)
    return reader, (server, thread), address


def setup_telemetry(
    service_name: str,
    *,
    env: Mapping[str, str] | None = None,
    span_exporters: Iterable[Any] = (),
    metric_readers: Sequence[Any] = (),
    set_global: bool = True,
) -> Telemetry:
    """Set up tracing and metrics for this process from the environment; idempotent.

    Args:
        service_name (`str`): default `service.name` (OTEL_SERVICE_NAME wins), e.g. `specwire-target`.
        env (`Mapping`, *optional*): the variables to read (default `os.environ`).
        span_exporters (`Iterable`): extra span exporters (tests: an `InMemorySpanExporter`), each
            behind a `SimpleSpanProcessor`; they turn tracing on.
        metric_readers (`Sequence`): extra metric readers (tests: an `InMemoryMetricReader`).
        set_global (`bool`): also install the providers as OpenTelemetry's global ones.
    """
    global _current
    env = os.environ if env is None else env
    with _lock:
        if _current is not _DISABLED:
            return _current
        span_exporters, metric_readers = list(span_exporters), list(metric_readers)
        disabled = _truthy(env.get("OTEL_SDK_DISABLED"))
        trace_names = (
            [] if disabled else _exporter_names(env, "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        )
        metric_names = (
            [] if disabled else _exporter_names(env, "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
        )
        trace_names = [n for n in trace_names if n != "none"]
        if "prometheus" in metric_names and not env.get(PROMETHEUS_PORT_ENV, "").strip():
            env = {**env, PROMETHEUS_PORT_ENV: DEFAULT_PROMETHEUS_PORT}  # OTEL_METRICS_EXPORTER=prometheus
        metric_names = [n for n in metric_names if n not in ("none", "prometheus")]
        prometheus = env.get(PROMETHEUS_PORT_ENV, "").strip() != ""
        if not (trace_names or span_exporters or metric_names or metric_readers or prometheus):
            return _current

        resource = resource_from_env(service_name, env)
        state = Telemetry(service_name=str(resource.attributes.get("service.name", service_name)))
        if trace_names or span_exporters:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

            provider = TracerProvider(sampler=sampler_from_env(env), resource=resource)
            for name in trace_names:
                provider.add_span_processor(BatchSpanProcessor(_span_exporter(name, env)))
            for exporter in span_exporters:
                provider.add_span_processor(SimpleSpanProcessor(exporter))
            state.tracer_provider = provider
        readers = [_metric_reader(name, env) for name in metric_names] + metric_readers
        if prometheus:
            reader, state._prometheus_server, state.prometheus_address = _start_prometheus(env)
            readers.append(reader)
        if readers:
            from opentelemetry.sdk.metrics import MeterProvider

            state.meter_provider = MeterProvider(metric_readers=readers, resource=resource)
        if set_global:
            if state.tracer_provider is not None:
                trace.set_tracer_provider(state.tracer_provider)
            if state.meter_provider is not None:
                metrics.set_meter_provider(state.meter_provider)
        _current = state
        log.info(
            "telemetry: service.name=%s traces=%s metrics=%s%s",
            state.service_name,
            ",".join(trace_names + ["in-memory"] * bool(span_exporters)) or "off",
            ",".join(metric_names + ["reader"] * bool(metric_readers)) or "off",
            f" prometheus=http://{state.prometheus_address[0]}:{state.prometheus_port}/metrics"
            if state.prometheus_address
            else "",
        )
        return state


def shutdown_telemetry() -> None:
    """Flush, stop and forget this process' telemetry (a later `setup_telemetry` starts afresh)."""
    global _current
    with _lock:
        state, _current = _current, _DISABLED
    if state is not _DISABLED:
        state.shutdown()


# --- gRPC instrumentation (the supported OpenTelemetry interceptors) ---------------------------------


def _not_health(details: Any) -> bool:
    method = getattr(details, "method", None) or getattr(details, "full_method", "") or ""
    if isinstance(method, bytes):
        method = method.decode()
    return not method.startswith(("/grpc.health.v1.Health/", "/grpc.reflection."))


def server_interceptors() -> list[Any]:
    """`aio_server_interceptor` when tracing is on (health checks and reflection are not traced)."""
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_current.tracer_provider, filter_=_not_health)]


def aio_client_interceptors() -> list[Any]:
    """The grpc.aio client interceptors (client spans + W3C trace context) when tracing is on."""
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors as make

    return make(tracer_provider=_current.tracer_provider, filter_=_not_health)


def _unary_unary_or_client_stream(info: Any) -> bool:
    # The sync interceptor hands back a plain generator for server-streaming calls, which would lose
    # the call's cancel() (breaking out of `TargetClient.stream` must cancel the request): those calls
    # carry the trace context through `_PropagateOnServerStream` instead.
    return _not_health(info) and not (
        getattr(info, "is_server_stream", False) and not getattr(info, "is_client_stream", False)
    )


def instrument_channel(channel: Any) -> Any:
    """Wrap a sync channel with the OpenTelemetry client interceptor when tracing is on."""
    if not tracing_enabled():
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    channel = grpc.intercept_channel(channel, _PropagateOnServerStream())
    return intercept_channel(
        channel,
        client_interceptor(tracer_provider=_current.tracer_provider, filter_=_unary_unary_or_client_stream),
    )


def _inject(metadata: Any) -> tuple[tuple[str, str], ...]:
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return tuple(metadata or ()) + tuple(carrier.items())


class _PropagateOnServerStream(grpc.UnaryStreamClientInterceptor):
    """W3C trace context on sync server-streaming calls (they get no client span; see above)."""

    def intercept_unary_stream(self, continuation, details, request):
        if not _not_health(details):
            return continuation(details, request)
        return continuation(details._replace(metadata=_inject(details.metadata)), request)
