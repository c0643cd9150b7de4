"""SQLite storage of the config registry, the embedded default.

One file, WAL journal (readers never block the writer), `synchronous=FULL`, every write in one
`BEGIN IMMEDIATE` transaction that is committed or rolled back as a whole, foreign keys on, and a
schema version in `PRAGMA user_version` with forward-only migrations. A database written by a newer
specwire (higher schema version) is refused rather than guessed at, so stored data is never
corrupted by an old server.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specwire.config_service.storage.schema import MIGRATIONS, SCHEMA_VERSION, SQLITE
from specwire.config_service.storage.store import RegistryStore, StorageError
from specwire.errors import FailedPrecondition


class SQLiteStore(RegistryStore):
    """The registry's tables in one SQLite file.

    Args:
        path (`str` or `Path`): the database file, created if missing (`:memory:` for tests).
    """

    dialect = SQLITE

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
    def _write(self) -> Iterator[sqlite3.Connection]:
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

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as exc:
                raise StorageError(f"the registry could not read its database ({exc}); check its volume") from exc

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
            with self._write() as db:
                for statement in MIGRATIONS[version]:
                    db.execute(self.dialect.sql(statement))
                db.execute(f"PRAGMA user_version = {version + 1}")
