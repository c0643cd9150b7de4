"""No lost writes in the config registry: synchronous=FULL, failed commits rolled back and reported,
`config-service backup`/`restore` next to a serving registry, and kill -9 during a storm of writes."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time

import grpc
import pytest

from specwire.client import ConfigClient, SpecwireRpcError
from specwire.config_service.__main__ import build_server, main
from specwire.config_service.storage import SQLiteStore, StorageError
from specwire.errors import NotFound
from tests.servers import free_port, subprocess_server, threaded_server


def integrity(path) -> list[str]:
    with sqlite3.connect(path) as db:
        return [row[0] for row in db.execute("PRAGMA integrity_check")]


def test_commits_are_synced_in_full(tmp_path):
    store = SQLiteStore(tmp_path / "registry.db")
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


class FailingCommit:
    """A connection whose COMMIT fails, as it does when the volume fills at the last moment."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        self.fail = True

    def execute(self, sql, *args):
        if sql == "COMMIT" and self.fail:
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.db, name)


def test_a_failed_commit_is_rolled_back_and_reported(tmp_path):
    store = SQLiteStore(tmp_path / "registry.db")
    store.create("kept", {"max_new_tokens": 1}, {}, [])
    failing = FailingCommit(store._db)
    store._db = failing
    with pytest.raises(StorageError, match="nothing was stored") as info:
        store.add_version("kept", {"max_new_tokens": 2}, None, [])
    assert info.value.code == "UNAVAILABLE"  # the servicer maps it to this gRPC status
    with pytest.raises(StorageError):
        store.create("half", {}, {}, [])
    assert not store._db.in_transaction  # not left open, holding the write lock
    failing.fail = False
    # Nothing of the failed writes is visible, and the next write works.
    assert store.get("kept").version == 1
    with pytest.raises(NotFound):
        store.get("half")
    assert store.add_version("kept", {"max_new_tokens": 3}, None, []).version == 2
    assert store.get("kept", 2).config == {"max_new_tokens": 3}
    store.close()
    assert integrity(tmp_path / "registry.db") == ["ok"]


def test_a_failed_commit_reaches_the_client_as_unavailable(tmp_path):
    with threaded_server(lambda: build_server(str(tmp_path / "registry.db"))) as server:
        store = server.server.bindings[0].servicer.store
        with ConfigClient(server.address) as client:
            client.create("chat", {"max_new_tokens": 1})
            failing = store._db = FailingCommit(store._db)
            with pytest.raises(SpecwireRpcError) as info:
                client.update("chat", {"max_new_tokens": 2})
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "nothing was stored" in info.value.message
            failing.fail = False
            assert client.get("chat").version == 1
            assert client.update("chat", {"max_new_tokens": 3}).version == 2


def test_a_full_volume_fails_the_write_not_the_registry(tmp_path):
    store = SQLiteStore(tmp_path / "registry.db")
    store.create("small", {"max_new_tokens": 1}, {}, [])
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages + 2}")  # a volume with two pages left
    big = {"note": "x" * 20_000}
    with pytest.raises(StorageError, match="full"):
        for i in range(20):
            store.create(f"big-{i}", {}, big, [])
    assert not store._db.in_transaction
    stored = {r.name for r in store.list()[0]}
    for name in stored - {"small"}:
        assert store.get(name).labels == big  # what is visible is whole
    store._db.execute("PRAGMA max_page_count = 1000000")  # space freed
    assert store.add_version("small", {"max_new_tokens": 2}, None, []).version == 2
    store.close()
    assert integrity(tmp_path / "registry.db") == ["ok"]


def test_backup_while_serving_then_restore_and_serve(tmp_path):
    db, copy, restored = tmp_path / "registry.db", tmp_path / "backup.db", tmp_path / "restored" / "registry.db"
    acknowledged: list[tuple[str, int, int]] = []
    stop = threading.Event()
    with threaded_server(lambda: build_server(str(db))) as server:
        with ConfigClient(server.address) as client:
            client.create("chat", {"max_new_tokens": 1})
            client.set_tag("chat", "prod", 1)

            def write():
                n = 1
                while not stop.is_set():
                    n += 1
                    acknowledged.append(("chat", client.update("chat", {"max_new_tokens": n}).version, n))

            writer = threading.Thread(target=write)
            writer.start()
            time.sleep(0.3)
            before = len(acknowledged)
            main(["backup", str(copy), "--db", str(db)])
            stop.set()
            writer.join(10)
            with pytest.raises(SystemExit, match="exists"):
                main(["backup", str(copy), "--db", str(db)])
    assert before > 0 and integrity(copy) == ["ok"]
    with pytest.raises(SystemExit, match="does not exist"):
        main(["restore", str(tmp_path / "missing.db"), "--db", str(restored)])
    main(["restore", str(copy), "--db", str(restored)])
    with pytest.raises(SystemExit, match="--force"):
        main(["restore", str(copy), "--db", str(restored)])
    main(["restore", str(copy), "--db", str(restored), "--force"])
    with threaded_server(lambda: build_server(str(restored))) as server:
        with ConfigClient(server.address) as client:
            latest = client.get("chat").version
            assert latest >= acknowledged[before - 1][1]  # every write acknowledged before the backup
            for _, version, n in acknowledged:
                if version <= latest:
                    assert client.get(f"chat@{version}").config.max_new_tokens == n
            assert client.get("chat:prod").version == 1
            assert client.update("chat", {"max_new_tokens": 10**6}).version == latest + 1  # and it takes writes


def test_restore_refuses_a_corrupt_backup(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"SQLite format 3\x00" + b"\x00" * 4000)
    with pytest.raises(SystemExit, match="not a readable SQLite database"):
        main(["restore", str(bad), "--db", str(tmp_path / "registry.db")])
    assert not (tmp_path / "registry.db").exists()


class Writer(threading.Thread):
    """Writes to its own names (so the order of its acknowledgements is the order in the registry)
    and records every write the service acknowledged, plus the one in flight when it failed."""

    def __init__(self, address: str, index: int):
        super().__init__(daemon=True)
        self.address, self.index = address, index
        self.versions: dict[str, dict[int, int]] = {}  # name -> version -> max_new_tokens
        self.tags: dict[str, set[int | None]] = {}  # name -> versions "prod" may point at (None: no tag yet)
        self.count = 0

    def run(self) -> None:
        with ConfigClient(self.address, timeout=5.0) as client:
            try:
                while True:
                    self.step(client)
            except SpecwireRpcError as exc:
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc

    def step(self, client: ConfigClient) -> None:
        self.count += 1
        name = f"w{self.index}-{self.count // 10}"
        n = self.count
        if name not in self.versions:
            client.create(name, {"max_new_tokens": n})
            self.versions[name] = {1: n}
        elif self.count % 3 == 0:
            version = max(self.versions[name])
            acked = self.tags.get(name, {None})  # before the first SetTag is acknowledged there may be no tag
            self.tags[name] = acked | {version}  # in flight: either value may be stored
            client.set_tag(name, "prod", version)
            self.tags[name] = {version}
        else:
            version = client.update(name, {"max_new_tokens": n}).version
            assert version == max(self.versions[name]) + 1
            self.versions[name][version] = n


def tag_version(client: ConfigClient, name: str) -> int | None:
    """The version `name:prod` points at, None when the tag does not exist."""
    try:
        return client.get(f"{name}:prod").version
    except SpecwireRpcError as exc:
        if exc.code() is grpc.StatusCode.NOT_FOUND and "has no tag" in exc.message:
            return None
        raise


def test_kill_9_during_a_write_storm_loses_no_acknowledged_write(registry_db):
    # On both backends: on PostgreSQL the registry process dies with transactions open on its connections.
    db, port = registry_db, free_port()
    sqlite = not db.startswith("postgresql://")
    args = ["specwire.config_service", "--port", str(port), "--db", db]
    with subprocess_server(args, port, "specwire.config.v1.ConfigService") as process:
        writers = [Writer(f"127.0.0.1:{port}", i) for i in range(4)]
        for writer in writers:
            writer.start()
        time.sleep(2.0)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        for writer in writers:
            writer.join(15)
            assert not writer.is_alive()
    assert sum(w.count for w in writers) > 20, "the storm wrote too little to mean anything"
    assert not sqlite or integrity(db) == ["ok"]
    with subprocess_server(args, port, "specwire.config.v1.ConfigService"):
        with ConfigClient(f"127.0.0.1:{port}") as client:
            for writer in writers:
                for name, versions in writer.versions.items():
                    # A write in flight at the kill may or may not have landed; none acknowledged is lost.
                    assert client.get(name).version >= max(versions)
                    for version, n in versions.items():
                        assert client.get(f"{name}@{version}").config.max_new_tokens == n
                for name, allowed in writer.tags.items():
                    assert tag_version(client, name) in allowed, (name, allowed)
    assert not sqlite or integrity(db) == ["ok"]
