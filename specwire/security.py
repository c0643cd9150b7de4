"""Transport security and a shared bearer token, configured by environment (as the Helm chart sets it).

- `SPECWIRE_TLS_CERT_FILE` + `SPECWIRE_TLS_KEY_FILE`: servers listen with TLS; clients verify the
  server against `SPECWIRE_TLS_CA_FILE` (or the system roots). When the CA is given to a server it
  also requires client certificates (mutual TLS between the services).
- `SPECWIRE_AUTH_TOKEN`: servers refuse calls without `authorization: Bearer <token>` with
  UNAUTHENTICATED (health checks and reflection stay open so probes and grpcurl work); clients send it.

Unset variables mean plaintext and no token: the local default.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from specwire import telemetry

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(env: Mapping[str, str] = os.environ) -> grpc.ServerCredentials | None:
    """TLS credentials for a server, or None for plaintext."""
    cert, key = env.get("SPECWIRE_TLS_CERT_FILE"), env.get("SPECWIRE_TLS_KEY_FILE")
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("set both SPECWIRE_TLS_CERT_FILE and SPECWIRE_TLS_KEY_FILE, or neither")
    ca = _read(env.get("SPECWIRE_TLS_CA_FILE"))
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(env: Mapping[str, str] = os.environ) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client (with our certificate for mutual TLS when we have one), or None."""
    ca = env.get("SPECWIRE_TLS_CA_FILE")
    cert, key = env.get("SPECWIRE_TLS_CERT_FILE"), env.get("SPECWIRE_TLS_KEY_FILE")
    if not ca and not cert:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key) if cert else None, certificate_chain=_read(cert)
    )


def auth_metadata(env: Mapping[str, str] = os.environ) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the shared token, if one is configured."""
    token = env.get("SPECWIRE_AUTH_TOKEN")
    return (("authorization", f"Bearer {token}"),) if token else ()


class _TokenPlugin(grpc.AuthMetadataPlugin):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def __call__(self, context, callback) -> None:
        callback(self.metadata, None)


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call on a plaintext channel (call credentials need TLS)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


# Every client channel pings its server after 30 s without traffic and drops the connection when no
# answer comes within 10 s: a hung peer (SIGSTOPped, partitioned, no TCP reset) fails its calls with
# UNAVAILABLE instead of leaving them to their deadlines. Pings also go out with no call open (so an
# idle pooled connection is checked before use) and without data frames (long streams that are
# waiting). The servers accept a ping every 15 s (`specwire.serving.KEEPALIVE_SERVER_OPTIONS`), so
# these never count as abuse. gRPC core (1.85) times a keepalive ping out after
# `grpc.http2.ping_timeout_ms` (default 60 s), not `keepalive_timeout_ms` alone: both are set.
KEEPALIVE_CLIENT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Largest message a client channel sends or receives unless its caller asks for more.
DEFAULT_CLIENT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def client_channel_options(
    options: list[tuple[str, Any]] | None = None, max_message_bytes: int = DEFAULT_CLIENT_MAX_MESSAGE_BYTES
) -> list[tuple[str, Any]]:
    """Keepalive and message-size limits of every client channel, then `options` (which win, key by key)."""
    merged = dict(
        [
            *KEEPALIVE_CLIENT_OPTIONS,
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
    )
    merged.update(options or [])
    return list(merged.items())


def secure_channel(
    address: str,
    options: list[tuple[str, Any]] | None = None,
    *,
    aio: bool = False,
    env: Mapping[str, str] = os.environ,
    max_message_bytes: int = DEFAULT_CLIENT_MAX_MESSAGE_BYTES,
):
    """A client channel to `address` honouring the TLS and token settings (sync or grpc.aio).

    Args:
        address (`str`): `host:port`, or `dns:///name:port` to spread calls over every replica.
        options (`list`, *optional*): channel options; they override the defaults below.
        aio (`bool`, defaults to `False`): a `grpc.aio` channel instead of a blocking one.
        env (`Mapping`): where the TLS and token settings are read.
        max_message_bytes (`int`, defaults to 16 MiB): largest message sent or received.

    Every channel has keepalive (`KEEPALIVE_CLIENT_OPTIONS`).
    """
    options = client_channel_options(options, max_message_bytes)
    if address.startswith("dns:///"):
        # Spread per-request streams over every replica behind a headless Service.
        options.append(("grpc.lb_policy_name", "round_robin"))
    tls = channel_credentials(env)
    metadata = auth_metadata(env)
    # OpenTelemetry's client interceptors (client spans, W3C trace context) when telemetry is set up.
    traced = telemetry.aio_client_interceptors() if aio else []
    if tls is not None:
        if metadata:
            tls = grpc.composite_channel_credentials(tls, grpc.metadata_call_credentials(_TokenPlugin(metadata)))
        if aio:
            return grpc.aio.secure_channel(address, tls, options=options, interceptors=traced or None)
        return telemetry.instrument_channel(grpc.secure_channel(address, tls, options=options))
    if aio:
        interceptors = [*traced, *([_AioTokenInterceptor(metadata)] if metadata else [])]
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors or None)
    channel = grpc.insecure_channel(address, options=options)
    if metadata:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(metadata))
    return telemetry.instrument_channel(channel)


class _AioTokenInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _details(self, details):
        metadata = grpc.aio.Metadata(*(tuple(details.metadata or ()) + self.metadata))
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the shared bearer token (health and reflection stay open)."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self.expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else _unauthenticated(handler)


def _unauthenticated(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or wrong bearer token: send `authorization: Bearer <SPECWIRE_AUTH_TOKEN>` metadata"

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)


def server_interceptors(env: Mapping[str, str] = os.environ) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors the security settings ask for."""
    token = env.get("SPECWIRE_AUTH_TOKEN")
    return [TokenAuthInterceptor(token)] if token else []
