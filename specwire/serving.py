"""Server plumbing shared by the config, draft and target services.

- `handles_errors`: the one mapping layer from domain errors (`specwire.errors`) to gRPC status
  codes, with field violations in the standard `google.rpc.BadRequest` status detail (and ours,
  which carry the value and severity too). Any other exception is a bug: logged, then INTERNAL.
- `GrpcServer`: a `grpc.aio` server with the standard health service, reflection, keepalive, a
  liveness watchdog (health follows the service's own `liveness` check), and a graceful stop on
  SIGTERM/SIGINT: health flips to NOT_SERVING first so load balancers drain it, new calls are
  refused, in-flight calls get `grace` seconds to finish.
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
from typing import Any, cast

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specwire import telemetry
from specwire.deadline import CALLER_DEADLINE, set_caller_deadline
from specwire.errors import FieldProblem, InvalidArgument, SpecwireError
from specwire.ports import PortInUse, port_in_use
from specwire.rpc_limits import ConcurrencyLimitInterceptor
from specwire.security.access import AccessPolicy, ServerAccess
from specwire.security.authorization import AccessInterceptor
from specwire.security.roles import CONFIG_SERVICE
from specwire.security.tls import TlsSettingsError, check_server_settings, server_credentials
from specwire.security.tokens import SecuritySettingsError
from specwire.wire.common import violation_to_proto

log = logging.getLogger("specwire.serving")

STATUS_DETAILS_KEY = "grpc-status-details-bin"
RETRY_AFTER_KEY = "retry-after-s"
# Largest message a server receives or sends by default: a request or a response must fit in one.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# Keepalive of every server: ping a client after 60 s without traffic and close the connection when
# no answer comes within 20 s (a vanished client's calls are cancelled, their work freed). Clients may
# ping every 15 s or more, also with no call open (`specwire.security.channels.KEEPALIVE_CLIENT_OPTIONS` pings
# every 30 s); a client pinging faster is sent GOAWAY after 2 strikes. The ping timeout is set with
# the keepalive timeout (gRPC core times keepalive pings out after `grpc.http2.ping_timeout_ms`).
KEEPALIVE_SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.ping_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 15_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.http2.max_pings_without_data", 0),
]

# Every server closes each connection after about 5 minutes (gRPC adds +-10% jitter) with a GOAWAY:
# the calls in flight on it finish (no grace limit: a long generation is never cut), new calls open a
# new connection, and a client dialling `dns:///` resolves the name again then. gRPC's DNS resolver
# never polls, so without this a client would never find the replicas a scale-up added. Calls racing
# the GOAWAY are refused unread and resent by gRPC's transparent retry.
CONNECTION_AGE_SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_connection_age_ms", 300_000),
    ("grpc.max_connection_age_grace_ms", 2**31 - 1),
]


def error_status(error: SpecwireError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, Any], ...]]:
    """gRPC code, message and trailing metadata (rich status details) for a domain error."""
    code = grpc.StatusCode[error.code]
    status = status_pb2.Status(code=getattr(code_pb2, error.code), message=error.message)
    if error.violations:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=f"{v.message} (got {v.value!r})")
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
    """Decorate an async servicer method (unary or server-streaming) with the error mapping.

    It also records the caller's deadline (`specwire.deadline`) for everything the call does.
    """

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            token = set_caller_deadline(_time_remaining(context))
            try:
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - this is the mapping layer
                await _abort(context, exc)
            finally:
                _reset_deadline(token)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        token = set_caller_deadline(_time_remaining(context))
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - this is the mapping layer
            await _abort(context, exc)
        finally:
            _reset_deadline(token)

    return unary_wrapper


def _time_remaining(context: Any) -> float | None:
    try:
        return context.time_remaining()
    except (AttributeError, NotImplementedError):  # a test double without a deadline
        return None


def _reset_deadline(token: Any) -> None:
    try:
        CALLER_DEADLINE.reset(token)
    except ValueError:  # a streaming handler finalised in another context: that context ends anyway
        pass


class _Undecodable:
    """What a guarded request deserializer returns instead of raising: the error to answer with."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgument):
        self.error = error


def undecodable_request_error(method: str, size: int, exc: DecodeError) -> InvalidArgument:
    """The INVALID_ARGUMENT for `size` request bytes of `method` that protobuf refused to parse."""
    text = str(exc)
    if "Depth" in text:  # upb's "Exceeded upb_DecodeOptions_MaxDepth"
        problem = "it nests deeper than the 100 message levels protobuf allows; each Struct dict level takes 3"
        fix = "flatten deeply nested values in extra/Struct fields"
    else:
        problem = "the bytes are not a valid message of this method's request type"
        fix = "send the request serialized by this service's generated stubs"
    message = f"could not be parsed ({problem}; protobuf says: {text}): {fix}"
    return InvalidArgument(f"request to {method}: {message}", [FieldProblem("request", f"{size} bytes", message)])


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that protobuf cannot parse with INVALID_ARGUMENT instead of UNKNOWN.

    gRPC parses a request with the method handler's `request_deserializer` before any handler (and so
    before `handles_errors`) runs, and answers a `DecodeError` with UNKNOWN "Unexpected <class
    'DecodeError'>", which reads like a server fault although the caller sent it: e.g. a
    `GenerationConfig.extra` Struct nesting dicts ~34 levels deep exceeds protobuf's 100 message
    levels. This interceptor makes the deserializer return a marker instead of raising, and the method
    answer the marker with INVALID_ARGUMENT naming the request and the fix. In a request stream (the
    draft service's Draft) the bad message ends the call the same way when the handler reads it.
    Handlers that are not coroutines or async generators are left as they are.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guard_decoding(handler, handler_call_details.method)


def _guard_decoding(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that returns `_Undecodable` on a DecodeError, and a method that
    aborts with its error (in a request stream: when the handler reads that message)."""
    behavior = handler.stream_stream or handler.unary_stream or handler.stream_unary or handler.unary_unary
    streams = inspect.isasyncgenfunction(behavior)
    if not (streams or inspect.iscoroutinefunction(behavior)):
        return handler
    parse = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return _Undecodable(undecodable_request_error(method, len(data), exc))

    async def checked_stream(requests, context):
        async for request in requests:
            if isinstance(request, _Undecodable):
                await _abort(context, request.error)
            yield request

    async def checked(request, context):
        if handler.request_streaming:
            return checked_stream(request, context)
        if isinstance(request, _Undecodable):
            await _abort(context, request.error)
        return request

    if streams:

        async def guarded_stream(request, context):
            async for item in behavior(await checked(request, context), context):
                yield item

        guarded = guarded_stream
    else:

        async def guarded_unary(request, context):
            return await behavior(await checked(request, context), context)

        guarded = guarded_unary
    kind = ("stream" if handler.request_streaming else "unary") + (
        "_stream" if handler.response_streaming else "_unary"
    )
    return handler._replace(request_deserializer=deserialize, **{kind: guarded})


class StreamsCloseInTheirTask(grpc.aio.ServerInterceptor):
    """The outermost interceptor: a server-streaming handler's messages are written here (`context.write`), and its
    async generator is closed here, in the call's own task, however the call ends.

    gRPC iterates a streaming handler's generator itself and does not close it when the call is cancelled while the
    generator waits at a `yield` (its message not yet written); the event loop's finalizer closes it later, in
    another task and context. There OpenTelemetry's server interceptor cannot detach the span it made current, and
    logs "Failed to detach context" with a traceback, at every such cancel. Written from a coroutine, the cancel (a
    CancelledError, or the write it failed) lands here, and the generator this iterates (the tracing interceptor's,
    when tracing is on) unwinds at once, in the context it ran in. Generators deeper down that do not close what
    they iterate still leave it to the finalizer; specwire's own tolerate that.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler.response_streaming:
            return handler
        kind = "stream_stream" if handler.request_streaming else "unary_stream"
        behavior = getattr(handler, kind)
        if not inspect.isasyncgenfunction(behavior):
            return handler

        async def write_each(request, context):
            messages = behavior(request, context)
            try:
                async for message in messages:
                    await context.write(message)
            finally:
                await messages.aclose()

        return handler._replace(**{kind: write_each})


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
        options (`list`, *optional*): extra grpc channel options; they override the defaults (message
            sizes, `KEEPALIVE_SERVER_OPTIONS`) key by key.
        interceptors (`list`, *optional*): extra `grpc.aio.ServerInterceptor`s. When telemetry is set up
            (`specwire.telemetry`), OpenTelemetry's `aio_server_interceptor` runs before them.
        max_message_bytes (`int`, defaults to 16 MiB): largest message received or sent; a bigger request
            is refused by gRPC with RESOURCE_EXHAUSTED before it is parsed (`--max-message-bytes`).
        max_concurrent_rpcs (`int`, *optional*): application RPCs (streams until they end) served at once;
            beyond it RESOURCE_EXHAUSTED with a retry hint, before the handler runs. Health checks and
            reflection are not counted (`--max-concurrent-rpcs`). `None`: no cap.
        liveness (`Callable[[], str]`, *optional*): the service's own health check, polled every
            `liveness_interval_s` seconds on the event loop (it must not block): "" when it can serve,
            else why not. Health follows it (NOT_SERVING while it reports a problem).
        liveness_interval_s (`float`, defaults to 1.0): how often `liveness` is polled.
        access (`ServerAccess`, *optional*): `--read-only`, `--allow-anonymous-writes`,
            `--allow-insecure-token`; default: their environment variables. The credentials (tokens per
            role, mutual-TLS identities) come from the environment (`specwire.security.access`).
        on_stop (`Callable[[], None]`, *optional*): what the service closes once the server stopped (its
            threads, its database), run off the event loop: a thread still in a forward when the interpreter
            finalizes aborts the process.
    """

    def __init__(
        self,
        bindings: Iterable[ServiceBinding],
        host: str = "127.0.0.1",
        port: int = 0,
        grace: float = 10.0,
        options: list[tuple[str, Any]] | None = None,
        interceptors: list[Any] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_concurrent_rpcs: int | None = None,
        liveness: Callable[[], str] | None = None,
        liveness_interval_s: float = 1.0,
        access: ServerAccess | None = None,
        on_stop: Callable[[], None] | None = None,
    ):
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
        self.bindings = list(bindings)
        self.host = host
        self.requested_port = port
        self.grace = grace
        self.max_message_bytes = max_message_bytes
        self.options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # gRPC's default SO_REUSEPORT lets a second server bind the same port and silently take
            # half the calls: refuse the bind instead (`specwire.ports`).
            ("grpc.so_reuseport", 0),
            *KEEPALIVE_SERVER_OPTIONS,
            *CONNECTION_AGE_SERVER_OPTIONS,
            *(options or []),
        ]
        # Later entries win (the caller's options over the defaults), one entry per key for grpc.
        self.options = list(dict(self.options).items())
        self.liveness = liveness
        self.liveness_interval_s = liveness_interval_s
        self.access = access
        self.on_stop = on_stop
        self.policy: AccessPolicy | None = None  # read from the environment by `start`
        self.problem = ""  # what `liveness` last reported
        self._stopping = False
        self._watchdog: asyncio.Task | None = None
        # The cap runs after the caller's interceptors (tracing sees refused calls) and before auth
        # (appended in `start`), so refusing costs no token check.
        limit = [ConcurrencyLimitInterceptor(max_concurrent_rpcs)] if max_concurrent_rpcs else []
        self.interceptors = [*(interceptors or []), *limit]
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        """Bind, start serving and mark every service SERVING. Returns the bound port.

        Raises:
            `SecuritySettingsError`: credentials or access flags that cannot be honoured (the reason and fix).
            `PortInUse`: the address is taken.
        """
        credentials = server_credentials()
        policy = self.policy = AccessPolicy.from_env(self.host, self.access, tls=credentials is not None)
        # Streams are written and closed outermost (`StreamsCloseInTheirTask`); tracing next, so refused and failed
        # calls are traced too (none when telemetry is off). Decoding innermost: a request that cannot be parsed is
        # still traced, counted and authenticated.
        interceptors = [
            StreamsCloseInTheirTask(),
            *telemetry.server_interceptors(),
            *self.interceptors,
            AccessInterceptor(policy),
            UndecodableRequestInterceptor(),
        ]
        server = grpc.aio.server(options=self.options, interceptors=interceptors)
        for binding in self.bindings:
            binding.add_to_server(binding.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [b.full_name for b in self.bindings]
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        address = f"{self.host}:{self.requested_port}"
        try:
            self.port = (
                server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
            )
        except RuntimeError:  # grpc's "Failed to bind to address"
            self.port = 0
        if not self.port:
            raise port_in_use(self.host, self.requested_port)
        await server.start()
        self.server = server
        for name in ["", *names]:
            await self._set_health(name, health_pb2.HealthCheckResponse.SERVING)
        if self.liveness is not None:
            self._watchdog = asyncio.create_task(self._watch(), name="specwire-liveness")
        log.info("serving %s on %s:%d", ", ".join(names), self.host, self.port)
        serves_writes = any(name == CONFIG_SERVICE for name in names)
        for line in policy.describe(serves_writes):
            log.log(logging.WARNING if line.startswith("writes") else logging.INFO, "%s", line)
        return self.port

    async def _set_all(self, status: int) -> None:
        for name in ["", *(b.full_name for b in self.bindings)]:
            await self._set_health(name, status)

    async def _watch(self) -> None:
        """The liveness watchdog: health follows `liveness()` until the server stops."""
        serving = health_pb2.HealthCheckResponse
        while not self._stopping:
            try:
                problem = cast(Callable[[], str], self.liveness)()  # the watchdog runs only with one
            except Exception as exc:  # noqa: BLE001 - a failing check is a problem, not a dead watchdog
                problem = f"liveness check failed: {type(exc).__name__}: {exc}"
            if problem != self.problem and not self._stopping:
                if problem:
                    log.error("NOT_SERVING: %s", problem)
                else:
                    log.warning("SERVING again (was: %s)", self.problem)
                self.problem = problem
                await self._set_all(serving.NOT_SERVING if problem else serving.SERVING)
            await asyncio.sleep(self.liveness_interval_s)

    async def _set_health(self, name: str, status: int) -> None:
        result = self.health.set(name, status)
        if inspect.isawaitable(result):
            await result

    async def stop(self, grace: float | None = None) -> None:
        """Drain: report NOT_SERVING, refuse new calls, let in-flight calls finish for `grace` seconds
        (then cancel them), then stop."""
        if self.server is None:
            return
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        # grpc's stop(grace) refuses new calls at once and waits up to `grace` for the running ones.
        await self.server.stop(self.grace if grace is None else grace)
        if self.on_stop is not None:
            await asyncio.to_thread(self.on_stop)
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


def add_capacity_arguments(parser: Any, max_concurrent_rpcs: int, calls: str = "calls") -> None:
    """`--max-message-bytes` and `--max-concurrent-rpcs`, the capacity flags every service takes.

    `parser` is an `argparse` parser or argument group; `calls` names what is counted ("draft streams").
    """
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help=f"largest request or response message (default {DEFAULT_MAX_MESSAGE_BYTES}, 16 MiB)",
    )
    parser.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=max_concurrent_rpcs,
        help=f"{calls} served at once, health checks not counted; beyond it RESOURCE_EXHAUSTED with a retry "
        f"hint (default {max_concurrent_rpcs})",
    )


def check_transport_security(name: str) -> None:
    """Exit with the reason and the fix, not a traceback, when the server's `SPECWIRE_TLS_*` settings are
    half there or their files do not check out (`specwire.security.tls.check_server_settings`).

    Services call it first thing, so a bad setting is reported before a model loads.
    """
    try:
        check_server_settings()
    except TlsSettingsError as error:
        raise SystemExit(f"{name}: {error}") from None


def run_until_signal(server: GrpcServer, name: str) -> None:
    """A service's main loop: serve until SIGTERM/SIGINT; a port in use or TLS settings that fail their
    check exit with the reason, not a traceback."""
    try:
        asyncio.run(server.serve_until_signal())
    except (PortInUse, SecuritySettingsError) as error:  # TlsSettingsError is one
        raise SystemExit(f"{name}: {error}") from None


def setup_logging(level: str = "INFO") -> None:
    """Plain timestamped logs on stderr, the format every specwire process uses."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
