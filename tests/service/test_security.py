"""TLS and the bearer tokens, configured by the environment variables the Helm chart sets (the roles
themselves: tests/service/test_roles.py)."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specwire.client import ConfigClient, SpecwireRpcError
from specwire.security.channels import secure_channel
from tests.servers import free_port, subprocess_server


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(folder / "tls.key"),
            "-out",
            str(folder / "tls.crt"),
        ],
        check=True,
        capture_output=True,
    )
    return folder


def test_tls_and_bearer_token(tmp_path, tls_files, monkeypatch):
    server_env = {
        "SPECWIRE_TLS_CERT_FILE": str(tls_files / "tls.crt"),
        "SPECWIRE_TLS_KEY_FILE": str(tls_files / "tls.key"),
        "SPECWIRE_AUTH_TOKEN": "s3cret",
        "SPECWIRE_ADMIN_TOKEN": "adm1n",
        "SPECWIRE_TLS_CA_FILE": "",  # no CA on the server: clients need no certificate of their own
    }
    # This process is the client: it trusts the self-signed certificate and sends the token.
    monkeypatch.setenv("SPECWIRE_TLS_CA_FILE", str(tls_files / "tls.crt"))
    monkeypatch.setenv("SPECWIRE_AUTH_TOKEN", "s3cret")
    port = free_port()
    address = f"127.0.0.1:{port}"
    # Bound to every address: tokens over TLS need no --allow-insecure-token.
    args = ["specwire.config_service", "--host", "0.0.0.0", "--port", str(port), "--db", str(tmp_path / "r.db")]
    with subprocess_server(args, port, env=server_env):
        with ConfigClient(address, token="adm1n") as client:
            assert client.create("secure", {"max_new_tokens": 3}).version == 1
        with ConfigClient(address) as client:  # the reader token, from SPECWIRE_AUTH_TOKEN
            assert client.get("secure").version == 1
        monkeypatch.setenv("SPECWIRE_AUTH_TOKEN", "wrong")
        with ConfigClient(address) as client:
            with pytest.raises(SpecwireRpcError) as info:
                client.get("secure")
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        monkeypatch.delenv("SPECWIRE_AUTH_TOKEN")
        with ConfigClient(address) as client:
            with pytest.raises(SpecwireRpcError) as info:
                client.list()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health checks need no token (kubelet probes carry none).
        with secure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        # Plaintext against the TLS port fails.
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
