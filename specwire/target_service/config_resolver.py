"""Resolves registry references (`name`, `name@3`, `name:prod`) through the config service.

Versions are immutable, so `name@3` is cached until it is the least recently used of `max_entries`
pinned references. A reference that can move (`name`, `name:tag`) is cached for at most `ttl_s`
seconds (and within `max_entries` too), so an update or a re-tag is seen within a few seconds and
never served stale longer than that. Both caches are LRU-bounded: callers choose the references, so
an unbounded cache would grow with every distinct name a client sends.

A lookup's deadline is `min(timeout_s, the caller's remaining time)` (`specwire.deadline`): a request
whose deadline is near does not wait on the registry beyond it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

import grpc

from specwire.config.v1 import config_service_pb2 as pb
from specwire.config.v1 import config_service_pb2_grpc as pb_grpc
from specwire.deadline import remaining
from specwire.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from specwire.generation.config import GenerationConfig
from specwire.security.channels import secure_channel
from specwire.wire.generation_config import config_from_proto

K = TypeVar("K")
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """A dict of at most `max_entries` items that forgets the least recently used one first."""

    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


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
        timeout_s (`float`, defaults to 5.0): the longest a lookup may take; shorter when the caller's
            deadline is nearer.
        max_entries (`int`, defaults to 256): references kept in each cache (pinned, moving).
    """

    def __init__(self, address: str | None, ttl_s: float = 2.0, timeout_s: float = 5.0, max_entries: int = 256):
        self.address = address
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        # Created on first use: a grpc.aio channel belongs to the event loop it is created on.
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ConfigServiceStub | None = None
        self._pinned: LruCache[str, ResolvedConfig] = LruCache(max_entries)
        self._moving: LruCache[str, tuple[float, ResolvedConfig]] = LruCache(max_entries)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def resolve(self, ref: str, field: str = "config_ref") -> ResolvedConfig:
        """The config `ref` names; NOT_FOUND / INVALID_ARGUMENT / UNAVAILABLE as the registry says."""
        pinned = self._pinned.get(ref)
        if pinned is not None:
            return pinned
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
        timeout = cast(float, remaining(self.timeout_s))  # capped by timeout_s: never None
        if timeout <= 0:
            raise DeadlineExceeded(f"{field}={ref!r}: the request's deadline passed before the config lookup")
        try:
            response = await self._stub.GetConfig(pb.GetConfigRequest(ref=ref), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"{field}={ref!r}: {exc.details()}") from exc
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument.for_field(field, ref, exc.details() or "not a valid reference") from exc
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout < self.timeout_s:
                raise DeadlineExceeded(
                    f"{field}={ref!r}: the request's deadline passed during the config lookup "
                    f"({timeout:.2f}s were left)"
                ) from exc
            raise Unavailable(
                f"config registry at {self.address} failed resolving {ref!r}: {exc.code().name}: {exc.details()}"
            ) from exc
        record = response.record
        resolved = ResolvedConfig(record.name, record.version, config_from_proto(record.config))
        if "@" in ref:
            self._pinned.put(ref, resolved)
        else:
            self._moving.put(ref, (time.monotonic(), resolved))
        return resolved
