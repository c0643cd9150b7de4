"""A bearer token never travels in plaintext off this machine unless asked: client channels refuse at
creation, servers holding tokens refuse to serve plaintext on a non-loopback address, and the target
refuses to start when its own channels (to the config and draft services) would do it. Each has its
explicit escape (`allow_insecure_token=`, `--allow-insecure-token`, SPECWIRE_ALLOW_INSECURE_TOKEN).

Where this machine has a non-loopback address, a server bound to 0.0.0.0 is also called on it, so the
allowed path is a real call over the network interface, not only a channel that was created.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from specwire.client import AsyncConfigClient, ConfigClient, TargetClient
from specwire.client.cli import main as cli_main
from specwire.security.tokens import SecuritySettingsError
from tests.servers import free_port, subprocess_server

REMOTE = "192.0.2.10:50051"  # TEST-NET-1: never reached, the refusal comes first
TOKEN = "plaintext-token"


def lan_address() -> str | None:
    """One of this machine's non-loopback IPv4 addresses (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )


def test_clients_refuse_to_send_a_token_in_plaintext_off_this_machine(monkeypatch):
    monkeypatch.delenv("SPECWIRE_TLS_CA_FILE", raising=False)
    monkeypatch.delenv("SPECWIRE_ALLOW_INSECURE_TOKEN", raising=False)
    for make in (ConfigClient, TargetClient):
        with pytest.raises(SecuritySettingsError) as info:
            make(REMOTE, token=TOKEN)
        message = str(info.value)
        assert f"refusing to send the bearer token in plaintext to {REMOTE}" in message
        assert "SPECWIRE_TLS_CA_FILE" in message and "allow_insecure_token=True" in message
        assert TOKEN not in message
        make(REMOTE, token=TOKEN, allow_insecure_token=True).close()  # asked for: created
        make(REMOTE, token="").close()  # no token: nothing to protect
        make(f"127.0.0.1:{free_port()}", token=TOKEN).close()  # loopback stays on this machine
    monkeypatch.setenv("SPECWIRE_AUTH_TOKEN", TOKEN)
    with pytest.raises(ValueError, match="refusing to send the bearer token"):
        ConfigClient("dns:///registry.example:50051")

    async def aio() -> None:
        with pytest.raises(SecuritySettingsError):
            AsyncConfigClient(REMOTE)

    asyncio.run(aio())
    monkeypatch.setenv("SPECWIRE_ALLOW_INSECURE_TOKEN", "true")
    ConfigClient(REMOTE).close()


def test_cli_refuses_with_the_fix(monkeypatch, capsys):
    monkeypatch.setenv("SPECWIRE_AUTH_TOKEN", TOKEN)
    assert cli_main(["config", "--address", REMOTE, "get", "x"]) == 2
    err = capsys.readouterr().err
    assert "refusing to send the bearer token in plaintext" in err and "--allow-insecure-token" in err


def test_server_holding_tokens_refuses_plaintext_off_loopback(tmp_path):
    port = free_port()
    args = ["specwire.config_service", "--host", "0.0.0.0", "--port", str(port), "--db", str(tmp_path / "r.db")]
    env = {"SPECWIRE_AUTH_TOKEN": TOKEN, "SPECWIRE_ADMIN_TOKEN": "plaintext-admin", "SPECWIRE_TLS_CERT_FILE": ""}
    refused = run(args, env)
    assert refused.returncode == 1, refused.stderr
    assert "config-service: this server holds bearer tokens but would serve plaintext on 0.0.0.0" in refused.stderr
    assert "--allow-insecure-token" in refused.stderr and "Traceback" not in refused.stderr
    with subprocess_server([*args, "--allow-insecure-token"], port, env=env):
        lan = lan_address()
        if lan is None:  # still served on loopback: the flag was honoured
            address, allow = f"127.0.0.1:{port}", None
        else:
            address, allow = f"{lan}:{port}", True
            with pytest.raises(SecuritySettingsError):
                ConfigClient(address, token="plaintext-admin")
        with ConfigClient(address, token="plaintext-admin", allow_insecure_token=allow) as admin:
            assert admin.create("over-the-lan", {"max_new_tokens": 2}).version == 1
        if lan is not None:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("SPECWIRE_AUTH_TOKEN", TOKEN)
                assert cli_main(["config", "--address", address, "--allow-insecure-token", "get", "over-the-lan"]) == 0
    # The same from the environment, on the draft service.
    draft_port = free_port()
    draft = ["specwire.draft_service", "--host", "0.0.0.0", "--port", str(draft_port)]
    assert "would serve plaintext on 0.0.0.0" in run(draft, env).stderr
    with subprocess_server(draft, draft_port, env={**env, "SPECWIRE_ALLOW_INSECURE_TOKEN": "true"}):
        pass


@pytest.mark.parametrize("flag", ["--config-address", "--draft-address"])
def test_target_refuses_to_send_its_token_in_plaintext_before_loading_the_model(tmp_path, flag):
    address = REMOTE if flag == "--config-address" else "dns:///draft.example.svc:50053"
    args = ["specwire.target_service", "--port", "0", "--model", str(tmp_path / "no-model-here"), flag, address]
    refused = run(args, {"SPECWIRE_AUTH_TOKEN": TOKEN})
    assert refused.returncode == 1
    assert f"target-service: {flag} {address}: refusing to send the bearer token in plaintext" in refused.stderr
    # Allowed: it goes on to load the model (which is missing here), so the refusal was the only obstacle.
    allowed = run([*args, "--allow-insecure-token"], {"SPECWIRE_AUTH_TOKEN": TOKEN})
    assert allowed.returncode != 0 and "refusing" not in allowed.stderr and "no-model-here" in allowed.stderr
