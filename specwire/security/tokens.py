"""Bearer tokens: clients send one as `authorization: Bearer <token>` call metadata; servers read
theirs (one per role) from the environment or from files.

A client sends the token given to it (`token=`) or `SPECWIRE_AUTH_TOKEN`, whatever role it is: the
server maps the token to its role (`specwire.security.access`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "SPECWIRE_AUTH_TOKEN"
ADMIN_TOKEN_ENV = "SPECWIRE_ADMIN_TOKEN"


class SecuritySettingsError(ValueError):
    """The security settings cannot be honoured as given (a server refuses to start; a client channel
    is not created). The message names the setting and the fix."""


def client_token(token: str | None = None, env: Mapping[str, str] = os.environ) -> str:
    """The token a client sends: `token` when given ("" for none), else `SPECWIRE_AUTH_TOKEN`, else ""."""
    return env.get(TOKEN_ENV, "") if token is None else token


def auth_metadata(env: Mapping[str, str] = os.environ, token: str | None = None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the client's token (see `client_token`), if it has one."""
    value = client_token(token, env)
    return (("authorization", f"Bearer {value}"),) if value else ()


def read_token(name: str, env: Mapping[str, str] = os.environ) -> str | None:
    """A server's token from `name` or from the file `<name>_FILE` (a mounted Secret); None when neither is set.

    The file's surrounding whitespace (a trailing newline) is not part of the token.

    Raises:
        `SecuritySettingsError`: both are set, the file cannot be read, or the token is empty or holds
            characters that cannot travel in gRPC metadata.
    """
    value, path = env.get(name) or None, env.get(f"{name}_FILE") or None
    if value is not None and path is not None:
        raise SecuritySettingsError(f"set {name} or {name}_FILE, not both")
    if path is not None:
        try:
            value = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SecuritySettingsError(f"{name}_FILE={path}: cannot read the token: {exc}") from None
        if not value:
            raise SecuritySettingsError(f"{name}_FILE={path} is empty: write the token into it")
    if value is not None and not (value.isascii() and value.isprintable() and " " not in value):
        where = f"{name}_FILE={path}" if path else name
        raise SecuritySettingsError(
            f"{where}: a token is printable ASCII without spaces (it travels as `authorization: Bearer <token>`)"
        )
    return value


class TokenPlugin(grpc.AuthMetadataPlugin):
    """Call credentials that add the token to every call on a TLS channel."""

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


class _AioToken:
    """Adds the token to every call of one kind on a plaintext grpc.aio channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _details(self, details):
        metadata = grpc.aio.Metadata(*(tuple(details.metadata or ()) + self.metadata))
        return details._replace(metadata=metadata)


class _AioUnaryUnaryToken(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStreamToken(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnaryToken(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AioStreamStreamToken(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def aio_token_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[Any]:
    """Interceptors adding `metadata` to every call of a plaintext grpc.aio channel.

    One per call kind: grpc.aio files an interceptor under the first kind it implements only (its
    channel tests `isinstance` in an `elif` chain), so one object implementing all four kinds would
    only ever see unary-unary calls, and streams (the target's Draft stream) would go without a token.
    """
    kinds = (_AioUnaryUnaryToken, _AioUnaryStreamToken, _AioStreamUnaryToken, _AioStreamStreamToken)
    return [kind(metadata) for kind in kinds]
