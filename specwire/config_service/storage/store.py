"""The registry's rules, written once over any SQL backend: named configs, immutable versions, tags,
tombstones and history.

A reference `name@N` means one config forever. Version numbers are never reused: DeleteConfig leaves
tombstones (the config and its versions are marked deleted, with who and when, and the config keeps its
version counter), so a config created again under a deleted name continues at N + 1, and `name@N` of a
deleted version is NOT_FOUND saying it was deleted, never a newer config. Every version records its
author, and every tag move (SetTag, and the tags a delete removes) is kept in `tag_moves`.

Backends (`SQLiteStore`, `PostgresStore`) supply the connection and its transactions (`_write`,
`_read`) and their error mapping; every statement goes through the backend's `Dialect`.
"""

from __future__ import annotations

import base64
import builtins
import json
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from specwire.config_service.storage.schema import Dialect
from specwire.errors import Aborted, AlreadyExists, InvalidArgument, NotFound, Unavailable


class StorageError(Unavailable):
    """A call the database could not serve (full volume, I/O error, lost connection, lock timeout):
    nothing of a failed write was stored, so retrying it is safe once the cause is fixed."""


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
    author: str = ""


@dataclass
class HistoryEntry:
    """One event of a config's history: a version written (`kind == "version"`, maybe since deleted) or
    a tag moved (`kind == "tag"`; `old_version`/`new_version` are None where the tag did not exist
    before / was removed by a delete)."""

    kind: str
    at: float
    author: str
    version: int | None = None
    deleted_at: float | None = None
    deleted_by: str | None = None
    tag: str = ""
    old_version: int | None = None
    new_version: int | None = None


def encode_page_token(last: str) -> str:
    return base64.urlsafe_b64encode(last.encode()).decode()


def decode_page_token(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument.for_field(
            "page_token", token, "not a token this server issued; pass the previous page's next_page_token"
        ) from exc


def decode_history_token(token: str) -> tuple[float, int, int]:
    """The position `(at, kind, key)` a history page ended at."""
    try:
        at, kind, key = json.loads(decode_page_token(token))
        return float(at), int(kind), int(key)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument.for_field(
            "page_token", token, "not a token this server issued; pass the previous page's next_page_token"
        ) from exc


def when(at: float, by: str | None) -> str:
    stamp = datetime.fromtimestamp(at, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    return f"at {stamp} by {by or 'unknown'}"


# History rows from both tables in one shape, newest first. `event_kind` orders a version before a tag move
# written in the same instant; `event_key` is the version number or the tag move's id.
_HISTORY = """
SELECT * FROM (
    SELECT 1 AS event_kind, version AS event_key, created_at AS event_at, author, version, deleted_at,
           deleted_by, '' AS tag, NULL AS old_version, NULL AS new_version
    FROM versions WHERE name = ?
    UNION ALL
    SELECT 0 AS event_kind, id AS event_key, moved_at AS event_at, author, NULL AS version, NULL AS deleted_at,
           NULL AS deleted_by, tag, old_version, new_version
    FROM tag_moves WHERE name = ?
) AS history
WHERE event_at < ? OR (event_at = ? AND (event_kind < ? OR (event_kind = ? AND event_key < ?)))
ORDER BY event_at DESC, event_kind DESC, event_key DESC
LIMIT ?
"""


class RegistryStore:
    """The registry's operations; a subclass provides the database.

    Subclasses set `dialect` and implement `_write()` (one transaction, committed as a whole or rolled
    back and reported) and `_read()` (a consistent read), both context managers yielding an object with
    `execute(sql, params)` returning a cursor whose rows are read by column name.
    """

    dialect: Dialect

    def close(self) -> None:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _read(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def schema_version(self) -> int:
        raise NotImplementedError

    def _q(self, db: Any, statement: str, params: tuple = ()) -> Any:
        return db.execute(self.dialect.sql(statement), params)

    # --- reads ---------------------------------------------------------------------------------

    def _config_row(self, db: Any, name: str, lock: bool = False) -> Any:
        return self._q(
            db,
            "SELECT latest_version, deleted_at, deleted_by FROM configs WHERE name = ?"
            + (" {for_update}" if lock else ""),
            (name,),
        ).fetchone()

    def _record(self, db: Any, row: Any, latest: int) -> StoredConfig:
        tags = [
            r["tag"]
            for r in self._q(
                db,
                "SELECT tag FROM tags WHERE name = ? AND version = ? ORDER BY tag {binary}",
                (row["name"], row["version"]),
            ).fetchall()
        ]
        return StoredConfig(
            name=row["name"],
            version=row["version"],
            config=json.loads(row["config_json"]),
            labels=json.loads(row["labels_json"]),
            warnings=json.loads(row["warnings_json"]),
            created_at=row["created_at"],
            latest_version=latest,
            tags=tags,
            author=row["author"],
        )

    def _version_row(self, db: Any, name: str, version: int, latest: int) -> Any:
        """The row of a live version; NOT_FOUND saying why otherwise (never written, or deleted)."""
        row = self._q(db, "SELECT * FROM versions WHERE name = ? AND version = ?", (name, version)).fetchone()
        if row is None:
            raise NotFound(f"config {name!r} has no version {version} (the latest version number is {latest})")
        if row["deleted_at"] is not None:
            raise NotFound(
                f"version {version} of config {name!r} was deleted {when(row['deleted_at'], row['deleted_by'])}; "
                f"a reference name@N never means another config: pick a live version "
                f"(`specwire config history {name}`)"
            )
        return row

    @staticmethod
    def _live(name: str, config: Any, hint: str) -> None:
        """NOT_FOUND for a config name that was never created or is deleted."""
        if config is None:
            raise NotFound(f"no config named {name!r}; {hint}")
        if config["deleted_at"] is not None:
            raise NotFound(
                f"config {name!r} was deleted {when(config['deleted_at'], config['deleted_by'])}; "
                f"create it again with `specwire config create` (CreateConfig): its versions continue at "
                f"{config['latest_version'] + 1}"
            )

    def get(self, name: str, version: int | None = None, tag: str | None = None) -> StoredConfig:
        """One version: the latest, a given one, or the one a tag points at."""
        with self._read() as db:
            config = self._config_row(db, name)
            if version is None:
                self._live(name, config, "list the registry with `specwire config list` (ListConfigs)")
            elif config is None:
                raise NotFound(f"no config named {name!r}; list the registry with `specwire config list` (ListConfigs)")
            latest = config["latest_version"]
            if tag is not None:
                row = self._q(db, "SELECT version FROM tags WHERE name = ? AND tag = ?", (name, tag)).fetchone()
                if row is None:
                    raise NotFound(f"config {name!r} has no tag {tag!r}; set it with `specwire config tag` (SetTag)")
                version = row["version"]
            row = self._version_row(db, name, latest if version is None else version, latest)
            return self._record(db, row, latest)

    def list(self, prefix: str = "", page_size: int = 100, after: str = "") -> tuple[list[StoredConfig], str]:
        """Latest version of each live name starting with `prefix`, by name, after the name `after`."""
        with self._read() as db:
            rows = self._q(
                db,
                "SELECT v.*, c.latest_version AS latest FROM configs c JOIN versions v "
                "ON v.name = c.name AND v.version = c.latest_version "
                "WHERE c.deleted_at IS NULL AND substr(c.name, 1, CAST(? AS INTEGER)) = ? AND c.name {binary} > ? "
                "ORDER BY c.name {binary} LIMIT ?",
                (len(prefix), prefix, after, page_size + 1),
            ).fetchall()
            records = [self._record(db, r, r["latest"]) for r in rows[:page_size]]
        next_token = encode_page_token(records[-1].name) if len(rows) > page_size else ""
        return records, next_token

    def history(
        self, name: str, page_size: int = 100, after: tuple[float, int, int] | None = None
    ) -> tuple[builtins.list[HistoryEntry], str]:
        """Versions (deleted ones included) and tag moves of `name`, newest first, from after `after`."""
        at, kind, key = after or (float("inf"), 2, 0)
        with self._read() as db:
            if self._config_row(db, name) is None:
                raise NotFound(
                    f"no config named {name!r} was ever stored; list the registry with `specwire config list`"
                )
            rows = self._q(db, _HISTORY, (name, name, at, at, kind, kind, key, page_size + 1)).fetchall()
        entries = [
            HistoryEntry(
                kind="version" if r["event_kind"] == 1 else "tag",
                at=r["event_at"],
                author=r["author"],
                version=r["version"],
                deleted_at=r["deleted_at"],
                deleted_by=r["deleted_by"],
                tag=r["tag"],
                old_version=r["old_version"],
                new_version=r["new_version"],
            )
            for r in rows[:page_size]
        ]
        next_token = ""
        if len(rows) > page_size:
            last = rows[page_size - 1]
            next_token = encode_page_token(json.dumps([last["event_at"], last["event_kind"], last["event_key"]]))
        return entries, next_token

    # --- writes --------------------------------------------------------------------------------

    def create(
        self,
        name: str,
        config: dict[str, Any],
        labels: dict[str, str],
        warnings: builtins.list[dict[str, Any]],
        author: str = "",
    ) -> StoredConfig:
        """Store the first version of a new name: 1, or N + 1 for a name deleted at version N."""
        with self._write() as db:
            row = self._config_row(db, name, lock=True)
            now = self._now(db, name)
            if row is not None and row["deleted_at"] is None:
                raise AlreadyExists(
                    f"config {name!r} already exists; add a version with `specwire config update` (UpdateConfig)"
                )
            if row is None:
                version = 1
                # DO NOTHING rather than a unique violation: a replica creating the same name at the same
                # moment makes this insert a no-op once it commits, and we say ALREADY_EXISTS.
                inserted = self._q(
                    db,
                    "INSERT INTO configs (name, created_at, latest_version) VALUES (?, ?, 1) "
                    "ON CONFLICT (name) DO NOTHING",
                    (name, now),
                )
                if inserted.rowcount == 0:
                    raise AlreadyExists(f"config {name!r} was just created by another writer; read it or update it")
            else:
                version = row["latest_version"] + 1
                self._q(
                    db,
                    "UPDATE configs SET latest_version = ?, deleted_at = NULL, deleted_by = NULL WHERE name = ?",
                    (version, name),
                )
            self._insert_version(db, name, version, config, labels, warnings, author, now)
        return self.get(name, version)

    def add_version(
        self,
        name: str,
        config: dict[str, Any],
        labels: dict[str, str] | None,
        warnings: builtins.list[dict[str, Any]],  # `list` is the method above, in the class body
        expected_version: int | None = None,
        author: str = "",
    ) -> StoredConfig:
        """Store the next version of a live name (optimistic concurrency on `expected_version`)."""
        with self._write() as db:
            row = self._config_row(db, name, lock=True)  # the lock serializes version numbering across replicas
            self._live(name, row, "create it with `specwire config create` (CreateConfig)")
            now = self._now(db, name)
            latest = row["latest_version"]
            if expected_version is not None and expected_version != latest:
                raise Aborted(
                    f"config {name!r} is at version {latest}, not the expected {expected_version}: "
                    "someone else updated it; re-read and retry"
                )
            if labels is None:
                previous = self._q(
                    db, "SELECT labels_json FROM versions WHERE name = ? AND version = ?", (name, latest)
                ).fetchone()
                labels = json.loads(previous["labels_json"])
            self._insert_version(db, name, latest + 1, config, labels, warnings, author, now)
            self._q(db, "UPDATE configs SET latest_version = ? WHERE name = ?", (latest + 1, name))
        return self.get(name, latest + 1)

    def _now(self, db: Any, name: str) -> float:
        """The time of a write to `name`, taken under its row lock: later than every event already in its
        history, so the history's order is the order of the writes even when replicas' clocks differ."""
        row = self._q(
            db,
            "SELECT MAX(t) AS t FROM ("
            "SELECT MAX(created_at) AS t FROM versions WHERE name = ? "
            "UNION ALL SELECT MAX(deleted_at) AS t FROM versions WHERE name = ? "
            "UNION ALL SELECT MAX(moved_at) AS t FROM tag_moves WHERE name = ?) AS times",
            (name, name, name),
        ).fetchone()
        now = time.time()
        return now if row["t"] is None else max(now, row["t"] + 1e-6)

    def _insert_version(self, db, name, version, config, labels, warnings, author, now) -> None:
        self._q(
            db,
            "INSERT INTO versions (name, version, config_json, labels_json, warnings_json, created_at, author) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                name,
                version,
                json.dumps(config, sort_keys=True),
                json.dumps(labels, sort_keys=True),
                json.dumps(warnings, default=repr),
                now,
                author,
            ),
        )

    def delete(self, name: str, expected_version: int | None = None, author: str = "") -> int:
        """Delete a name: its versions become tombstones, its tags go (each removal kept in the tag
        history), its version counter stays. Returns how many live versions were deleted."""
        with self._write() as db:
            row = self._config_row(db, name, lock=True)
            self._live(name, row, "list the registry with `specwire config list` (ListConfigs)")
            now = self._now(db, name)
            if expected_version is not None and expected_version != row["latest_version"]:
                raise Aborted(
                    f"config {name!r} is at version {row['latest_version']}, not the expected {expected_version}"
                )
            count = self._q(
                db, "SELECT COUNT(*) AS n FROM versions WHERE name = ? AND deleted_at IS NULL", (name,)
            ).fetchone()["n"]
            for tag in self._q(db, "SELECT tag, version FROM tags WHERE name = ?", (name,)).fetchall():
                self._tag_moved(db, name, tag["tag"], tag["version"], None, author, now)
            self._q(db, "DELETE FROM tags WHERE name = ?", (name,))
            self._q(
                db,
                "UPDATE versions SET deleted_at = ?, deleted_by = ? WHERE name = ? AND deleted_at IS NULL",
                (now, author, name),
            )
            self._q(db, "UPDATE configs SET deleted_at = ?, deleted_by = ? WHERE name = ?", (now, author, name))
        return count

    def set_tag(self, name: str, tag: str, version: int, author: str = "") -> StoredConfig:
        """Point `tag` at a live `version`, moving it if it exists; the move is kept in the history."""
        with self._write() as db:
            row = self._config_row(db, name, lock=True)
            self._live(name, row, "list the registry with `specwire config list` (ListConfigs)")
            now = self._now(db, name)
            self._version_row(db, name, version, row["latest_version"])
            old = self._q(db, "SELECT version FROM tags WHERE name = ? AND tag = ?", (name, tag)).fetchone()
            old_version = None if old is None else old["version"]
            if old_version != version:
                self._q(
                    db,
                    "INSERT INTO tags (name, tag, version) VALUES (?, ?, ?) "
                    "ON CONFLICT (name, tag) DO UPDATE SET version = excluded.version",
                    (name, tag, version),
                )
                self._tag_moved(db, name, tag, old_version, version, author, now)
        return self.get(name, version)

    def delete_tag(self, name: str, tag: str, author: str = "") -> int:
        """Remove `tag` of a live config; the removal is kept in the history. Returns the version it named."""
        with self._write() as db:
            row = self._config_row(db, name, lock=True)
            self._live(name, row, "list the registry with `specwire config list` (ListConfigs)")
            now = self._now(db, name)
            old = self._q(db, "SELECT version FROM tags WHERE name = ? AND tag = ?", (name, tag)).fetchone()
            if old is None:
                raise NotFound(f"config {name!r} has no tag {tag!r}; its history: `specwire config history {name}`")
            self._q(db, "DELETE FROM tags WHERE name = ? AND tag = ?", (name, tag))
            self._tag_moved(db, name, tag, old["version"], None, author, now)
        return old["version"]

    def _tag_moved(self, db, name, tag, old_version, new_version, author, now) -> None:
        self._q(
            db,
            "INSERT INTO tag_moves (name, tag, old_version, new_version, author, moved_at) VALUES (?, ?, ?, ?, ?, ?)",
            (name, tag, old_version, new_version, author, now),
        )
