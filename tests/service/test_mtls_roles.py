"""Mutual TLS identities as roles, on real servers: a client certificate's SAN (a SPIFFE URI, a DNS name)
maps to the admin or the reader role through SPECWIRE_ADMIN_IDENTITIES / SPECWIRE_READER_IDENTITIES; a
token, when sent, decides instead; without any mapping a certificate the CA signed is an admin.

Throwaway certificates are made with the openssl command line: a CA, the server's certificate for
127.0.0.1, and client certificates with the SANs below.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from specwire.client import ConfigClient, SpecwireRpcError
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.security.channels import secure_channel
from tests.servers import ThreadedServer
from tests.service.caller_echo import callers, echo_server

DEPLOYER = "spiffe://specwire.test/ns/ops/sa/deployer"
TARGET = "target.specwire.svc"
STRANGER = "stranger.example"
ADMIN_TOKEN, READER_TOKEN = "mtls-admin-token", "mtls-reader-token"
GREEDY = {"max_new_tokens": 3, "do_sample": False}


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost, and client certificates `deployer`, `target`
    and `stranger` (URI, DNS and DNS SANs), each `<name>.crt` + `<name>.key`."""
    folder = tmp_path_factory.mktemp("pki")
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=specwire-test-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", str(folder / "ca.key"), "-out", str(folder / "ca.crt"),
    )  # fmt: skip
    sans = {
        "server": "DNS:localhost,IP:127.0.0.1",
        "deployer": f"URI:{DEPLOYER}",
        "target": f"DNS:{TARGET}",
        "stranger": f"DNS:{STRANGER}",
    }
    for name, san in sans.items():
        key, csr, ext = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.ext"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
        ext.write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n")
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(folder / "ca.crt"), "-CAkey", str(folder / "ca.key"),
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(folder / f"{name}.crt"),
        )  # fmt: skip
    return folder


def server_env(pki: Path, **extra: str) -> dict[str, str]:
    """A mutual-TLS server's settings (its certificate, and the CA it checks clients against)."""
    return {
        "SPECWIRE_TLS_CERT_FILE": str(pki / "server.crt"),
        "SPECWIRE_TLS_KEY_FILE": str(pki / "server.key"),
        "SPECWIRE_TLS_CA_FILE": str(pki / "ca.crt"),
        **extra,
    }


def client_env(pki: Path, who: str, token: str = "") -> dict[str, str]:
    """A client presenting `who`'s certificate (and `token` when given)."""
    return {
        "SPECWIRE_TLS_CA_FILE": str(pki / "ca.crt"),
        "SPECWIRE_TLS_CERT_FILE": str(pki / f"{who}.crt"),
        "SPECWIRE_TLS_KEY_FILE": str(pki / f"{who}.key"),
        "SPECWIRE_AUTH_TOKEN": token,
    }


def start(monkeypatch, build, env: dict[str, str], servers: list) -> ThreadedServer:
    """A server started with `env` (read at start; the test's environment is put back after)."""
    with monkeypatch.context() as patch:
        for key in ("SPECWIRE_AUTH_TOKEN", "SPECWIRE_ADMIN_TOKEN"):
            patch.delenv(key, raising=False)
        for key, value in env.items():
            patch.setenv(key, value)
        server = ThreadedServer(build)
    servers.append(server)
    return server


@pytest.fixture
def servers():
    started: list[ThreadedServer] = []
    yield started
    for server in started:
        server.stop()


def registry(address: str, env: dict[str, str]) -> ConfigClient:
    return ConfigClient(address, channel=secure_channel(address, env=env))


def expect(code: grpc.StatusCode, fn, *args) -> str:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args)
    assert info.value.code() == code, info.value.message
    return info.value.message


def test_certificate_identities_map_to_roles(pki, tmp_path, monkeypatch, servers):
    identities = {"SPECWIRE_ADMIN_IDENTITIES": f"{DEPLOYER}, ops.example", "SPECWIRE_READER_IDENTITIES": TARGET}
    build = lambda: build_config_server(str(tmp_path / "r.db"), host="0.0.0.0")  # noqa: E731
    server = start(monkeypatch, build, server_env(pki, **identities), servers)
    with registry(server.address, client_env(pki, "deployer")) as deployer:
        assert deployer.create("mtls", GREEDY).version == 1
        assert deployer.set_tag("mtls", "prod", 1).tags == ["prod"]
    with registry(server.address, client_env(pki, "target")) as target:
        assert target.get("mtls:prod").version == 1
        message = expect(grpc.StatusCode.PERMISSION_DENIED, target.create, "other", GREEDY)
        assert "CreateConfig needs the admin role; this call presented a reader client certificate" in message
        assert TARGET in message
    with registry(server.address, client_env(pki, "stranger")) as stranger:
        message = expect(grpc.StatusCode.PERMISSION_DENIED, stranger.get, "mtls")
        assert f"client certificate ({STRANGER}) maps to no role" in message
        assert "SPECWIRE_READER_IDENTITIES" in message


def test_a_token_decides_over_the_certificate(pki, tmp_path, monkeypatch, servers):
    env = server_env(
        pki,
        SPECWIRE_ADMIN_IDENTITIES=DEPLOYER,
        SPECWIRE_READER_IDENTITIES=TARGET,
        SPECWIRE_AUTH_TOKEN=READER_TOKEN,
        SPECWIRE_ADMIN_TOKEN=ADMIN_TOKEN,
    )
    server = start(monkeypatch, lambda: build_config_server(str(tmp_path / "r.db")), env, servers)
    with registry(server.address, client_env(pki, "target", ADMIN_TOKEN)) as admin_by_token:
        assert admin_by_token.create("by-token", GREEDY).version == 1
    with registry(server.address, client_env(pki, "deployer", READER_TOKEN)) as reader_by_token:
        assert "reader token" in expect(grpc.StatusCode.PERMISSION_DENIED, reader_by_token.delete, "by-token")
    with registry(server.address, client_env(pki, "deployer", "forged")) as forged:
        expect(grpc.StatusCode.UNAUTHENTICATED, forged.get, "by-token")
    with registry(server.address, client_env(pki, "deployer")) as deployer:  # no token: the certificate
        assert deployer.delete("by-token") == 1


def test_handlers_see_the_certificate_identity(pki, monkeypatch, servers):
    identities = {"SPECWIRE_ADMIN_IDENTITIES": DEPLOYER, "SPECWIRE_READER_IDENTITIES": TARGET}
    mapped = start(monkeypatch, echo_server, server_env(pki, **identities), servers)
    admin = f"admin:{DEPLOYER}"
    assert callers(mapped.address, env=client_env(pki, "deployer")) == (admin, admin, [admin] * 3)
    reader = f"reader:{TARGET}"
    assert callers(mapped.address, env=client_env(pki, "target"), write=False) == (reader, None, [reader] * 3)
    # Mutual TLS with no identity mapping and no tokens: the CA is the credential, as before roles.
    unmapped = start(monkeypatch, echo_server, server_env(pki), servers)
    stranger = f"admin:{STRANGER}"
    assert callers(unmapped.address, env=client_env(pki, "stranger")) == (stranger, stranger, [stranger] * 3)
