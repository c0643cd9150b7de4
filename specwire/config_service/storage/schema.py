"""The registry's schema, once for every backend: forward-only migrations written in SQLite's SQL, and
the few dialect differences PostgreSQL needs, applied by `Dialect.sql` to every statement.

Statements use `?` placeholders and three tokens: `{id_pk}` (an auto-numbered primary key),
`{for_update}` (lock the row read for the rest of the transaction) and `{binary}` (compare and order
names byte by byte, whatever the database's collation).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

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
    # 2: immutable references and history. A delete leaves tombstones (the config row and its versions
    # marked deleted, the version counter kept) so `name@N` never names another config; every version
    # records its author; every tag move is kept. Versions written before this migration have the
    # author 'unrecorded'.
    [
        "ALTER TABLE configs ADD COLUMN deleted_at REAL",
        "ALTER TABLE configs ADD COLUMN deleted_by TEXT",
        "ALTER TABLE versions ADD COLUMN author TEXT NOT NULL DEFAULT 'unrecorded'",
        "ALTER TABLE versions ADD COLUMN deleted_at REAL",
        "ALTER TABLE versions ADD COLUMN deleted_by TEXT",
        """CREATE TABLE tag_moves (
               id {id_pk},
               name TEXT NOT NULL REFERENCES configs(name),
               tag TEXT NOT NULL,
               old_version INTEGER,
               new_version INTEGER,
               author TEXT NOT NULL,
               moved_at REAL NOT NULL
           )""",
        "CREATE INDEX tag_moves_by_name ON tag_moves (name, moved_at)",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class Dialect:
    """How one database spells the schema's few non-portable pieces."""

    name: str
    placeholder: str
    id_pk: str
    for_update: str
    binary: str
    # PostgreSQL's REAL is 4 bytes (a timestamp to ~2 minutes); SQLite's is 8. Migration 1 says REAL.
    real: str = "REAL"

    def sql(self, statement: str) -> str:
        """`statement` as this database reads it."""
        return _translate(self, statement)


@functools.lru_cache(maxsize=512)
def _translate(dialect: Dialect, statement: str) -> str:
    text = (
        statement.replace("{id_pk}", dialect.id_pk)
        .replace("{for_update}", dialect.for_update)
        .replace("{binary}", dialect.binary)
    )
    text = re.sub(r"\bREAL\b", dialect.real, text)
    # No statement holds a `?` or a `%` inside a literal, so a plain replace is exact.
    return text.replace("?", dialect.placeholder) if dialect.placeholder != "?" else text


SQLITE = Dialect(name="sqlite", placeholder="?", id_pk="INTEGER PRIMARY KEY AUTOINCREMENT", for_update="", binary="")
POSTGRES = Dialect(
    name="postgresql",
    placeholder="%s",
    id_pk="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
    for_update=" FOR UPDATE",
    # The database's collation (often en_US.UTF-8) would order `a-1` and `a1` unlike SQLite, and pages
    # follow that order: compare names as bytes, like SQLite's default BINARY collation.
    binary=' COLLATE "C"',
    real="DOUBLE PRECISION",
)
