"""SQLite storage of the config registry: named configs, immutable versions, tags.

One file, WAL journal (readers never block the writer), `synchronous=FULL`, every write in one
`BEGIN IMMEDIATE` transaction that is committed or rolled back as a whole, foreign keys on, and a
schema version in `PRAGMA user_version` with forward-only migrations. A database written by a newer
specwire (higher schema version) is refused rather than guessed at, so stored data is never
corrupted by an old server.
"""

from __future__ import annotations

import base64
import builtins
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specwire.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable

# Each entry migrates the schema from version i to i + 1. Never edit a released entry: append.
MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE configs (
               name TEXT PRIMARY KEY,
               created_at REAL NOT NULL,
               latest_version INTEGER NOT NULL
           )""",
        """CREATE TABLE versions (
               name TEXT NOT NULL REFERENCES configs(name) ON DELETE CASCADE,
               version INTEGER NOT NULL,
               config_json TEXT NOT NULL,
               labels_json TEXT NOT NULL,
               warnings_json TEXT NOT NULL,
               created_at REAL NOT NULL,
               PRIMARY KEY (name, version)
           )""",
        """CREATE TABLE tags (
               name TEXT NOT NULL,
               tag TEXT NOT NULL,
               version INTEGER NOT NULL,
               PRIMARY KEY (name, tag),
               FOREIGN KEY (name, version) REFERENCES versions(name, version) ON DELETE CASCADE
           )""",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)


class StorageError(Unavailable):
    """A write SQLite could not make durable (full volume, I/O error, lock timeout): nothing of it was
    stored, so retrying it is safe once the cause is fixed."""


@dataclass
class StoredConfig:
    """One stored version of a named config."""

    name: str
    version: int
    config: dict[str, Any]
    labels: dict[str, str]
    warnings: list[dict[str, Any]]
    created_at: float
    latest_version: int
    tags: list[str] = field(default_factory=list)


def encode_page_token(last_name: str) -> str:
    return base64.urlsafe_b64encode(last_name.encode()).decode()


def decode_page_token(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument.for_field(
            "page_token", token, "not a token this server issued; pass the previous page's next_page_token"
        ) from exc


class ConfigStore:
    """The registry's tables in one SQLite file.

    Args:
        path (`str` or `Path`): the database file, created if missing (`:memory:` for tests).
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.execute("PRAGMA journal_mode = WAL")
        # FULL syncs the WAL on every commit: a commit the client was told about survives a node crash
        # or power loss (NORMAL may drop the last commits). The registry is write-light, so the extra
        # fsync per write costs nothing that matters.
        self._db.execute("PRAGMA synchronous = FULL")
        self._migrate()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write: committed as a whole, or rolled back and reported (a `SpecwireError` as is, a
        SQLite failure such as a full volume at COMMIT as `StorageError`). Never left open: an open
        transaction would hold the write lock and make every later write fail or block."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                yield self._db
                self._db.execute("COMMIT")
            except BaseException as exc:
                self._rollback()
                if isinstance(exc, sqlite3.Error):
                    raise StorageError(
                        f"the registry could not store this write ({exc}); nothing was stored: "
                        "check the database volume (space, permissions) and retry"
                    ) from exc
                raise

    def _rollback(self) -> None:
        # SQLite may already have rolled back on its own (SQLITE_FULL, SQLITE_IOERR): ROLLBACK then fails.
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                logging.getLogger(__name__).exception("rollback of a failed registry write failed")

    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        current = self.schema_version()
        if current > SCHEMA_VERSION:
            raise FailedPrecondition(
                f"{self.path} has schema version {current}, newer than this server's {SCHEMA_VERSION}: "
                "upgrade specwire instead of opening it with an older release"
            )
        for version in range(current, SCHEMA_VERSION):
            with self._transaction() as db:
                for statement in MIGRATIONS[version]:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {version + 1}")

    # --- reads ---------------------------------------------------------------------------------

    def _record(self, db: sqlite3.Connection, row: sqlite3.Row) -> StoredConfig:
        tags = [
            r["tag"]
            for r in db.execute(
                "SELECT tag FROM tags WHERE name = ? AND version = ? ORDER BY tag",
                (row["name"], row["version"]),
            )
        ]
        return StoredConfig(
            name=row["name"],
            version=row["version"],
            config=json.loads(row["config_json"]),
            labels=json.loads(row["labels_json"]),
            warnings=json.loads(row["warnings_json"]),
            created_at=row["created_at"],
            latest_version=row["latest_version"],
            tags=tags,
        )

    _SELECT = (
        "SELECT v.*, c.latest_version FROM versions v JOIN configs c ON c.name = v.name "
        "WHERE v.name = ? AND v.version = ?"
    )

    def get(self, name: str, version: int | None = None, tag: str | None = None) -> StoredConfig:
        """One version: the latest, a given one, or the one a tag points at."""
        with self._lock:
            latest = self._db.execute("SELECT latest_version FROM configs WHERE name = ?", (name,)).fetchone()
            if latest is None:
                raise NotFound(f"no config named {name!r}; list the registry with `specwire config list` (ListConfigs)")
            if tag is not None:
                row = self._db.execute("SELECT version FROM tags WHERE name = ? AND tag = ?", (name, tag)).fetchone()
                if row is None:
                    raise NotFound(f"config {name!r} has no tag {tag!r}; set it with `specwire config tag` (SetTag)")
                version = row["version"]
            version = latest["latest_version"] if version is None else version
            row = self._db.execute(self._SELECT, (name, version)).fetchone()
            if row is None:
                raise NotFound(f"config {name!r} has no version {version} (latest is {latest['latest_version']})")
            return self._record(self._db, row)

    def list(self, prefix: str = "", page_size: int = 100, after: str = "") -> tuple[list[StoredConfig], str]:
        """Latest version of each name starting with `prefix`, by name, after the name `after`."""
        escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        with self._lock:
            rows = self._db.execute(
                "SELECT v.*, c.latest_version FROM configs c JOIN versions v "
                "ON v.name = c.name AND v.version = c.latest_version "
                "WHERE c.name LIKE ? ESCAPE '\\' AND c.name > ? ORDER BY c.name LIMIT ?",
                (escaped + "%", after, page_size + 1),
            ).fetchall()
            records = [self._record(self._db, r) for r in rows[:page_size]]
        next_token = encode_page_token(records[-1].name) if len(rows) > page_size else ""
        return records, next_token

    # --- writes --------------------------------------------------------------------------------

    def create(
        self, name: str, config: dict[str, Any], labels: dict[str, str], warnings: builtins.list[dict[str, Any]]
    ) -> StoredConfig:
        """Store version 1 of a new name."""
        now = time.time()
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM configs WHERE name = ?", (name,)).fetchone():
                raise AlreadyExists(
                    f"config {name!r} already exists; add a version with `specwire config update` (UpdateConfig)"
                )
            db.execute("INSERT INTO configs (name, created_at, latest_version) VALUES (?, ?, 1)", (name, now))
            self._insert_version(db, name, 1, config, labels, warnings, now)
        return self.get(name, 1)

    def add_version(
        self,
        name: str,
        config: dict[str, Any],
        labels: dict[str, str] | None,
        warnings: builtins.list[dict[str, Any]],  # `list` is the method above, in the class body
        expected_version: int | None = None,
    ) -> StoredConfig:
        """Store the next version of an existing name (optimistic concurrency on `expected_version`)."""
        now = time.time()
        with self._transaction() as db:
            row = db.execute("SELECT latest_version FROM configs WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no config named {name!r}; create it with `specwire config create` (CreateConfig)")
            latest = row["latest_version"]
            if expected_version is not None and expected_version != latest:
                raise Aborted(
                    f"config {name!r} is at version {latest}, not the expected {expected_version}: "
                    "someone else updated it; re-read and retry"
                )
            if labels is None:
                previous = db.execute(
                    "SELECT labels_json FROM versions WHERE name = ? AND version = ?", (name, latest)
                ).fetchone()
                labels = json.loads(previous["labels_json"])
            self._insert_version(db, name, latest + 1, config, labels, warnings, now)
            db.execute("UPDATE configs SET latest_version = ? WHERE name = ?", (latest + 1, name))
        return self.get(name, latest + 1)

    @staticmethod
    def _insert_version(db, name, version, config, labels, warnings, now) -> None:
        db.execute(
            "INSERT INTO versions (name, version, config_json, labels_json, warnings_json, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                name,
                version,
                json.dumps(config, sort_keys=True),
                json.dumps(labels, sort_keys=True),
                json.dumps(warnings, default=repr),
                now,
            ),
        )

    def delete(self, name: str, expected_version: int | None = None) -> int:
        """Delete a name with all its versions and tags; returns how many versions went."""
        with self._transaction() as db:
            row = db.execute("SELECT latest_version FROM configs WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no config named {name!r}")
            if expected_version is not None and expected_version != row["latest_version"]:
                raise Aborted(
                    f"config {name!r} is at version {row['latest_version']}, not the expected {expected_version}"
                )
            count = db.execute("SELECT COUNT(*) FROM versions WHERE name = ?", (name,)).fetchone()[0]
            db.execute("DELETE FROM tags WHERE name = ?", (name,))
            db.execute("DELETE FROM versions WHERE name = ?", (name,))
            db.execute("DELETE FROM configs WHERE name = ?", (name,))
        return count

    def set_tag(self, name: str, tag: str, version: int) -> StoredConfig:
        """Point `tag` at `version`, moving it if it exists."""
        with self._transaction() as db:
            row = db.execute("SELECT latest_version FROM configs WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no config named {name!r}")
            exists = db.execute("SELECT 1 FROM versions WHERE name = ? AND version = ?", (name, version)).fetchone()
            if not exists:
                raise NotFound(f"config {name!r} has no version {version} (latest is {row['latest_version']})")
            db.execute(
                "INSERT INTO tags (name, tag, version) VALUES (?, ?, ?) "
                "ON CONFLICT (name, tag) DO UPDATE SET version = excluded.version",
                (name, tag, version),
            )
        return self.get(name, version)
