"""A real OTLP/gRPC receiver for tests: the collector's trace and metrics services on loopback.

Each export request is kept as a `MessageToDict` dict (`.traces`, `.metrics`), so tests read what went
over the wire through the OTel exporters' real protobuf and gRPC path.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """`with OtlpSink() as sink:` serves OTLP/gRPC on `sink.endpoint` (http://127.0.0.1:PORT)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.traces: list[dict] = []
        self.metrics: list[dict] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"{host}:0")
        self.endpoint = f"http://{host}:{self.port}"

    def Export(self, request, context):  # noqa: N802 - both services name their one RPC Export
        with self._lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                self.traces.append(MessageToDict(request))
                return trace_service_pb2.ExportTraceServiceResponse()
            self.metrics.append(MessageToDict(request))
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def spans(self) -> list[tuple[dict, dict]]:
        """(resource attributes, span) for every span received."""
        out = []
        with self._lock:
            for request in self.traces:
                for resource_spans in request.get("resourceSpans", []):
                    resource = attributes(resource_spans.get("resource", {}))
                    for scope in resource_spans.get("scopeSpans", []):
                        out += [(resource, span) for span in scope.get("spans", [])]
        return out

    def metric_names(self) -> set[str]:
        with self._lock:
            return {
                m["name"]
                for request in self.metrics
                for rm in request.get("resourceMetrics", [])
                for sm in rm.get("scopeMetrics", [])
                for m in sm.get("metrics", [])
            }

    def wait(self, predicate, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()

    def __enter__(self) -> OtlpSink:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(0)


def attributes(item: dict) -> dict:
    """OTLP JSON key/value list -> plain dict."""
    out = {}
    for attribute in item.get("attributes", []):
        value = attribute.get("value", {})
        out[attribute["key"]] = next(iter(value.values()), None) if value else None
    return out
