"""The bearer token: clients send it as `authorization: Bearer <token>` call metadata, servers check it."""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

import grpc

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def auth_metadata(env: Mapping[str, str] = os.environ) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the shared token, if one is configured."""
    token = env.get("SPECWIRE_AUTH_TOKEN")
    return (("authorization", f"Bearer {token}"),) if token else ()


class TokenPlugin(grpc.AuthMetadataPlugin):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def __call__(self, context, callback) -> None:
        callback(self.metadata, None)


class TokenInterceptor(
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


class AioTokenInterceptor(
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
