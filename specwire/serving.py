"""Server plumbing shared by the config, draft and target services.

- `handles_errors`: the one mapping layer from domain errors (`specwire.errors`) to gRPC status
  codes, with field violations in the standard `google.rpc.BadRequest` status detail (and ours,
  which carry the value and severity too). Any other exception is a bug: logged, then INTERNAL.
- `GrpcServer`: a `grpc.aio` server with the standard health service, reflection, and a graceful
  stop on SIGTERM/SIGINT (health flips to NOT_SERVING first so load balancers drain it).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specwire import telemetry
from specwire.errors import SpecwireError
from specwire.security import server_credentials, server_interceptors
from specwire.wire.common import violation_to_proto

log = logging.getLogger("specwire.serving")

STATUS_DETAILS_KEY = "grpc-status-details-bin"
RETRY_AFTER_KEY = "retry-after-s"


def error_status(error: SpecwireError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, Any], ...]]:
    """gRPC code, message and trailing metadata (rich status details) for a domain error."""
    code = grpc.StatusCode[error.code]
    status = status_pb2.Status(code=getattr(code_pb2, error.code), message=error.message)
    if error.violations:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field, description=f"{v.message} (got {v.value!r})"
                )
                for v in error.violations
            ]
        )
        detail = any_pb2.Any()
        detail.Pack(bad_request)
        status.details.append(detail)
        for violation in error.violations:
            detail = any_pb2.Any()
            detail.Pack(violation_to_proto(violation))
            status.details.append(detail)
    metadata: list[tuple[str, Any]] = [(STATUS_DETAILS_KEY, status.SerializeToString())]
    if error.retry_after_s is not None:
        metadata.append((RETRY_AFTER_KEY, f"{error.retry_after_s:.3f}"))
    return code, error.message, tuple(metadata)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, SpecwireError):
        code, message, metadata = error_status(exc)
        await context.abort(code, message, trailing_metadata=metadata)
    # A bug: the caller gets an id to quote, the log gets the traceback. The exception text stays in the
    # log: it can hold paths, other requests' data or internals that are none of the caller's business.
    error_id = uuid.uuid4().hex[:12]
    log.error("bug: unexpected error in handler (error id %s)", error_id, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (id {error_id}): see the server log")


def handles_errors(method: Callable) -> Callable:
    """Decorate an async servicer method (unary or server-streaming) with the error mapping."""

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - this is the mapping layer
                await _abort(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - this is the mapping layer
            await _abort(context, exc)

    return unary_wrapper


@dataclass
class ServiceBinding:
    """One servicer to mount: the generated `add_*_to_server` function, the servicer, its full name."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str


class GrpcServer:
    """A grpc.aio server with health, reflection and graceful shutdown.

    Args:
        bindings (`Iterable[ServiceBinding]`): the services to serve.
        host (`str`): address to bind, e.g. `127.0.0.1` or `0.0.0.0`.
        port (`int`): port to bind; 0 picks a free one (see `.port` after `start()`).
        grace (`float`, defaults to 10.0): seconds in-flight calls get to finish on stop.
        options (`list`, *optional*): extra grpc channel options (message sizes, keepalive, ...).
        interceptors (`list`, *optional*): extra `grpc.aio.ServerInterceptor`s. When telemetry is set up
            (`specwire.telemetry`), OpenTelemetry's `aio_server_interceptor` runs before them.
    """

    def __init__(
        self,
        bindings: Iterable[ServiceBinding],
        host: str = "127.0.0.1",
        port: int = 0,
        grace: float = 10.0,
        options: list[tuple[str, Any]] | None = None,
        interceptors: list[Any] | None = None,
    ):
        self.bindings = list(bindings)
        self.host = host
        self.requested_port = port
        self.grace = grace
        self.options = [
            ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ("grpc.max_receive_message_length", 256 * 1024 * 1024),
            *(options or []),
        ]
        self.interceptors = interceptors or []
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        """Bind, start serving and mark every service SERVING. Returns the bound port."""
        # Tracing first (outermost), so refused and failed calls are traced too; none when telemetry is off.
        interceptors = [*telemetry.server_interceptors(), *self.interceptors, *server_interceptors()]
        server = grpc.aio.server(options=self.options, interceptors=interceptors)
        for binding in self.bindings:
            binding.add_to_server(binding.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [b.full_name for b in self.bindings]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        credentials = server_credentials()
        address = f"{self.host}:{self.requested_port}"
        self.port = (
            server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        )
        if not self.port:
            raise OSError(f"could not bind {self.host}:{self.requested_port}")
        await server.start()
        self.server = server
        for name in ["", *names]:
            await self._set_health(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s:%d", ", ".join(names), self.host, self.port)
        return self.port

    async def _set_health(self, name: str, status: int) -> None:
        result = self.health.set(name, status)
        if inspect.isawaitable(result):
            await result

    async def stop(self, grace: float | None = None) -> None:
        """Drain: report NOT_SERVING, let in-flight calls finish for `grace` seconds, then stop."""
        if self.server is None:
            return
        for name in ["", *(b.full_name for b in self.bindings)]:
            await self._set_health(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(self.grace if grace is None else grace)
        self._stopped.set()

    async def serve_until_signal(self) -> None:
        """Start, then run until SIGTERM or SIGINT, then stop gracefully."""
        if self.server is None:
            await self.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received: stopping gracefully (grace %.1fs)", self.grace)
        await self.stop()


def setup_logging(level: str = "INFO") -> None:
    """Plain timestamped logs on stderr, the format every specwire process uses."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
