"""Storage of the config registry: the rules (`store`), the schema (`schema`), and the backends:
SQLite (`sqlite`, the embedded default) and PostgreSQL (`postgres`, for several replicas).

`open_store(db)` picks the backend from `--db`: a `postgresql://` (or `postgres://`) URL, else a file.
"""

from __future__ import annotations

from specwire.config_service.storage.schema import MIGRATIONS, SCHEMA_VERSION
from specwire.config_service.storage.sqlite import SQLiteStore
from specwire.config_service.storage.store import (
    HistoryEntry,
    RegistryStore,
    StorageError,
    StoredConfig,
    decode_history_token,
    decode_page_token,
    encode_page_token,
)
from specwire.errors import FailedPrecondition

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(db: str) -> bool:
    """Whether `--db` names a PostgreSQL database rather than a SQLite file."""
    return db.startswith(POSTGRES_SCHEMES)


def open_store(db: str) -> RegistryStore:
    """The registry store `--db` names: PostgreSQL for a `postgresql://` URL, else the SQLite file."""
    if is_postgres_url(db):
        try:
            from specwire.config_service.storage.postgres import PostgresStore
        except ImportError as exc:
            raise FailedPrecondition(
                f"--db is a PostgreSQL URL but psycopg is not installed ({exc}): pip install 'specwire[postgres]'"
            ) from exc
        return PostgresStore(db)
    return SQLiteStore(db)


__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "HistoryEntry",
    "RegistryStore",
    "SQLiteStore",
    "StorageError",
    "StoredConfig",
    "decode_history_token",
    "decode_page_token",
    "encode_page_token",
    "is_postgres_url",
    "open_store",
]
