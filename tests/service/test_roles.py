"""Roles on real servers: the reader token reads and generates, the admin token also writes the registry;
tokens from files; `--read-only`; anonymous writes off loopback; who the handler sees as its caller.

The servers read their tokens from the environment when they start (as a pod does from its Secret);
the target also sends SPECWIRE_AUTH_TOKEN to the config and draft services, like in the chart. The test's
own clients always pass `token=` explicitly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import grpc
import pytest

from specwire.client import ConfigClient, SpecwireRpcError, TargetClient
from specwire.client.cli import main as cli_main
from specwire.config.v1 import config_service_pb2 as cpb
from specwire.config.v1 import config_service_pb2_grpc as cpb_grpc
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.models import load_model
from specwire.security.access import ServerAccess
from specwire.security.channels import secure_channel
from specwire.target.v1 import target_service_pb2 as tpb
from specwire.target.v1 import target_service_pb2_grpc as tpb_grpc
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy
from tests.servers import ThreadedServer, free_port, subprocess_server, threaded_server
from tests.service.caller_echo import callers, echo_server

READER, ADMIN = "reader-token-1", "admin-token-2"
GREEDY = {"max_new_tokens": 4, "do_sample": False}
# The shared config names its draft length: left to the adaptive controller, a tiny random model's
# drafts may not pay and the controller would rightly stop drafting.
SHARED = {**GREEDY, "num_assistant_tokens": 3, "num_assistant_tokens_schedule": "constant"}
WRITES = ("create", "update", "set_tag", "delete", "import_json")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, loaded):
    """Config, draft and target services with a reader and an admin token; the target drafts through
    the draft service and resolves configs in the registry with the reader token.

    The tokens are in the environment only while the servers start and the target opens its channels
    (one warm-up generation), so that the module's other tests start from a clean environment.
    """
    db = tmp_path_factory.mktemp("roles") / "r.db"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPECWIRE_AUTH_TOKEN", READER)
        env.setenv("SPECWIRE_ADMIN_TOKEN", ADMIN)
        config = ThreadedServer(lambda: build_config_server(str(db)))
        draft = ThreadedServer(lambda: build_draft_server(loaded))
        policy = DraftPolicy(draft.address, round_timeout_s=30.0)
        target = ThreadedServer(lambda: build_target_server(loaded, config.address, drafting=policy))
        with ConfigClient(config.address, token=ADMIN) as admin:
            admin.create("shared", SHARED)
        with TargetClient(target.address, token=READER) as client:
            client.generate([[5, 6, 7, 5, 6]], generation_config="shared", proposer="draft_model")
    try:
        yield config.address, target.address
    finally:
        for server in (target, draft, config):
            server.stop()


def write(client: ConfigClient, what: str, name: str):
    """One registry write of each kind."""
    if what == "create":
        return client.create(name, GREEDY)
    if what == "update":
        return client.update(name, {**GREEDY, "max_new_tokens": 5})
    if what == "set_tag":
        return client.set_tag(name, "prod", 1)
    if what == "delete":
        return client.delete(name)
    return client.import_json('{"max_new_tokens": 6}', name)


def expect(code: grpc.StatusCode, fn, *args, **kwargs) -> str:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value.message
    return info.value.message


def test_reader_reads_and_generates_through_the_registry_and_the_draft_service(stack):
    config, target = stack
    with ConfigClient(config, token=READER) as reader:
        assert reader.get("shared").version == 1
        assert "shared" in [r.name for r in reader.list()]
        assert reader.validate(GREEDY).valid
        assert '"max_new_tokens": 4' in reader.export("shared")
    with TargetClient(target, token=READER) as client:
        assert client.model_info().vocab_size > 0
        # The target resolves `shared` in the registry and drafts with the draft service, sending its
        # own SPECWIRE_AUTH_TOKEN (the reader token) to both.
        out = client.generate([[5, 6, 7, 8, 5, 6, 7]], generation_config="shared", proposer="draft_model")
        assert out.sequences.shape[1] == 7 + 4
        assert out.speculation.drafted_tokens > 0 and not out.speculation.fallback_reason


@pytest.mark.parametrize("what", WRITES)
def test_reader_token_cannot_write_and_is_told_the_admin_role(stack, what):
    config, _ = stack
    with ConfigClient(config, token=READER) as reader:
        message = expect(grpc.StatusCode.PERMISSION_DENIED, write, reader, what, "shared")
    method = {"create": "CreateConfig", "update": "UpdateConfig", "set_tag": "SetTag"}.get(what, "")
    assert "needs the admin role; this call presented a reader token" in message
    assert message.startswith(method or ("DeleteConfig" if what == "delete" else "ImportConfig"))
    assert READER not in message and ADMIN not in message
    with ConfigClient(config, token=ADMIN) as admin:  # nothing was written
        record = admin.get("shared")
        assert (record.version, record.tags) == (1, [])


def test_admin_token_does_everything(stack):
    config, target = stack
    with ConfigClient(config, token=ADMIN) as admin:
        for what in WRITES:
            write(admin, what, "admin-made" if what != "import_json" else "imported")
        assert admin.get("imported").config.max_new_tokens == 6
        assert admin.validate(GREEDY).valid
    with TargetClient(target, token=ADMIN) as client:  # admin implies reader
        assert client.generate([[5, 6, 7]], generation_config="imported").sequences.shape[1] == 3 + 6


def test_the_registry_records_the_role_that_wrote_each_version(stack):
    """The authorization's caller reaches the registry's records: the admin token's writes are
    `admin:token`, and the history shows them to a reader."""
    config, _ = stack
    with ConfigClient(config, token=ADMIN) as admin:
        admin.create("authored", GREEDY)
        admin.set_tag("authored", "prod", 1)
    with ConfigClient(config, token=READER) as reader:
        assert reader.get("authored").author == "admin:token"
        history = reader.history("authored")
    assert [(entry.kind, entry.author) for entry in history.entries] == [
        ("tag", "admin:token"),
        ("version", "admin:token"),
    ]


@pytest.mark.parametrize("token", ["", "not-a-token"])
def test_no_token_or_an_unknown_one_is_unauthenticated_and_health_stays_open(stack, token):
    config, target = stack
    with ConfigClient(config, token=token) as client:
        message = expect(grpc.StatusCode.UNAUTHENTICATED, client.get, "shared")
        assert ("presented no credentials" if not token else "not one of this server's tokens") in message
        expect(grpc.StatusCode.UNAUTHENTICATED, client.create, "x", GREEDY)
    with TargetClient(target, token=token) as client:
        expect(grpc.StatusCode.UNAUTHENTICATED, client.generate, [[5, 6]], max_new_tokens=2)
        expect(grpc.StatusCode.UNAUTHENTICATED, lambda: list(client.stream([[5, 6]], max_new_tokens=2)))
    from specwire.client.health import wait_healthy

    wait_healthy(config, timeout=5)  # no token: the probe path is open


def test_cli_says_which_token_to_set(stack, monkeypatch, capsys):
    config, _ = stack
    monkeypatch.setenv("SPECWIRE_AUTH_TOKEN", READER)
    assert cli_main(["config", "--address", config, "tag", "shared", "prod", "1"]) == 1
    err = capsys.readouterr().err
    assert "PERMISSION_DENIED: SetTag needs the admin role" in err and "SPECWIRE_AUTH_TOKEN" in err
    monkeypatch.setenv("SPECWIRE_AUTH_TOKEN", ADMIN)
    assert cli_main(["config", "--address", config, "tag", "shared", "cli", "1"]) == 0
    monkeypatch.delenv("SPECWIRE_AUTH_TOKEN")
    assert cli_main(["config", "--address", config, "get", "shared"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_tokens_from_files(tmp_path):
    (tmp_path / "reader").write_text(READER + "\n")  # a mounted Secret's trailing newline is not the token
    (tmp_path / "admin").write_text(ADMIN + "\n")
    env = {
        "SPECWIRE_AUTH_TOKEN": "",
        "SPECWIRE_AUTH_TOKEN_FILE": str(tmp_path / "reader"),
        "SPECWIRE_ADMIN_TOKEN_FILE": str(tmp_path / "admin"),
    }
    port = free_port()
    args = ["specwire.config_service", "--port", str(port), "--db", str(tmp_path / "r.db")]
    with subprocess_server(args, port, env=env):
        with ConfigClient(f"127.0.0.1:{port}", token=ADMIN) as admin:
            admin.create("filed", GREEDY)
        with ConfigClient(f"127.0.0.1:{port}", token=READER) as reader:
            assert reader.get("filed").version == 1
            expect(grpc.StatusCode.PERMISSION_DENIED, reader.delete, "filed")
    # Both the variable and its file: refused at start with the fix, no traceback.
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        env={**os.environ, **env, "SPECWIRE_AUTH_TOKEN": READER},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "set SPECWIRE_AUTH_TOKEN or SPECWIRE_AUTH_TOKEN_FILE, not both" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_read_only_registry_serves_reads_and_refuses_writes(tmp_path):
    db = str(tmp_path / "r.db")
    with threaded_server(lambda: build_config_server(db)) as writable:
        with ConfigClient(writable.address) as client:
            client.create("kept", GREEDY)
    with threaded_server(lambda: build_config_server(db, access=ServerAccess(read_only=True))) as replica:
        with ConfigClient(replica.address) as client:
            assert client.get("kept").version == 1 and client.export("kept")
            for what in WRITES:
                message = expect(grpc.StatusCode.FAILED_PRECONDITION, write, client, what, "kept")
                assert "this config service is read-only" in message
            assert client.get("kept").version == 1


def test_read_only_from_the_environment_flag(tmp_path):
    port = free_port()
    args = ["specwire.config_service", "--port", str(port), "--db", str(tmp_path / "r.db")]
    with subprocess_server(args, port, env={"SPECWIRE_READ_ONLY": "true"}):
        with ConfigClient(f"127.0.0.1:{port}") as client:
            expect(grpc.StatusCode.FAILED_PRECONDITION, client.create, "x", GREEDY)
            assert client.list() == []
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        env={**os.environ, "SPECWIRE_READ_ONLY": "sometimes"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "SPECWIRE_READ_ONLY='sometimes': expected true or false" in proc.stderr


def test_anonymous_writes_are_refused_off_loopback_unless_allowed(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="specwire.serving")
    with threaded_server(lambda: build_config_server(str(tmp_path / "a.db"), host="0.0.0.0")) as server:
        assert "writes refused: bound to 0.0.0.0 with no credentials; set SPECWIRE_ADMIN_TOKEN" in caplog.text
        with ConfigClient(server.address) as client:  # connects on 127.0.0.1; the server binds every address
            message = expect(grpc.StatusCode.PERMISSION_DENIED, client.create, "x", GREEDY)
            assert "bound to 0.0.0.0 with no credentials" in message and "--allow-anonymous-writes" in message
            assert client.list() == [] and client.validate(GREEDY).valid
    allow = ServerAccess(allow_anonymous_writes=True)
    with threaded_server(lambda: build_config_server(str(tmp_path / "b.db"), host="0.0.0.0", access=allow)) as server:
        with ConfigClient(server.address) as client:
            assert client.create("x", GREEDY).version == 1
    with threaded_server(lambda: build_config_server(str(tmp_path / "c.db"))) as server:  # loopback: as before
        with ConfigClient(server.address) as client:
            assert client.create("x", GREEDY).version == 1


# --- who the handler sees as its caller ---------------------------------------------------------------


def test_handlers_see_who_called(monkeypatch):
    with threaded_server(echo_server) as server:  # no credentials configured, loopback
        assert callers(server.address, token="") == ("anonymous", "anonymous", ["anonymous"] * 3)
    monkeypatch.setenv("SPECWIRE_AUTH_TOKEN", READER)
    monkeypatch.setenv("SPECWIRE_ADMIN_TOKEN", ADMIN)
    with threaded_server(echo_server) as server:
        read, made, stream = callers(server.address, token=ADMIN)
        assert (read, made, stream) == ("admin:token", "admin:token", ["admin:token"] * 3)
        with secure_channel(server.address, token=READER) as channel:
            stub = tpb_grpc.TargetServiceStub(channel)
            texts = [m.delta.rows[0].text for m in stub.GenerateStream(tpb.GenerateStreamRequest(), timeout=5)]
            assert texts == ["reader:token"] * 3
            with pytest.raises(grpc.RpcError) as info:
                cpb_grpc.ConfigServiceStub(channel).CreateConfig(cpb.CreateConfigRequest(name="x"), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

        async def aio_stream() -> list[str]:  # grpc.aio channels send the token on streams too
            async with secure_channel(server.address, aio=True, token=READER) as channel:
                stream = tpb_grpc.TargetServiceStub(channel).GenerateStream(tpb.GenerateStreamRequest(), timeout=5)
                return [m.delta.rows[0].text async for m in stream]

        assert asyncio.run(aio_stream()) == ["reader:token"] * 3
