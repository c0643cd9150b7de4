"""TLS settings that are only half there refuse to start with the fix, never serve plaintext."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from specwire.config_service.__main__ import build_server
from specwire.security.channels import secure_channel
from specwire.security.tls import TlsSettingsError, channel_credentials
from tests.certificates import make_ca, make_leaf
from tests.servers import ThreadedServer

REPO_ROOT = Path(__file__).resolve().parents[2]
TLS_VARIABLES = ("SPECWIRE_TLS_CERT_FILE", "SPECWIRE_TLS_KEY_FILE", "SPECWIRE_TLS_CA_FILE")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca = make_ca(folder, "ca")
    server = make_leaf(folder, "server", ca)
    other = make_leaf(folder, "other", ca)
    garbage = folder / "garbage.pem"
    garbage.write_text("not a certificate\n")
    return {
        "ca": str(ca.cert),
        "cert": str(server.cert),
        "key": str(server.key),
        "other_key": str(other.key),
        "garbage": str(garbage),
        "missing": str(folder / "missing.pem"),
    }


def settings(pki, cert=None, key=None, ca=None) -> dict[str, str]:
    """The three variables, each a file of `pki` or "" (unset)."""
    return {
        "SPECWIRE_TLS_CERT_FILE": pki[cert] if cert else "",
        "SPECWIRE_TLS_KEY_FILE": pki[key] if key else "",
        "SPECWIRE_TLS_CA_FILE": pki[ca] if ca else "",
    }


HALF_SET = [
    pytest.param(
        {"ca": "ca"}, "would listen in plaintext", "SPECWIRE_TLS_CERT_FILE and SPECWIRE_TLS_KEY_FILE", id="ca-only"
    ),
    pytest.param({"cert": "cert"}, "SPECWIRE_TLS_KEY_FILE is not", "set SPECWIRE_TLS_KEY_FILE", id="cert-only"),
    pytest.param({"key": "key"}, "SPECWIRE_TLS_CERT_FILE is not", "set SPECWIRE_TLS_CERT_FILE", id="key-only"),
    pytest.param(
        {"cert": "cert", "ca": "ca"}, "SPECWIRE_TLS_KEY_FILE is not", "set SPECWIRE_TLS_KEY_FILE", id="cert-ca"
    ),
    pytest.param(
        {"key": "key", "ca": "ca"}, "SPECWIRE_TLS_CERT_FILE is not", "set SPECWIRE_TLS_CERT_FILE", id="key-ca"
    ),
    pytest.param({"cert": "cert", "key": "missing"}, "cannot be read", "is the Secret mounted", id="missing-key"),
    pytest.param({"cert": "garbage", "key": "key"}, "do not make a pair", "PEM certificate", id="garbage-cert"),
    pytest.param({"cert": "cert", "key": "other_key"}, "do not make a pair", "its unencrypted PEM", id="wrong-key"),
    pytest.param({"cert": "cert", "key": "key", "ca": "garbage"}, "no usable CA", "SPECWIRE_TLS_CA_FILE", id="bad-ca"),
]


async def start_and_stop(db: str) -> None:
    server = build_server(db)
    await server.start()
    await server.stop(0)


@pytest.mark.parametrize(("chosen", "says", "fix"), HALF_SET)
def test_a_real_server_refuses_half_set_tls(pki, monkeypatch, tmp_path, chosen, says, fix):
    """GrpcServer.start() raises before binding: nothing ever listens in plaintext."""
    for name, value in settings(pki, **chosen).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TlsSettingsError) as info:
        asyncio.run(start_and_stop(str(tmp_path / "r.db")))
    message = str(info.value)
    assert says in message, message
    assert "\n  fix: " in message and fix in message.partition("fix:")[2], message


def test_the_complete_sets_start(pki, monkeypatch, tmp_path):
    """Control for the refusals above: certificate + key, with or without the CA, serve TLS."""
    for chosen in ({"cert": "cert", "key": "key"}, {"cert": "cert", "key": "key", "ca": "ca"}):
        for name, value in settings(pki, **chosen).items():
            monkeypatch.setenv(name, value)
        server = ThreadedServer(lambda: build_server(str(tmp_path / "r.db")))
        try:
            # Plaintext is refused: the port speaks TLS only.
            with grpc.insecure_channel(server.address) as channel:
                with pytest.raises(grpc.FutureTimeoutError):
                    grpc.channel_ready_future(channel).result(timeout=2)
        finally:
            server.stop()


@pytest.mark.parametrize(
    ("module", "extra"),
    [
        ("specwire.config_service", []),
        ("specwire.draft_service", []),
        # The check runs before the model loads: a model that does not exist is never looked up.
        ("specwire.target_service", ["--model", "no/such-model-here"]),
    ],
)
def test_every_service_exits_with_the_reason_and_the_fix(pki, tmp_path, module, extra):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "SPECWIRE_HOME": str(tmp_path),
        **settings(pki, ca="ca"),
    }
    done = subprocess.run(
        [sys.executable, "-m", module, "--port", "0", *extra],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    service = module.rpartition(".")[2].replace("_", "-")
    assert done.returncode == 1, done.stderr
    assert f"{service}: TLS settings refused: SPECWIRE_TLS_CA_FILE is set" in done.stderr, done.stderr
    assert "fix:" in done.stderr and "Traceback" not in done.stderr
    assert "cannot load model" not in done.stderr


@pytest.mark.parametrize(
    ("chosen", "says"),
    [({"cert": "cert"}, "SPECWIRE_TLS_KEY_FILE is not"), ({"key": "key", "ca": "ca"}, "SPECWIRE_TLS_CERT_FILE is not")],
)
def test_a_client_refuses_a_certificate_without_its_key(pki, chosen, says):
    with pytest.raises(TlsSettingsError, match=says):
        channel_credentials(settings(pki, **chosen))
    with pytest.raises(TlsSettingsError, match=says):
        secure_channel("127.0.0.1:1", env=settings(pki, **chosen))


def test_a_client_with_a_ca_only_verifies_the_server(pki):
    """A CA alone is a complete client setting (server verification, no client certificate)."""
    assert isinstance(channel_credentials(settings(pki, ca="ca")), grpc.ChannelCredentials)
    assert channel_credentials(settings(pki)) is None
