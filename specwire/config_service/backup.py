"""`config-service backup` and `config-service restore`: copies of the registry's SQLite file.

Both go through SQLite's online backup API, never a file copy: a copy of a WAL database taken while
the service writes can miss the commits still in the `-wal` file or catch a page half-written, while
the backup API copies one consistent snapshot and can run next to a serving registry.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from specwire.config_service.storage import SCHEMA_VERSION
from specwire.errors import FailedPrecondition, NotFound


def _check_integrity(db: sqlite3.Connection, what: str) -> None:
    try:
        result = [row[0] for row in db.execute("PRAGMA integrity_check")]
    except sqlite3.DatabaseError as exc:  # not a database at all, or unreadable
        raise FailedPrecondition(f"{what} is not a readable SQLite database: {exc}") from exc
    if result != ["ok"]:
        raise FailedPrecondition(f"{what} fails PRAGMA integrity_check: {'; '.join(result[:5])}")


def _open_existing(path: Path, what: str) -> sqlite3.Connection:
    if not path.is_file():
        raise NotFound(f"{what} {path} does not exist")
    # Not `mode=ro`: a read-only connection to a WAL database fails when no -shm file exists yet.
    return sqlite3.connect(path, timeout=30.0)


def backup(db: str | Path, target: str | Path, force: bool = False) -> None:
    """Copy the registry database `db` to `target`, safely while a service serves and writes it.

    The copy is written next to `target` and renamed into place only once it passes
    `PRAGMA integrity_check`, so a failed backup never leaves a truncated file under the target name.

    Args:
        db (`str` or `Path`): the registry database (`config-service --db`).
        target (`str` or `Path`): the backup file to write.
        force (`bool`, defaults to `False`): replace `target` if it exists.
    """
    target = Path(target)
    if target.exists() and not force:
        raise FailedPrecondition(f"{target} exists; pass --force to replace it")
    source = _open_existing(Path(db), "registry database")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        copy = sqlite3.connect(partial)
        try:
            source.backup(copy)  # all pages in one step: one consistent snapshot
            _check_integrity(copy, f"the backup of {db}")
        finally:
            copy.close()
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        source.close()
    os.replace(partial, target)


def restore(source: str | Path, db: str | Path, force: bool = False) -> None:
    """Restore the registry database `db` from the backup `source`.

    Stop the service first: a running service keeps its connection to the old database. The backup
    is checked (`PRAGMA integrity_check`, a schema this release can read) before anything is written.

    Args:
        source (`str` or `Path`): a file written by `config-service backup`.
        db (`str` or `Path`): the registry database to write (`config-service --db`).
        force (`bool`, defaults to `False`): overwrite `db` if it exists.
    """
    db = Path(db)
    if db.exists() and not force:
        raise FailedPrecondition(
            f"{db} exists; stop the service using it and pass --force to replace its contents with {source}"
        )
    backup_db = _open_existing(Path(source), "backup")
    try:
        _check_integrity(backup_db, f"the backup {source}")
        schema = backup_db.execute("PRAGMA user_version").fetchone()[0]
        if schema > SCHEMA_VERSION:
            raise FailedPrecondition(
                f"the backup {source} has schema version {schema}, newer than this release's {SCHEMA_VERSION}: "
                "restore it with the specwire release that wrote it"
            )
        db.parent.mkdir(parents=True, exist_ok=True)
        # The backup API writes into the target as one transaction (its WAL included), so an
        # existing database is replaced whole or not at all.
        target = sqlite3.connect(db, timeout=30.0)
        try:
            backup_db.backup(target)
            _check_integrity(target, f"the restored {db}")
        finally:
            target.close()
    finally:
        backup_db.close()
