"""TLS credentials of servers and client channels, from `SPECWIRE_TLS_*` files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import grpc


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
