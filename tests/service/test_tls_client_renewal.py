"""The target's long-lived channel to the registry presents a renewed client certificate.

A channel reads its certificate files once; the target keeps its channels to the registry and the
draft service for its whole life (`RenewingChannel`). After a rotation to a new CA, a registry that
restarts accepts only certificates of the new CA: the target's lookups keep working only if its
channel was renewed with the new client certificate.
"""

from __future__ import annotations

import asyncio
import time

from specwire.client import ConfigClient
from specwire.target_service.config_resolver import ConfigResolver
from tests.certificates import MountedSecret, make_ca, make_leaf
from tests.servers import free_port, subprocess_server


def _files(cert, key, ca) -> dict[str, bytes]:
    return {"tls.crt": cert.read_bytes(), "tls.key": key.read_bytes(), "ca.crt": ca}


def test_the_registry_channel_is_renewed_when_the_client_certificate_changes(tmp_path, monkeypatch):
    pki = tmp_path / "pki"
    pki.mkdir()
    ca1, ca2 = make_ca(pki, "ca1"), make_ca(pki, "ca2")
    server1, server2 = make_leaf(pki, "server1", ca1), make_leaf(pki, "server2", ca2)
    client1, client2 = make_leaf(pki, "client1", ca1), make_leaf(pki, "client2", ca2)
    both = ca1.cert.read_bytes() + ca2.cert.read_bytes()

    server_secret, client_secret = MountedSecret(tmp_path / "server"), MountedSecret(tmp_path / "client")
    server_secret.publish(_files(server1.cert, server1.key, ca1.cert.read_bytes()))
    client_secret.publish(_files(client1.cert, client1.key, both))  # trusts both servers
    server_env = {
        f"SPECWIRE_TLS_{kind}_FILE": str(server_secret.path(name))
        for kind, name in (("CERT", "tls.crt"), ("KEY", "tls.key"), ("CA", "ca.crt"))
    }
    for kind, name in (("CERT", "tls.crt"), ("KEY", "tls.key"), ("CA", "ca.crt")):
        monkeypatch.setenv(f"SPECWIRE_TLS_{kind}_FILE", str(client_secret.path(name)))
    monkeypatch.delenv("SPECWIRE_AUTH_TOKEN", raising=False)
    port = free_port()
    address = f"127.0.0.1:{port}"
    args = ["specwire.config_service", "--port", str(port), "--db", str(tmp_path / "r.db")]

    loop = asyncio.new_event_loop()
    # stale_max_s=0: a lookup the registry refuses fails instead of being served from the cache.
    resolver = ConfigResolver(address, ttl_s=0.0, stale_max_s=0.0)
    try:
        with subprocess_server(args, port, env=server_env, timeout=60):
            with ConfigClient(address) as registry:
                registry.create("chat", {"max_new_tokens": 4})
            assert loop.run_until_complete(resolver.resolve("chat")).version == 1
        # The rotation: the registry trusts CA 2 only from now on and restarts, so the target's channel
        # must connect again; the target's files get a CA 2 client certificate.
        server_secret.publish(_files(server2.cert, server2.key, ca2.cert.read_bytes()))
        client_secret.publish(_files(client2.cert, client2.key, both))
        time.sleep(1.2)  # past the once-a-second look at the files
        with subprocess_server(args, port, env=server_env, timeout=60):
            assert loop.run_until_complete(resolver.resolve("chat")).version == 1
        assert resolver._channel.renewals == 1
    finally:
        loop.run_until_complete(resolver.close())
        loop.close()
