"""Who may call what: a server's credentials (tokens per role, mutual-TLS identities), its access flags
(`--read-only`, `--allow-anonymous-writes`, `--allow-insecure-token`), and the decision for one call.

Credentials, from the environment (the Helm chart mounts them from Secrets):

- `SPECWIRE_AUTH_TOKEN` / `SPECWIRE_AUTH_TOKEN_FILE`: the reader token (reads and generation).
- `SPECWIRE_ADMIN_TOKEN` / `SPECWIRE_ADMIN_TOKEN_FILE`: the admin token (also registry writes).
- `SPECWIRE_ADMIN_IDENTITIES` / `SPECWIRE_READER_IDENTITIES`: with mutual TLS, comma-separated client
  certificate identities (SAN values: `spiffe://...` URIs, DNS names) and the role each gets.

How a call is authenticated (`AccessPolicy.authorize`):

1. A bearer token, when sent, decides: the admin or the reader token, else UNAUTHENTICATED.
2. Without a token, the client certificate's identity, when identities are configured: its role, or
   PERMISSION_DENIED for a certificate mapped to no role.
3. Without either: UNAUTHENTICATED when the server has tokens or identities. With mutual TLS and neither
   configured, a certificate the CA signed is the credential and has the admin role (what mutual TLS
   granted before roles existed). With no credentials configured at all, the call is anonymous.

Then: a registry write on a `--read-only` server is FAILED_PRECONDITION, a role that is not enough is
PERMISSION_DENIED naming the role needed, and an anonymous write to a server bound to a non-loopback
address is PERMISSION_DENIED unless `--allow-anonymous-writes`.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from specwire.security.identity import ANONYMOUS
from specwire.security.roles import Role, is_registry_write, method_name, required_role
from specwire.security.tokens import ADMIN_TOKEN_ENV, TOKEN_ENV, SecuritySettingsError, read_token

ADMIN_IDENTITIES_ENV = "SPECWIRE_ADMIN_IDENTITIES"
READER_IDENTITIES_ENV = "SPECWIRE_READER_IDENTITIES"
READ_ONLY_ENV = "SPECWIRE_READ_ONLY"
ALLOW_ANONYMOUS_WRITES_ENV = "SPECWIRE_ALLOW_ANONYMOUS_WRITES"
ALLOW_INSECURE_TOKEN_ENV = "SPECWIRE_ALLOW_INSECURE_TOKEN"

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_flag(name: str, env: Mapping[str, str] = os.environ) -> bool:
    """A boolean setting from the environment: 1/true/yes/on or 0/false/no/off (unset: false).

    Raises:
        `SecuritySettingsError`: any other value (it is refused, not read as false).
    """
    value = env.get(name, "").strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise SecuritySettingsError(f"{name}={env[name]!r}: expected true or false (1/0, yes/no, on/off)")


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address or a host name) only reaches this machine: `localhost`, 127.0.0.0/8, ::1.

    Host names other than `localhost`, the wildcard addresses (0.0.0.0, ::) and "" are not loopback.
    """
    host = host.strip().strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerAccess:
    """A server's access flags (`add_access_arguments`); each defaults to its environment variable.

    Args:
        read_only (`bool`, defaults to `False`): refuse registry writes (`--read-only`, config service only).
        allow_anonymous_writes (`bool`, defaults to `False`): allow registry writes without credentials on a
            non-loopback address (`--allow-anonymous-writes`).
        allow_insecure_token (`bool`, defaults to `False`): serve (and send) bearer tokens in plaintext on a
            non-loopback address (`--allow-insecure-token`).
    """

    read_only: bool = False
    allow_anonymous_writes: bool = False
    allow_insecure_token: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ServerAccess:
        """The flags as their environment variables set them (what a server built without flags uses)."""
        return cls(
            read_only=env_flag(READ_ONLY_ENV, env),
            allow_anonymous_writes=env_flag(ALLOW_ANONYMOUS_WRITES_ENV, env),
            allow_insecure_token=env_flag(ALLOW_INSECURE_TOKEN_ENV, env),
        )


def _flag_default(parser: argparse.ArgumentParser, name: str) -> bool:
    try:
        return env_flag(name)
    except SecuritySettingsError as exc:
        parser.error(str(exc))
    return False  # unreachable: parser.error exits


def add_access_arguments(parser: argparse.ArgumentParser, registry: bool = False) -> None:
    """`--allow-insecure-token` (every server), and `--read-only`, `--allow-anonymous-writes` (the registry).

    Each flag defaults to its environment variable (`SPECWIRE_ALLOW_INSECURE_TOKEN`, `SPECWIRE_READ_ONLY`,
    `SPECWIRE_ALLOW_ANONYMOUS_WRITES` = true/false), as the Helm chart sets them.
    """
    group = parser.add_argument_group("access (tokens and identities: SPECWIRE_AUTH_TOKEN, SPECWIRE_ADMIN_TOKEN, ...)")
    if registry:
        group.add_argument(
            "--read-only",
            action="store_true",
            default=_flag_default(parser, READ_ONLY_ENV),
            help="serve reads only: registry writes get FAILED_PRECONDITION (env SPECWIRE_READ_ONLY)",
        )
        group.add_argument(
            "--allow-anonymous-writes",
            action="store_true",
            default=_flag_default(parser, ALLOW_ANONYMOUS_WRITES_ENV),
            help="accept registry writes without credentials on a non-loopback address (refused otherwise; "
            "env SPECWIRE_ALLOW_ANONYMOUS_WRITES)",
        )
    group.add_argument(
        "--allow-insecure-token",
        action="store_true",
        default=_flag_default(parser, ALLOW_INSECURE_TOKEN_ENV),
        help="check and send bearer tokens over plaintext on a non-loopback address (refused otherwise: "
        "use TLS; env SPECWIRE_ALLOW_INSECURE_TOKEN)",
    )


def access_from_args(args: argparse.Namespace) -> ServerAccess:
    """The `ServerAccess` of parsed `add_access_arguments` flags."""
    return ServerAccess(
        read_only=getattr(args, "read_only", False),
        allow_anonymous_writes=getattr(args, "allow_anonymous_writes", False),
        allow_insecure_token=args.allow_insecure_token,
    )


class AccessDenied(Exception):
    """A call refused by the access policy: the gRPC status code and the message for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _identities(name: str, env: Mapping[str, str]) -> frozenset[str]:
    return frozenset(part.strip() for part in env.get(name, "").split(",") if part.strip())


@dataclass(frozen=True)
class AccessPolicy:
    """A server's credentials and access flags, and the decision for each call (`authorize`).

    Args:
        reader_token (`str`, *optional*): the reader token.
        admin_token (`str`, *optional*): the admin token.
        admin_identities (`frozenset[str]`): client certificate identities (SANs) with the admin role.
        reader_identities (`frozenset[str]`): client certificate identities with the reader role.
        mutual_tls (`bool`): the server requires client certificates.
        host (`str`): the address the server binds (anonymous writes are refused off loopback).
        access (`ServerAccess`): the access flags.
    """

    reader_token: str | None = None
    admin_token: str | None = None
    admin_identities: frozenset[str] = frozenset()
    reader_identities: frozenset[str] = frozenset()
    mutual_tls: bool = False
    host: str = "127.0.0.1"
    access: ServerAccess = field(default_factory=ServerAccess)

    @classmethod
    def from_env(
        cls,
        host: str,
        access: ServerAccess | None = None,
        env: Mapping[str, str] = os.environ,
        tls: bool | None = None,
    ) -> AccessPolicy:
        """The policy of a server bound to `host`, its credentials read from `env`.

        Args:
            host (`str`): the bind address.
            access (`ServerAccess`, *optional*): the flags; default: their environment variables.
            env (`Mapping`): where the tokens and identities are read.
            tls (`bool`, *optional*): whether the server serves TLS; default: whether `env` sets a certificate.

        Raises:
            `SecuritySettingsError`: settings that cannot be honoured (see `check`).
        """
        tls = bool(env.get("SPECWIRE_TLS_CERT_FILE")) if tls is None else tls
        policy = cls(
            reader_token=read_token(TOKEN_ENV, env),
            admin_token=read_token(ADMIN_TOKEN_ENV, env),
            admin_identities=_identities(ADMIN_IDENTITIES_ENV, env),
            reader_identities=_identities(READER_IDENTITIES_ENV, env),
            mutual_tls=tls and bool(env.get("SPECWIRE_TLS_CA_FILE")),
            host=host,
            access=ServerAccess.from_env(env) if access is None else access,
        )
        policy.check(tls)
        return policy

    @property
    def has_tokens(self) -> bool:
        return bool(self.reader_token or self.admin_token)

    @property
    def has_identities(self) -> bool:
        return bool(self.admin_identities or self.reader_identities)

    @property
    def anonymous(self) -> bool:
        """No credentials at all: every call is anonymous."""
        return not (self.has_tokens or self.mutual_tls)

    @property
    def refuses_anonymous_writes(self) -> bool:
        """Anonymous registry writes are refused: no credentials, bound off loopback, not allowed by flag."""
        return self.anonymous and not is_loopback(self.host) and not self.access.allow_anonymous_writes

    def check(self, tls: bool) -> None:
        """Refuse settings that would be silently ignored or would leak a token.

        Raises:
            `SecuritySettingsError`: the same token for both roles; identities without mutual TLS; tokens
                served in plaintext on a non-loopback address without `--allow-insecure-token`.
        """
        if self.admin_token is not None and self.admin_token == self.reader_token:
            raise SecuritySettingsError(
                f"{ADMIN_TOKEN_ENV} equals {TOKEN_ENV}: a token has one role; give the admin its own token"
            )
        both = self.admin_identities & self.reader_identities
        if both:
            raise SecuritySettingsError(
                f"{', '.join(sorted(both))} is in both {ADMIN_IDENTITIES_ENV} and {READER_IDENTITIES_ENV}: "
                "list each identity once (an admin may do everything a reader may)"
            )
        if self.has_identities and not self.mutual_tls:
            raise SecuritySettingsError(
                f"{ADMIN_IDENTITIES_ENV}/{READER_IDENTITIES_ENV} need mutual TLS, or no client certificate is "
                "ever seen: set SPECWIRE_TLS_CERT_FILE, SPECWIRE_TLS_KEY_FILE and SPECWIRE_TLS_CA_FILE"
            )
        if self.has_tokens and not tls and not is_loopback(self.host) and not self.access.allow_insecure_token:
            raise SecuritySettingsError(
                f"this server holds bearer tokens but would serve plaintext on {self.host}: anyone on the path "
                "could read them. Set SPECWIRE_TLS_CERT_FILE and SPECWIRE_TLS_KEY_FILE, bind 127.0.0.1, or pass "
                "--allow-insecure-token (SPECWIRE_ALLOW_INSECURE_TOKEN=true) on a network you trust"
            )

    def describe(self, serves_writes: bool) -> list[str]:
        """What the server does with credentials, one line each, for its start-up log."""
        lines = []
        credentials = [
            *(["reader token"] if self.reader_token else []),
            *(["admin token"] if self.admin_token else []),
            *([f"{len(self.admin_identities)} admin identities"] if self.admin_identities else []),
            *([f"{len(self.reader_identities)} reader identities"] if self.reader_identities else []),
        ]
        if credentials:
            lines.append("access: " + ", ".join(credentials) + (" (mutual TLS)" if self.mutual_tls else ""))
        elif self.mutual_tls:
            lines.append(
                "access: mutual TLS with no identity mapping: every client certificate the CA signed has the admin "
                f"role; set {ADMIN_IDENTITIES_ENV}/{READER_IDENTITIES_ENV} to narrow it"
            )
        else:
            lines.append("access: no credentials configured: every call is anonymous")
        if serves_writes and self.access.read_only:
            lines.append("writes refused: read-only (--read-only)")
        elif serves_writes and self.has_tokens and not (self.admin_token or self.admin_identities):
            # With tokens configured a certificate alone is no credential, so only these can write.
            lines.append(
                f"writes refused: no admin credentials ({ADMIN_TOKEN_ENV}, {ADMIN_IDENTITIES_ENV}); the reader token "
                "cannot write"
            )
        elif serves_writes and self.refuses_anonymous_writes:
            lines.append(
                f"writes refused: bound to {self.host} with no credentials; set {ADMIN_TOKEN_ENV} or pass "
                "--allow-anonymous-writes"
            )
        elif serves_writes and self.anonymous and not is_loopback(self.host):
            lines.append(f"writes open to anyone who reaches {self.host} (--allow-anonymous-writes)")
        return lines

    def _token_role(self, presented: str) -> Role | None:
        """The role of a presented token, compared in constant time with every configured token."""
        given = presented.encode()
        role = None
        for token, token_role in ((self.admin_token, Role.ADMIN), (self.reader_token, Role.READER)):
            # Both comparisons always run: the time taken says nothing about which token matched.
            if token is not None and hmac.compare_digest(given, token.encode()):
                role = role or token_role
        return role

    def _identity_role(self, identities: Sequence[str]) -> tuple[Role, str] | None:
        for role, allowed in ((Role.ADMIN, self.admin_identities), (Role.READER, self.reader_identities)):
            for identity in identities:
                if identity in allowed:
                    return role, identity
        return None

    def authenticate(
        self, method: str, needed: Role, authorization: Sequence[str], identities: Sequence[str]
    ) -> tuple[Role | None, str]:
        """The caller's role (None: anonymous) and identity (`token`, a SAN, or `anonymous`).

        Raises:
            `AccessDenied`: UNAUTHENTICATED (no or unknown credentials) or PERMISSION_DENIED (a client
                certificate mapped to no role).
        """
        name = method_name(method)
        if authorization:
            if len(authorization) > 1:
                raise AccessDenied(
                    grpc.StatusCode.UNAUTHENTICATED, "send one `authorization` metadata entry, not several"
                )
            scheme, _, presented = authorization[0].partition(" ")
            if scheme.lower() != "bearer" or not presented.strip():
                raise AccessDenied(grpc.StatusCode.UNAUTHENTICATED, "`authorization` metadata must be `Bearer <token>`")
            if not self.has_tokens:
                raise AccessDenied(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{name}: this call sent a bearer token but this server has no tokens configured, so it cannot "
                    f"check it: set {TOKEN_ENV}/{ADMIN_TOKEN_ENV} on the server, or unset the client's {TOKEN_ENV}",
                )
            role = self._token_role(presented.strip())
            if role is None:
                raise AccessDenied(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{name}: the bearer token this call sent is not one of this server's tokens: set the client's "
                    f"{TOKEN_ENV} (or token=) to the server's {TOKEN_ENV} (reader) or {ADMIN_TOKEN_ENV} (admin)",
                )
            return role, "token"
        if self.has_identities and identities:
            found = self._identity_role(identities)
            if found is None:
                env = ADMIN_IDENTITIES_ENV if needed is Role.ADMIN else READER_IDENTITIES_ENV
                raise AccessDenied(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{name} needs the {needed} role; this call's client certificate ({', '.join(identities)}) maps "
                    f"to no role: add one of its identities to the server's {env}, or send a {needed} token",
                )
            return found
        if self.has_tokens or self.has_identities:
            how = "a client certificate whose identity the server maps to a role" if self.has_identities else ""
            raise AccessDenied(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{name} needs the {needed} role and this call presented no credentials: send "
                f"`authorization: Bearer <token>` metadata (the client's token= or {TOKEN_ENV})"
                + (f", or {how}" if how else ""),
            )
        if self.mutual_tls:
            return Role.ADMIN, identities[0] if identities else "client-certificate"
        return None, ANONYMOUS

    def authorize(self, method: str, authorization: Sequence[str] = (), identities: Iterable[str] = ()) -> str:
        """Decide one call of `method` (`/package.Service/Method`); the caller's identity for `CALLER`.

        Args:
            method (`str`): the full method name.
            authorization (`Sequence[str]`): the call's `authorization` metadata values.
            identities (`Iterable[str]`): the client certificate's identities (mutual TLS), else empty.

        Returns:
            `"<role>:<who>"` (`admin:token`, `reader:spiffe://...`) or `"anonymous"`.

        Raises:
            `AccessDenied`: with UNAUTHENTICATED, PERMISSION_DENIED or FAILED_PRECONDITION and the reason.
        """
        needed = required_role(method)
        if needed is None:
            return ANONYMOUS
        name = method_name(method)
        role, who = self.authenticate(method, needed, authorization, list(identities))
        write = is_registry_write(method)
        if write and self.access.read_only:
            # FAILED_PRECONDITION, not PERMISSION_DENIED: no credential would help; this server is a read
            # replica by configuration, and the write belongs to the writable registry.
            raise AccessDenied(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{name}: this config service is read-only (--read-only / SPECWIRE_READ_ONLY): send registry "
                "writes to the writable registry",
            )
        if role is not None and not role.allows(needed):
            raise AccessDenied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{name} needs the {needed} role; this call presented a {role} "
                + ("token" if who == "token" else f"client certificate ({who})")
                + f": send the admin token (the server's {ADMIN_TOKEN_ENV}) as the client's {TOKEN_ENV} or token=",
            )
        if role is None and write and self.refuses_anonymous_writes:
            raise AccessDenied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{name} needs the admin role; this config service is bound to {self.host} with no credentials, so "
                f"anyone who reaches it could change configs: set {ADMIN_TOKEN_ENV} on the server (and send it as "
                f"the client's {TOKEN_ENV}), use mutual TLS, or start it with --allow-anonymous-writes",
            )
        return ANONYMOUS if role is None else f"{role}:{who}"
