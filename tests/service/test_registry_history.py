"""Immutable references and history on a real registry server: a delete leaves tombstones, version
numbers are never reused, every version and tag move records who and when, `ListConfigHistory` and
`specwire config history` show it, and a database of schema 1 migrates with its data intact."""

from __future__ import annotations

import json
import sqlite3
import time

import grpc
import pytest

from specwire.client import ConfigClient, SpecwireRpcError
from specwire.client.cli import main as cli_main
from specwire.config.v1 import config_service_pb2 as pb
from specwire.config_service.__main__ import build_server
from specwire.config_service.storage import MIGRATIONS, SCHEMA_VERSION, SQLiteStore
from specwire.security.identity import CALLER
from tests.servers import threaded_server


def expect_code(code: grpc.StatusCode, fn, *args, **kwargs) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value
    return info.value


class _CallerFromMetadata(grpc.aio.ServerInterceptor):
    """Stands in for the server's authorization: the caller named in `x-test-caller` metadata."""

    async def intercept_service(self, continuation, details):
        metadata = dict(details.invocation_metadata or ())
        if "x-test-caller" in metadata:
            CALLER.set(metadata["x-test-caller"])
        return await continuation(details)


@pytest.fixture
def registry_server(registry_db):
    def build():
        server = build_server(registry_db)
        server.interceptors = [_CallerFromMetadata(), *server.interceptors]
        return server

    with threaded_server(build) as server:
        yield server


@pytest.fixture
def registry(registry_server):
    with ConfigClient(registry_server.address) as client:
        yield client


def test_a_deleted_name_keeps_its_numbers(registry):
    registry.create("chat", {"max_new_tokens": 1})
    registry.update("chat", {"max_new_tokens": 2})
    registry.set_tag("chat", "prod", 2)
    assert registry.delete("chat") == 2

    err = expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "chat@2")
    assert "deleted" in err.message and "anonymous" in err.message and "version 2" in err.message
    assert "deleted" in expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "chat").message
    assert "deleted" in expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "chat:latest").message
    assert "deleted" in expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "chat:prod").message
    assert "deleted" in expect_code(grpc.StatusCode.NOT_FOUND, registry.export, "chat@1").message
    err = expect_code(grpc.StatusCode.NOT_FOUND, registry.update, "chat", {"max_new_tokens": 3})
    assert "deleted" in err.message and "continue at 3" in err.message
    assert "deleted" in expect_code(grpc.StatusCode.NOT_FOUND, registry.set_tag, "chat", "prod", 1).message
    assert "deleted" in expect_code(grpc.StatusCode.NOT_FOUND, registry.delete, "chat").message
    assert registry.list() == []  # tombstones are not listed

    # Created again: numbering continues, and the old references stay what they were (gone), never
    # the new config.
    again = registry.create("chat", {"max_new_tokens": 30})
    assert (again.version, again.latest_version) == (3, 3)
    assert registry.get("chat").config.max_new_tokens == 30
    assert "deleted" in expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "chat@1").message
    expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "chat:prod")  # a delete removes the tags
    assert "deleted" in expect_code(grpc.StatusCode.NOT_FOUND, registry.set_tag, "chat", "prod", 2).message
    assert registry.update("chat", {"max_new_tokens": 40}).version == 4
    assert [(r.name, r.version) for r in registry.list()] == [("chat", 4)]
    expect_code(grpc.StatusCode.ALREADY_EXISTS, registry.create, "chat", {})


def test_import_onto_a_deleted_name_continues_its_numbering(registry):
    registry.import_json(json.dumps({"max_new_tokens": 5}), "hub-like")
    registry.import_json(json.dumps({"max_new_tokens": 6}), "hub-like")
    registry.delete("hub-like")
    record = registry.import_json(json.dumps({"max_new_tokens": 7}), "hub-like")
    assert record.version == 3 and registry.get("hub-like").config.max_new_tokens == 7


def test_history_lists_versions_tag_moves_and_tombstones_newest_first(registry):
    registry.create("chat", {"max_new_tokens": 1})
    registry.update("chat", {"max_new_tokens": 2})
    registry.set_tag("chat", "prod", 1)
    registry.set_tag("chat", "prod", 2)  # moved: the previous value is kept
    registry.set_tag("chat", "prod", 2)  # no move: no entry
    registry.delete("chat")
    registry.create("chat", {"max_new_tokens": 3})

    history = registry.history("chat")
    assert [(e.kind, e.version, e.tag, e.old_version, e.new_version) for e in history.entries] == [
        ("version", 3, "", None, None),
        ("tag", None, "prod", 2, None),  # removed by the delete
        ("tag", None, "prod", 1, 2),
        ("tag", None, "prod", None, 1),
        ("version", 2, "", None, None),
        ("version", 1, "", None, None),
    ]
    assert [(v.version, v.deleted) for v in history.versions] == [(3, False), (2, True), (1, True)]
    assert all(e.author == "anonymous" for e in history.entries)
    deleted = history.versions[1]
    assert deleted.deleted_by == "anonymous" and deleted.deleted_at >= deleted.time
    assert abs(history.versions[0].time - time.time()) < 60
    times = [e.time for e in history.entries]
    assert times == sorted(times, reverse=True)

    # Pages of two give the same entries, each once.
    entries, token = registry.history_page("chat", page_size=2)
    while token:
        page, token = registry.history_page("chat", page_size=2, page_token=token)
        assert len(page) <= 2
        entries += page
    assert entries == history.entries

    expect_code(grpc.StatusCode.NOT_FOUND, registry.history, "never-stored")
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.history, "bad name!")
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.history_page, "chat", page_size=-1)
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.history_page, "chat", page_token="bm90LWpzb24=")


def test_delete_tag_removes_a_tag_and_keeps_the_removal(registry):
    registry.create("chat", {"max_new_tokens": 1})
    registry.set_tag("chat", "prod", 1)
    assert registry.delete_tag("chat", "prod") == 1
    err = expect_code(grpc.StatusCode.NOT_FOUND, registry.get, "chat:prod")
    assert "no tag 'prod'" in err.message
    assert registry.get("chat@1").tags == []
    moves = registry.history("chat").tag_moves
    assert [(m.tag, m.old_version, m.new_version) for m in moves] == [("prod", 1, None), ("prod", None, 1)]
    expect_code(grpc.StatusCode.NOT_FOUND, registry.delete_tag, "chat", "prod")
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, registry.delete_tag, "chat", "latest")
    expect_code(grpc.StatusCode.NOT_FOUND, registry.delete_tag, "ghost", "prod")
    registry.set_tag("chat", "prod", 1)
    registry.delete("chat")
    assert "deleted" in expect_code(grpc.StatusCode.NOT_FOUND, registry.delete_tag, "chat", "prod").message


def test_every_write_records_its_author(registry_server):
    with ConfigClient(registry_server.address) as client:
        stub, meta = client.stub, (("x-test-caller", "admin:alice"),)
        record = stub.CreateConfig(pb.CreateConfigRequest(name="owned"), metadata=meta).record
        assert record.author == "admin:alice"
        record = stub.UpdateConfig(pb.UpdateConfigRequest(name="owned"), metadata=(("x-test-caller", "admin:bob"),))
        assert record.record.author == "admin:bob"
        stub.SetTag(pb.SetTagRequest(name="owned", tag="prod", version=1), metadata=(("x-test-caller", "admin:carol"),))
        assert client.get("owned@1").author == "admin:alice" and client.get("owned").author == "admin:bob"
        stub.DeleteConfig(pb.DeleteConfigRequest(name="owned"), metadata=(("x-test-caller", "admin:dave"),))
        history = client.history("owned")
        assert [(e.kind, e.author) for e in history.entries] == [
            ("tag", "admin:dave"),  # the delete removed the tag
            ("tag", "admin:carol"),
            ("version", "admin:bob"),
            ("version", "admin:alice"),
        ]
        assert {v.deleted_by for v in history.versions} == {"admin:dave"}
        err = expect_code(grpc.StatusCode.NOT_FOUND, client.get, "owned@1")
        assert "admin:dave" in err.message


def test_cli_history_table_and_json(registry_server, capsys):
    address = registry_server.address
    with ConfigClient(address) as client:
        client.create("chat", {"max_new_tokens": 1})
        client.update("chat", {"max_new_tokens": 2})
        client.set_tag("chat", "prod", 2)
        client.delete("chat")
        client.create("chat", {"max_new_tokens": 3})
    assert cli_main(["config", "--address", address, "history", "chat"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["TIME", "AUTHOR", "EVENT"]
    events = [line.split(None, 2)[2] for line in lines[1:]]
    assert events[0] == "version 3"
    assert events[1] == "tag prod: 2 -> removed"
    assert events[2] == "tag prod: - -> 2"
    assert events[3].startswith("version 2 (deleted ") and events[3].endswith(" by anonymous)")
    assert events[4].startswith("version 1 (deleted ")
    assert all(line.split()[1] == "anonymous" for line in lines[1:])

    assert cli_main(["config", "--address", address, "history", "chat", "--as-json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["name"] == "chat"
    assert document["entries"][0] == {
        "kind": "version",
        "time": document["entries"][0]["time"],
        "author": "anonymous",
        "version": 3,
        "deleted": False,
        "deleted_at": None,
        "deleted_by": "",
    }
    assert document["entries"][1]["tag"] == "prod" and document["entries"][1]["new_version"] is None

    assert cli_main(["config", "--address", address, "get", "chat", "--as-json"]) == 0
    assert json.loads(capsys.readouterr().out)["author"] == "anonymous"

    assert cli_main(["config", "--address", address, "tag", "chat", "canary", "3"]) == 0
    capsys.readouterr()
    assert cli_main(["config", "--address", address, "untag", "chat", "canary"]) == 0
    assert capsys.readouterr().out.strip() == "removed chat:canary (it pointed at version 3)"
    assert cli_main(["config", "--address", address, "history", "chat"]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("tag canary: 3 -> removed")


def _write_schema_1_database(path) -> None:
    """A registry as specwire wrote it before migration 2 (the statements and rows of that release)."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA foreign_keys = ON")
    db.execute("BEGIN")
    for statement in MIGRATIONS[0]:
        db.execute(statement)
    db.execute("PRAGMA user_version = 1")
    db.execute("COMMIT")
    now = time.time()
    rows = [("chat", 1, {"max_new_tokens": 10}), ("chat", 2, {"max_new_tokens": 20}), ("solo", 1, {"top_k": 5})]
    db.execute("INSERT INTO configs VALUES ('chat', ?, 2)", (now,))
    db.execute("INSERT INTO configs VALUES ('solo', ?, 1)", (now,))
    for name, version, config in rows:
        db.execute(
            "INSERT INTO versions (name, version, config_json, labels_json, warnings_json, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (name, version, json.dumps(config), json.dumps({"team": "a"}), "[]", now + version),
        )
    db.execute("INSERT INTO tags VALUES ('chat', 'prod', 1)")
    db.close()


def test_a_schema_1_database_migrates_with_its_data(tmp_path):
    path = tmp_path / "old.db"
    _write_schema_1_database(path)
    store = SQLiteStore(path)
    assert store.schema_version() == SCHEMA_VERSION == 2
    chat = store.get("chat", tag="prod")
    assert (chat.version, chat.config, chat.labels, chat.tags) == (1, {"max_new_tokens": 10}, {"team": "a"}, ["prod"])
    assert chat.author == "unrecorded"
    assert store.get("chat").config == {"max_new_tokens": 20}
    assert [r.name for r in store.list()[0]] == ["chat", "solo"]
    assert [e.version for e in store.history("chat")[0]] == [2, 1]
    # The migrated registry follows the new rules.
    store.delete("chat", author="admin:ops")
    assert store.create("chat", {"max_new_tokens": 30}, {}, [], author="admin:ops").version == 3
    assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert store._db.execute("PRAGMA foreign_key_check").fetchall() == []
    store.close()
    # Served by a real server, the old data reads the same.
    with threaded_server(lambda: build_server(str(path))) as server, ConfigClient(server.address) as client:
        assert client.get("solo").config.top_k == 5 and client.get("solo").author == "unrecorded"
        assert client.get("chat").version == 3


def test_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "future.db"
    SQLiteStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(Exception, match="newer than this server"):
        SQLiteStore(path)
