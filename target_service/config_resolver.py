"""Resolves registry references (`name`, `name@3`, `name:prod`) through the config service.

Versions are immutable, so `name@3` is cached for the life of the process. A reference that can
move (`name`, `name:tag`) is cached for at most `ttl_s` seconds, so an update or a re-tag is seen
within a few seconds and never served stale longer than that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from specwire.config.v1 import config_service_pb2 as pb
from specwire.config.v1 import config_service_pb2_grpc as pb_grpc
from specwire.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from specwire.generation.config import GenerationConfig
from specwire.security import secure_channel
from specwire.wire.generation_config import config_from_proto


@dataclass(frozen=True)
class ResolvedConfig:
    """A registry config and which version it was."""

    name: str
    version: int
    config: GenerationConfig


class ConfigResolver:
    """Cached lookups of registry references.

    Args:
        address (`str`, *optional*): `host:port` of the config service; None means references are refused.
        ttl_s (`float`, defaults to 2.0): how long a moving reference (latest or tag) may be served from cache.
        timeout_s (`float`, defaults to 5.0): deadline of each lookup.
    """

    def __init__(self, address: str | None, ttl_s: float = 2.0, timeout_s: float = 5.0):
        self.address = address
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        # Created on first use: a grpc.aio channel belongs to the event loop it is created on.
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ConfigServiceStub | None = None
        self._pinned: dict[str, ResolvedConfig] = {}
        self._moving: dict[str, tuple[float, ResolvedConfig]] = {}

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def resolve(self, ref: str, field: str = "config_ref") -> ResolvedConfig:
        """The config `ref` names; NOT_FOUND / INVALID_ARGUMENT / UNAVAILABLE as the registry says."""
        if ref in self._pinned:
            return self._pinned[ref]
        cached = self._moving.get(ref)
        if cached is not None and time.monotonic() - cached[0] < self.ttl_s:
            return cached[1]
        if self.address is None:
            raise FailedPrecondition(
                f"{field}={ref!r}: this target service has no config registry; start it with --config-address "
                "or send the config inline"
            )
        if self._stub is None:
            self._channel = secure_channel(self.address, aio=True)
            self._stub = pb_grpc.ConfigServiceStub(self._channel)
        try:
            response = await self._stub.GetConfig(pb.GetConfigRequest(ref=ref), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"{field}={ref!r}: {exc.details()}") from exc
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument.for_field(field, ref, exc.details() or "not a valid reference") from exc
            raise Unavailable(
                f"config registry at {self.address} failed resolving {ref!r}: "
                f"{exc.code().name}: {exc.details()}"
            ) from exc
        record = response.record
        resolved = ResolvedConfig(record.name, record.version, config_from_proto(record.config))
        if "@" in ref:
            self._pinned[ref] = resolved
        else:
            self._moving[ref] = (time.monotonic(), resolved)
        return resolved
