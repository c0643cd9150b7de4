"""What only the PostgreSQL backend has to get right, on a real throwaway PostgreSQL (`postgres_server`):
several registry replicas writing one database, replicas migrating together, a lost connection, a
database that refuses connections, a bad URL at start, and a schema-1 database migrating. The rest of
the registry suite runs on both backends through the `registry_db` fixture."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import pytest

from specwire.client import ConfigClient, SpecwireRpcError
from specwire.config_service.__main__ import build_server
from specwire.config_service.storage import MIGRATIONS, SCHEMA_VERSION
from specwire.config_service.storage.schema import POSTGRES
from tests.servers import threaded_server

psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed: install the dev extra")
from specwire.config_service.storage.postgres import PostgresStore, redacted  # noqa: E402 - needs psycopg


@pytest.fixture
def pg_db(postgres_server):
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)


def _admin(url: str, sql: str, params: tuple = ()) -> list:
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def test_two_replicas_number_concurrent_updates_without_gaps_or_duplicates(pg_db):
    with threaded_server(lambda: build_server(pg_db)) as one, threaded_server(lambda: build_server(pg_db)) as two:
        clients = [ConfigClient(one.address), ConfigClient(two.address)]
        clients[0].create("shared", {"max_new_tokens": 1})
        written: list[int] = []
        errors: list[BaseException] = []

        def writer(client: ConfigClient, i: int) -> None:
            try:
                for j in range(8):
                    written.append(client.update("shared", {"max_new_tokens": 100 * i + j + 1}).version)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(clients[i % 2], i)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sorted(written) == list(range(2, 66))  # 64 updates: versions 2..65, each once
        for client in clients:
            assert client.get("shared").version == 65
        versions = [e.version for e in clients[1].history("shared").versions]
        assert versions == list(range(65, 0, -1))

        # Both replicas creating one new name at once: one creates it, the others are told it exists.
        outcomes: list[str] = []

        def creator(client: ConfigClient) -> None:
            try:
                client.create("raced", {"max_new_tokens": 2})
                outcomes.append("created")
            except SpecwireRpcError as exc:
                outcomes.append(exc.code().name)

        threads = [threading.Thread(target=creator, args=(clients[i % 2],)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["ALREADY_EXISTS"] * 5 + ["created"]
        for client in clients:
            client.close()


def test_replicas_starting_together_migrate_once(pg_db):
    stores: list[PostgresStore] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            stores.append(PostgresStore(pg_db))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(stores) == 4
    assert _admin(pg_db, "SELECT version FROM specwire_schema") == [(SCHEMA_VERSION,)]
    stores[0].create("a", {}, {}, [], author="admin:x")
    assert stores[3].get("a").author == "admin:x"
    for store in stores:
        store.close()


def test_a_lost_connection_is_replaced_and_a_refusing_database_is_unavailable(pg_db, postgres_server):
    name = pg_db.rsplit("/", 1)[1]
    with threaded_server(lambda: build_server(pg_db)) as server, ConfigClient(server.address) as client:
        client.create("chat", {"max_new_tokens": 1})
        # The server drops every connection of the registry (a restart, a failover, an idle timeout).
        terminate = (
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
        )
        _admin(postgres_server.url(), terminate, (name,))
        assert client.get("chat").version == 1  # the pool replaced the dead connection
        assert client.update("chat", {"max_new_tokens": 2}).version == 2

        _admin(postgres_server.url(), f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        _admin(postgres_server.url(), terminate, (name,))
        try:
            started = time.monotonic()
            with pytest.raises(SpecwireRpcError) as info:
                client.update("chat", {"max_new_tokens": 3})
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "nothing" in info.value.message and "stored" in info.value.message
            assert time.monotonic() - started < 20
        finally:
            _admin(postgres_server.url(), f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        assert client.update("chat", {"max_new_tokens": 3}).version == 3  # back once the database is


def test_a_bad_url_stops_the_service_with_one_line_and_no_password(postgres_server):
    url = postgres_server.url("no_such_database").replace("specwire@", "specwire:hunter2@")
    result = subprocess.run(
        [sys.executable, "-m", "specwire.config_service", "--port", "0", "--db", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "no_such_database" in result.stderr and "hunter2" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    assert redacted(url) in result.stderr and "***" in redacted(url)


@pytest.mark.parametrize("command", ["backup", "restore"])
def test_backup_and_restore_point_to_pg_dump(command, pg_db, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "specwire.config_service", command, str(tmp_path / "b"), "--db", pg_db],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert ("pg_dump" if command == "backup" else "pg_restore") in result.stderr


def test_a_schema_1_database_migrates_with_its_data(pg_db):
    with psycopg.connect(pg_db, autocommit=True) as conn, conn.transaction():
        for statement in MIGRATIONS[0]:
            conn.execute(POSTGRES.sql(statement))
        conn.execute("CREATE TABLE specwire_schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO specwire_schema VALUES (1)")
        now = time.time()
        conn.execute("INSERT INTO configs VALUES ('chat', %s, 2)", (now,))
        for version in (1, 2):
            conn.execute(
                "INSERT INTO versions VALUES ('chat', %s, %s, '{}', '[]', %s)",
                (version, json.dumps({"max_new_tokens": version}), now + version),
            )
        conn.execute("INSERT INTO tags VALUES ('chat', 'prod', 1)")
    store = PostgresStore(pg_db)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        record = store.get("chat", tag="prod")
        assert (record.version, record.config, record.author) == (1, {"max_new_tokens": 1}, "unrecorded")
        assert abs(record.created_at - (now + 1)) < 1e-3  # DOUBLE PRECISION, not PostgreSQL's 4-byte REAL
        store.delete("chat", author="admin:ops")
        assert store.create("chat", {}, {}, [], author="admin:ops").version == 3
    finally:
        store.close()


def test_a_newer_schema_is_refused(pg_db):
    PostgresStore(pg_db).close()
    _admin(pg_db, "UPDATE specwire_schema SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(Exception, match="newer than this server"):
        PostgresStore(pg_db)
