"""Resolves registry references (`name`, `name@3`, `name:prod`) through the config service.

`name@3` means one config forever (the registry never reuses a version number: a deleted version is
a tombstone), so it is cached until it is the least recently used of `max_entries` pinned references
and never asked for again. A reference that can move (`name`, `name:tag`) is refreshed when its
cached value is older than `ttl_s` seconds, so an update or a re-tag is seen within a few seconds.
Both caches are LRU-bounded: callers choose the references, so an unbounded cache would grow with
every distinct name a client sends.

Registry outages. When a refresh fails because the registry cannot be reached (UNAVAILABLE,
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED: a restart, a node drain, a partition, an overload), the last
good value is served while it is at most `stale_max_s` seconds old, with a warning (`FieldProblem`,
severity warning) naming the reference and its age in the response. Once a refresh has failed, the
stale value is served at once and the registry is asked again in the background, at most once per
`ttl_s`: only the first request after the registry goes away waits for it (up to the lookup timeout
when it hangs), not every request, and the first answer after it is back refreshes the cache. Past
`stale_max_s` the request fails UNAVAILABLE. NOT_FOUND
and INVALID_ARGUMENT are the registry's answers, not outages: the cached value is dropped and the
error returned, so a deleted config stops being served as soon as the registry says so.

Concurrent lookups of one reference share one fetch (no burst of identical GetConfig calls when a
popular tag's TTL runs out). The fetch is bounded by `timeout_s`; each caller waits for it at most
its own remaining time (`specwire.deadline`): a request whose deadline is near does not wait on the
registry beyond it, and the fetch it started still fills the cache for the next request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from specwire.config.v1 import config_service_pb2 as pb
from specwire.config.v1 import config_service_pb2_grpc as pb_grpc
from specwire.deadline import remaining
from specwire.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    FieldProblem,
    InvalidArgument,
    NotFound,
    Unavailable,
    clip,
)
from specwire.generation.config import GenerationConfig
from specwire.security.channels import RenewingChannel
from specwire.wire.generation_config import config_from_proto

log = logging.getLogger("specwire.target_service.config_resolver")

K = TypeVar("K")
V = TypeVar("V")

# The registry could not be reached or could not answer now: the config itself may be unchanged, so
# the last good value may be served. Every other failure (NOT_FOUND, INVALID_ARGUMENT, PERMISSION_DENIED,
# INTERNAL, ...) is an answer or a misconfiguration and is never hidden behind a cached value.
OUTAGE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
# How long a stale value may be served by default (`--config-stale-max`): a registry pod restart, a
# node drain or a rolling update takes seconds to a couple of minutes (rescheduling, volume re-attach,
# image pull), and 5 minutes rides through those, while a config changed or deleted during the outage
# is not served for longer than that.
DEFAULT_STALE_MAX_S = 300.0


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

    def pop(self, key: K) -> V | None:
        return self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True)
class ResolvedConfig:
    """A registry config and which version it was.

    `warnings` is non-empty when the value was served from the cache during a registry outage (the
    response carries them).
    """

    name: str
    version: int
    config: GenerationConfig
    warnings: tuple[FieldProblem, ...] = ()


@dataclass
class _MovingEntry:
    """The last good value of a moving reference, when it was fetched and the last failed refresh."""

    resolved: ResolvedConfig
    fetched_at: float  # time.monotonic()
    failed_at: float | None = None
    failure: str = ""


def _is_pinned(ref: str) -> bool:
    return "@" in ref


class ConfigResolver:
    """Cached lookups of registry references, served through registry outages.

    Args:
        address (`str`, *optional*): `host:port` of the config service; None means references are refused.
        ttl_s (`float`, defaults to 2.0): how long a moving reference (latest or tag) is served from
            cache before it is refreshed.
        timeout_s (`float`, defaults to 5.0): the longest a lookup may take; a caller waits less when
            its deadline is nearer.
        max_entries (`int`, defaults to 256): references kept in each cache (pinned, moving).
        stale_max_s (`float`, defaults to 300.0): the oldest a moving reference's last good value may be
            when it is served during a registry outage (`--config-stale-max`); 0 never serves stale values.
    """

    def __init__(
        self,
        address: str | None,
        ttl_s: float = 2.0,
        timeout_s: float = 5.0,
        max_entries: int = 256,
        stale_max_s: float = DEFAULT_STALE_MAX_S,
    ):
        if stale_max_s < 0:
            raise ValueError(f"stale_max_s must be >= 0 (0 disables stale serving), got {stale_max_s}")
        self.address = address
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.stale_max_s = stale_max_s
        # Made on first use (a grpc.aio channel belongs to the event loop it is made on), renewed when the
        # TLS files change; a lookup lasts at most timeout_s, so a replaced channel is closed after that.
        self._channel = RenewingChannel(str(address), pb_grpc.ConfigServiceStub, retire_grace_s=timeout_s)
        self._pinned: LruCache[str, ResolvedConfig] = LruCache(max_entries)
        self._moving: LruCache[str, _MovingEntry] = LruCache(max_entries)
        # The fetch in flight per reference: later callers of that reference wait on it instead of
        # sending their own. An entry leaves when its fetch ends (within timeout_s).
        self._fetches: dict[str, asyncio.Future[ResolvedConfig]] = {}

    async def close(self) -> None:
        for fetch in list(self._fetches.values()):
            fetch.cancel()
        await self._channel.close()

    async def resolve(self, ref: str, field: str = "config_ref") -> ResolvedConfig:
        """The config `ref` names; NOT_FOUND / INVALID_ARGUMENT as the registry says; UNAVAILABLE when the
        registry cannot be reached and no value younger than `stale_max_s` is cached; DEADLINE_EXCEEDED
        when the caller's deadline passes first."""
        pinned = self._pinned.get(ref)
        if pinned is not None:
            return pinned
        entry = self._moving.get(ref)
        now = time.monotonic()
        if entry is not None:
            if now - entry.fetched_at < self.ttl_s:
                return entry.resolved
            if entry.failed_at is not None and self._servable(entry, now):
                # The registry is known to be down: this request does not wait for it; a background
                # refresh (one per TTL) finds out when it is back.
                if now - entry.failed_at >= self.ttl_s:
                    self._start_fetch(ref)
                return self._stale(entry, ref, field, now)
        if self.address is None:
            raise FailedPrecondition(
                f"{field}={ref!r}: this target service has no config registry; start it with --config-address "
                "or send the config inline"
            )
        left = remaining()
        if left is not None and left <= 0:
            raise DeadlineExceeded(f"{field}={ref!r}: the request's deadline passed before the config lookup")
        fetch = self._start_fetch(ref)
        try:
            if left is None or left >= self.timeout_s:
                return await asyncio.shield(fetch)  # the fetch ends within timeout_s by itself
            return await asyncio.wait_for(asyncio.shield(fetch), left)
        except TimeoutError:
            raise DeadlineExceeded(
                f"{field}={ref!r}: the request's deadline passed during the config lookup ({left:.2f}s were left)"
            ) from None
        except grpc.aio.AioRpcError as exc:
            entry = self._moving.get(ref) if exc.code() in OUTAGE_CODES and not _is_pinned(ref) else None
            if entry is not None and self._servable(entry, time.monotonic()):
                return self._stale(entry, ref, field, time.monotonic())
            raise self._error(exc, ref, field, entry) from exc

    def _start_fetch(self, ref: str) -> asyncio.Future[ResolvedConfig]:
        """The fetch of `ref` in flight, started now if there is none."""
        fetch = self._fetches.get(ref)
        if fetch is None:
            fetch = asyncio.ensure_future(self._fetch(ref))
            self._fetches[ref] = fetch
            fetch.add_done_callback(lambda done: self._fetched(ref, done))
        return fetch

    def _fetched(self, ref: str, fetch: asyncio.Future[ResolvedConfig]) -> None:
        if self._fetches.get(ref) is fetch:
            del self._fetches[ref]
        if not fetch.cancelled():
            fetch.exception()  # retrieved: a fetch all of whose callers gave up is not a loop warning

    async def _fetch(self, ref: str) -> ResolvedConfig:
        """One GetConfig call, bounded by `timeout_s`; updates the caches with what the registry said."""
        try:
            response = await self._channel.stub().GetConfig(pb.GetConfigRequest(ref=ref), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in OUTAGE_CODES:
                entry = self._moving.get(ref)
                if entry is not None:
                    if entry.failed_at is None:
                        log.warning(
                            "config registry at %s unreachable refreshing %r: %s", self.address, ref, _said(exc)
                        )
                    entry.failed_at, entry.failure = time.monotonic(), _said(exc)
            elif exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                self._moving.pop(ref)  # deleted or no longer valid: never served again from the cache
            raise
        record = response.record
        resolved = ResolvedConfig(record.name, record.version, config_from_proto(record.config))
        if _is_pinned(ref):
            self._pinned.put(ref, resolved)
        else:
            entry = self._moving.get(ref)
            if entry is not None and entry.failed_at is not None:
                log.info("config registry at %s reachable again (%r refreshed)", self.address, ref)
            self._moving.put(ref, _MovingEntry(resolved, time.monotonic()))
        return resolved

    def _servable(self, entry: _MovingEntry, now: float) -> bool:
        return self.stale_max_s > 0 and now - entry.fetched_at <= self.stale_max_s

    def _stale(self, entry: _MovingEntry, ref: str, field: str, now: float) -> ResolvedConfig:
        """The cached value with a warning saying it is stale, how old, and why."""
        age = now - entry.fetched_at
        resolved = entry.resolved
        warning = FieldProblem(
            field,
            ref,
            f"served from the target's cache, {age:.1f}s old ({resolved.name}@{resolved.version}): the config "
            f"registry at {self.address} is unreachable ({clip(entry.failure, 80)}); a value up to "
            f"--config-stale-max {self.stale_max_s:g}s old is served until it is back",
            "warning",
        )
        return dataclasses.replace(resolved, warnings=(warning,))

    def _error(
        self, exc: grpc.aio.AioRpcError, ref: str, field: str, entry: _MovingEntry | None
    ) -> NotFound | InvalidArgument | Unavailable:
        """A failed fetch as the caller's error; `entry` is the cached value too old to serve, if any."""
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND:
            return NotFound(f"{field}={ref!r}: {exc.details()}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgument.for_field(field, ref, exc.details() or "not a valid reference")
        message = f"config registry at {self.address} failed resolving {ref!r}: {_said(exc)}"
        if entry is not None:
            age = time.monotonic() - entry.fetched_at
            if self.stale_max_s > 0:
                message += (
                    f"; the last good value ({entry.resolved.name}@{entry.resolved.version}) is {age:.0f}s old, "
                    f"past --config-stale-max {self.stale_max_s:g}s"
                )
            else:
                message += "; stale values are not served (--config-stale-max 0)"
        if code in OUTAGE_CODES:
            message += (
                ": bring the registry back, raise --config-stale-max, or send the config inline "
                "(`config`) instead of a reference"
            )
        return Unavailable(message)


def _said(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"
