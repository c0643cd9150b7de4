"""A running server picks up a renewed certificate, key and CA from its files, without a restart.

The files are laid out and swapped as the kubelet does for a Secret volume (symlinks through
`..data`). The server runs as its own process with mutual TLS, as the chart deploys it.
"""

from __future__ import annotations

import socket
import ssl
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specwire.security.channels import secure_channel
from tests.certificates import KeyPair, MountedSecret, make_ca, make_leaf
from tests.servers import free_port, subprocess_server


def health(address: str, env: dict[str, str], timeout: float = 5) -> int:
    """SERVING (1) through a new channel with `env`'s TLS settings; raises grpc.RpcError when refused."""
    with secure_channel(address, env=env) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def peer_certificate(port: int, client: KeyPair, cafile: str) -> bytes:
    """The DER certificate the server presents to a new connection (our own handshake, ALPN h2)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile)
    context.load_cert_chain(client.cert, client.key)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with context.wrap_socket(sock, server_hostname="localhost") as tls:
            return tls.getpeercert(binary_form=True)


def der(pair: KeyPair) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pair.cert.read_text())


def client_env(cert: KeyPair, cafile) -> dict[str, str]:
    return {
        "SPECWIRE_TLS_CERT_FILE": str(cert.cert),
        "SPECWIRE_TLS_KEY_FILE": str(cert.key),
        "SPECWIRE_TLS_CA_FILE": str(cafile),
    }


def secret_files(server: KeyPair, ca: KeyPair, key_of: KeyPair | None = None) -> dict[str, bytes]:
    return {
        "tls.crt": server.cert.read_bytes(),
        "tls.key": (key_of or server).key.read_bytes(),
        "ca.crt": ca.cert.read_bytes(),
    }


def test_server_reloads_renewed_certificate_key_and_ca(tmp_path, monkeypatch):
    pki = tmp_path / "pki"
    pki.mkdir()
    ca1, ca2 = make_ca(pki, "ca1"), make_ca(pki, "ca2")
    server1, server2 = make_leaf(pki, "server1", ca1), make_leaf(pki, "server2", ca2)
    client1, client2 = make_leaf(pki, "client1", ca1), make_leaf(pki, "client2", ca2)
    both_cas = pki / "both.crt"
    both_cas.write_bytes(ca1.cert.read_bytes() + ca2.cert.read_bytes())

    secret = MountedSecret(tmp_path / "tls")
    secret.publish(secret_files(server1, ca1))
    server_env = {
        "SPECWIRE_TLS_CERT_FILE": str(secret.path("tls.crt")),
        "SPECWIRE_TLS_KEY_FILE": str(secret.path("tls.key")),
        "SPECWIRE_TLS_CA_FILE": str(secret.path("ca.crt")),
        "SPECWIRE_AUTH_TOKEN": "",
    }
    port = free_port()
    address = f"127.0.0.1:{port}"
    old_client = client_env(client1, ca1.cert)  # trusts CA 1 only, presents a CA 1 certificate
    new_client = client_env(client2, both_cas)  # trusts both, presents a CA 2 certificate
    for name, value in old_client.items():  # for the wait until the server is healthy
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SPECWIRE_AUTH_TOKEN", raising=False)
    args = ["specwire.config_service", "--port", str(port), "--db", str(tmp_path / "r.db")]
    with subprocess_server(args, port, env=server_env, timeout=60) as process:
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health(address, old_client) == serving
        assert peer_certificate(port, client1, str(both_cas)) == der(server1)
        with pytest.raises(grpc.RpcError):  # the server trusts CA 1 only: CA 2 clients are refused
            health(address, new_client, timeout=2)
        long_lived = secure_channel(address, env=old_client)
        stub = health_pb2_grpc.HealthStub(long_lived)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == serving

        # A renewal caught half written (the new certificate with the old key) is not served.
        secret.publish(secret_files(server2, ca2, key_of=server1))
        time.sleep(1.5)  # past the once-a-second check
        for _ in range(3):
            assert peer_certificate(port, client1, str(both_cas)) == der(server1)

        # The complete renewal: new certificate, new key, new CA.
        secret.publish(secret_files(server2, ca2))
        deadline = time.monotonic() + 15
        while peer_certificate(port, client2, str(both_cas)) != der(server2):
            assert time.monotonic() < deadline, "the server never presented the renewed certificate"
            time.sleep(0.2)
        assert health(address, new_client) == serving
        with pytest.raises(grpc.RpcError):  # no longer trusted: the CA was reloaded with the rest
            health(address, client_env(client1, both_cas), timeout=2)
        with pytest.raises(grpc.RpcError):  # the old client does not trust the new server certificate
            health(address, old_client, timeout=2)
        # The connection made before the renewal stays up: only new handshakes use the new files.
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == serving
        long_lived.close()
        assert process.poll() is None
    log = process.stdout.read()
    assert "were not reloaded, the old certificate stays" in log and "do not make a pair" in log, log
    assert "TLS: reloaded certificate" in log, log
