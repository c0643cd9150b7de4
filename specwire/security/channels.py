"""Every client channel: keepalive, message-size limits, TLS, the bearer token and tracing.

A channel that would send a bearer token in plaintext to another machine is refused at creation
(`check_token_transport`) unless allowed explicitly.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import grpc

from specwire import telemetry
from specwire.security.access import ALLOW_INSECURE_TOKEN_ENV, env_flag, is_loopback
from specwire.security.tls import ClientFilesWatch, channel_credentials
from specwire.security.tokens import (
    SecuritySettingsError,
    TokenInterceptor,
    TokenPlugin,
    aio_token_interceptors,
    auth_metadata,
)
from specwire.vocabulary import LOAD_BALANCING_POLICIES, PICK_FIRST, ROUND_ROBIN

StubT = TypeVar("StubT")

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
# Pods come and go behind one name. gRPC's connection backoff (1 s, x1.6, up to 120 s) would leave a
# replica restarted at the same address unused for up to two minutes: 10 s at most instead (a dead
# address then costs one refused connection every 10 s; round_robin skips it meanwhile). A lost
# connection makes the channel resolve its name again, at most every 30 s by default: 5 s instead,
# the TTL CoreDNS gives a headless Service's records, so a replaced pod is found within seconds.
# gRPC's DNS resolver never polls: new pods of a scale-up are found when a connection ends, which the
# servers force every few minutes (`specwire.serving.CONNECTION_AGE_SERVER_OPTIONS`).
RECONNECT_CLIENT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 1_000),
    ("grpc.max_reconnect_backoff_ms", 10_000),
    ("grpc.dns_min_time_between_resolutions_ms", 5_000),
]
# Largest message a client channel sends or receives unless its caller asks for more.
DEFAULT_CLIENT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# The reads a channel may send again when the server could not be reached (UNAVAILABLE: a restart, a
# drain, a refused connection): they change nothing, so a second copy is harmless. Explicit, never a
# whole service: writes (Create/Update/SetTag/Delete/Import) may have landed before the connection
# broke, generation costs model time and is not repeatable for sampled outputs, and a stream cannot be
# retried once its first message is out. A method named here that a server lacks is never called.
IDEMPOTENT_READS: dict[str, tuple[str, ...]] = {
    "specwire.config.v1.ConfigService": (
        "GetConfig",
        "ListConfigs",
        "ListConfigHistory",
        "ExportConfig",
        "ValidateConfig",
    ),
    "specwire.target.v1.TargetService": ("GetModelInfo", "DetectWatermark"),
    "grpc.health.v1.Health": ("Check",),
}
# gRPC's retry policy (gRFC A6): up to 4 attempts, waits drawn from [0, 0.2 s], [0, 0.4 s], [0, 0.8 s],
# so about 1.4 s at most in all: enough to ride through a refused connection while a pod restarts or a
# Service moves to another replica, short next to any call's deadline (which still bounds every
# attempt and wait). UNAVAILABLE only: DEADLINE_EXCEEDED means the time is spent, and every other
# code is the server's answer.
READ_RETRY_POLICY: dict[str, Any] = {
    "maxAttempts": 4,
    "initialBackoff": "0.2s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


# Generation is resent only while no server has taken it up. The target sends its response headers as
# soon as it admits a request (`TargetServicer._run`), and gRPC never resends a call once headers arrived
# (gRFC A6: the call is committed). Before that, a call can still fail: a draining replica's gRPC core
# cancels the calls it had received but not yet handed to a handler (CANCELLED, grpc/grpc#41785), and a
# replica that dies between receiving a call and admitting it leaves it UNAVAILABLE. Neither ran, so
# sending it to another replica is what the caller wants. A call cut after its headers (a killed replica,
# a drain's grace running out) is not resent.
UNSTARTED_GENERATION: dict[str, tuple[str, ...]] = {"specwire.target.v1.TargetService": ("Generate", "GenerateStream")}
UNSTARTED_RETRY_POLICY: dict[str, Any] = {**READ_RETRY_POLICY, "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]}


def retry_service_config() -> str:
    """The channels' service config (JSON): `READ_RETRY_POLICY` on each of `IDEMPOTENT_READS`, and
    `UNSTARTED_RETRY_POLICY` on generation (resent only before a target took it up)."""

    def names(methods: dict[str, tuple[str, ...]]) -> list[dict[str, str]]:
        return [{"service": service, "method": method} for service, group in methods.items() for method in group]

    return json.dumps(
        {
            "methodConfig": [
                {"name": names(IDEMPOTENT_READS), "retryPolicy": READ_RETRY_POLICY},
                {"name": names(UNSTARTED_GENERATION), "retryPolicy": UNSTARTED_RETRY_POLICY},
            ]
        }
    )


def client_channel_options(
    options: list[tuple[str, Any]] | None = None, max_message_bytes: int = DEFAULT_CLIENT_MAX_MESSAGE_BYTES
) -> list[tuple[str, Any]]:
    """Keepalive, message-size limits and the read retry policy of every client channel, then `options`
    (which win, key by key)."""
    merged = dict(
        [
            *KEEPALIVE_CLIENT_OPTIONS,
            *RECONNECT_CLIENT_OPTIONS,
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", retry_service_config()),
        ]
    )
    merged.update(options or [])
    return list(merged.items())


def _split_target(address: str) -> tuple[str, list[str]] | None:
    """`(scheme, addresses)` of a gRPC target: `dns` for `host:port` and `dns:[//authority/]host:port`,
    `ipv4`/`ipv6` with every address of the list; None for Unix sockets and vsock."""
    target = address.strip()
    if target.startswith(("unix:", "unix-abstract:", "vsock:")):
        return None
    scheme = "dns"
    for prefix in ("dns:", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            scheme, target = prefix[:-1], target[len(prefix) :]
            break
    if target.startswith("//"):  # dns://authority/host:port: the authority is the DNS server
        target = target[2:].partition("/")[2]
    return scheme, [part.strip() for part in target.split(",") if part.strip()]


def _host(address: str) -> str:
    if address.startswith("["):
        return address[1 : address.find("]")]
    if address.count(":") == 1:
        return address.rsplit(":", 1)[0]
    return address  # a bare host, or a bare IPv6 address


def address_hosts(address: str) -> list[str] | None:
    """Every host a gRPC target names (`host:port`, `[v6]:port`, `dns:///name:port`,
    `ipv4:a.b.c.d:port,e.f.g.h:port`, `ipv6:[::1]:port,...`); None for Unix sockets (local by nature)."""
    split = _split_target(address)
    return None if split is None else [_host(part) for part in split[1]]


def address_host(address: str) -> str | None:
    """The first host a gRPC target names (see `address_hosts`); None for Unix sockets."""
    hosts = address_hosts(address)
    return None if hosts is None else (hosts[0] if hosts else "")


def stays_on_this_machine(address: str) -> bool:
    """Whether every host a gRPC target names is this machine (loopback), or it is a local socket (Unix, vsock)."""
    hosts = address_hosts(address)
    # Every address of a multi-address target must be local: calls may go to any of them.
    return hosts is None or (bool(hosts) and all(is_loopback(host) for host in hosts))


def load_balancing_policy(address: str, load_balancing: str | None = None) -> str:
    """The load-balancing policy of a channel to `address`: `load_balancing` when given, else
    `round_robin` for targets that name several replicas (`dns:///name:port`, whose DNS answer may list
    many; `ipv4:`/`ipv6:` lists of two or more), else `pick_first` (gRPC's own default: one address).

    Raises:
        `ValueError`: `load_balancing` is not one of `LOAD_BALANCING_POLICIES`.
    """
    if load_balancing is not None:
        if load_balancing not in LOAD_BALANCING_POLICIES:
            raise ValueError(
                f"load_balancing must be one of {list(LOAD_BALANCING_POLICIES)}, got {load_balancing!r}: "
                f"{ROUND_ROBIN!r} spreads calls over every address, {PICK_FIRST!r} uses one"
            )
        return load_balancing
    split = _split_target(address)
    if split is not None and (address.strip().startswith("dns:") or len(split[1]) > 1):
        return ROUND_ROBIN
    return PICK_FIRST


def check_token_transport(
    address: str,
    *,
    env: Mapping[str, str] = os.environ,
    token: str | None = None,
    allow_insecure_token: bool | None = None,
) -> None:
    """Refuse to send a bearer token in plaintext to a non-loopback `address`.

    Args:
        address (`str`): the channel's target.
        env (`Mapping`): where the TLS and token settings are read.
        token (`str`, *optional*): the token to send; default `SPECWIRE_AUTH_TOKEN` ("" for none).
        allow_insecure_token (`bool`, *optional*): allow it anyway; default `SPECWIRE_ALLOW_INSECURE_TOKEN`.

    Raises:
        `SecuritySettingsError` (a `ValueError`): the token would travel unencrypted off this machine.
    """
    if not auth_metadata(env, token) or channel_credentials(env) is not None:
        return
    if stays_on_this_machine(address):
        return
    if env_flag(ALLOW_INSECURE_TOKEN_ENV, env) if allow_insecure_token is None else allow_insecure_token:
        return
    raise SecuritySettingsError(
        f"refusing to send the bearer token in plaintext to {address}: anyone on the path could read it. Set "
        "SPECWIRE_TLS_CA_FILE (the CA of the server's certificate) to use TLS, or, on a network you trust, pass "
        f"allow_insecure_token=True (CLI and servers: --allow-insecure-token, env {ALLOW_INSECURE_TOKEN_ENV}=true)"
    )


def secure_channel(
    address: str,
    options: list[tuple[str, Any]] | None = None,
    *,
    aio: bool = False,
    env: Mapping[str, str] = os.environ,
    max_message_bytes: int = DEFAULT_CLIENT_MAX_MESSAGE_BYTES,
    token: str | None = None,
    allow_insecure_token: bool | None = None,
    load_balancing: str | None = None,
):
    """A client channel to `address` honouring the TLS and token settings (sync or grpc.aio).

    Args:
        address (`str`): any gRPC target: `host:port`, `dns:///name:port` (every address the name
            resolves to, e.g. a headless Service's pods), `ipv4:a.b.c.d:port,e.f.g.h:port`,
            `ipv6:[::1]:port,...`, `unix:/path`.
        options (`list`, *optional*): channel options; they override the defaults below.
        aio (`bool`, defaults to `False`): a `grpc.aio` channel instead of a blocking one.
        env (`Mapping`): where the TLS and token settings are read.
        max_message_bytes (`int`, defaults to 16 MiB): largest message sent or received.
        token (`str`, *optional*): the bearer token every call sends, whatever its role; default
            `SPECWIRE_AUTH_TOKEN`; "" sends none.
        allow_insecure_token (`bool`, *optional*): send the token in plaintext to a non-loopback address;
            default `SPECWIRE_ALLOW_INSECURE_TOKEN`. Without it such a channel is refused.
        load_balancing (`str`, *optional*): `"round_robin"` or `"pick_first"`; default `round_robin` for
            `dns:` targets and address lists, `pick_first` otherwise (`load_balancing_policy`).

    Every channel has keepalive (`KEEPALIVE_CLIENT_OPTIONS`), reconnects quickly to replicas that come
    back (`RECONNECT_CLIENT_OPTIONS`) and retries the reads of `IDEMPOTENT_READS` on UNAVAILABLE
    (`READ_RETRY_POLICY`). Other calls (Generate, writes) are not retried once sent, except by gRPC's
    transparent retries (gRFC A6), which resend a call that never reached the server's application
    (its connection was lost before the call went out, or the server refused the stream unread).

    Raises:
        `ValueError`: an unknown `load_balancing`.
        `SecuritySettingsError` (a `ValueError`): a token without TLS to a non-loopback address, not allowed.
    """
    policy = load_balancing_policy(address, load_balancing)
    check_token_transport(address, env=env, token=token, allow_insecure_token=allow_insecure_token)
    options = client_channel_options([("grpc.lb_policy_name", policy), *(options or [])], max_message_bytes)
    tls = channel_credentials(env)
    metadata = auth_metadata(env, token)
    # OpenTelemetry's client interceptors (client spans, W3C trace context) when telemetry is set up.
    traced = telemetry.aio_client_interceptors() if aio else []
    if tls is not None:
        if metadata:
            tls = grpc.composite_channel_credentials(tls, grpc.metadata_call_credentials(TokenPlugin(metadata)))
        if aio:
            return grpc.aio.secure_channel(address, tls, options=options, interceptors=traced or None)
        return telemetry.instrument_channel(grpc.secure_channel(address, tls, options=options))
    if aio:
        interceptors = [*traced, *(aio_token_interceptors(metadata) if metadata else [])]
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors or None)
    channel = grpc.insecure_channel(address, options=options)
    if metadata:
        channel = grpc.intercept_channel(channel, TokenInterceptor(metadata))
    return telemetry.instrument_channel(channel)


class RenewingChannel(Generic[StubT]):
    """A long-lived grpc.aio channel and its stub, replaced when the TLS files change.

    A channel reads the certificate files once, when it is made, and keeps presenting that client
    certificate on every reconnect. The target's channels to the registry and to the draft service live
    as long as the process, so each call's `stub()` first asks `ClientFilesWatch` (at most once a second)
    whether the files changed; when they did, new calls go to a new channel with the renewed certificate,
    and the old one is closed once its calls end (at most `retire_grace_s` later). Use it on one event
    loop only (a grpc.aio channel belongs to the loop it was made on).

    Args:
        address (`str`): `host:port` or `dns:///name:port`.
        make_stub (`Callable`): the generated stub class (or any callable taking the channel).
        retire_grace_s (`float`): how long calls in flight on a replaced channel may still run.
    """

    def __init__(self, address: str, make_stub: Callable[[grpc.aio.Channel], StubT], retire_grace_s: float):
        self.address = address
        self.make_stub = make_stub
        self.retire_grace_s = retire_grace_s
        self.renewals = 0  # channels replaced after a certificate change (observability and tests)
        self._channel: grpc.aio.Channel | None = None
        self._stub: StubT | None = None
        self._watch: ClientFilesWatch | None = None
        self._retiring: set[asyncio.Task] = set()

    def stub(self) -> StubT:
        """The stub of the current channel (made on first use, renewed after a certificate change)."""
        if self._stub is None or self._watch is None:
            self._watch = ClientFilesWatch()
            return self._renew()
        if self._watch.changed():
            self.renewals += 1
            return self._renew()
        return self._stub

    def _renew(self) -> StubT:
        old = self._channel
        self._channel = secure_channel(self.address, aio=True)
        self._stub = self.make_stub(self._channel)
        if old is not None:
            task = asyncio.get_running_loop().create_task(old.close(grace=self.retire_grace_s))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return self._stub

    async def close(self) -> None:
        """Close the channel now (calls still open on it are cancelled), and any being retired."""
        for task in list(self._retiring):
            task.cancel()
        if self._channel is not None:
            await self._channel.close()
        self._channel, self._stub = None, None
