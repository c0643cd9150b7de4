"""PostgreSQL storage of the config registry, for several registry replicas on one database.

The same schema and migrations as SQLite (`schema.py`, through the PostgreSQL `Dialect`), a psycopg 3
connection pool, and the same rules (`store.py`). What makes several writers safe:

- every write is one transaction that first locks its config's row (`SELECT ... FOR UPDATE`), so two
  replicas updating one name take turns and number their versions N + 1, N + 2, never the same N;
  two replicas creating one new name meet at its primary key (`ON CONFLICT DO NOTHING`): one creates,
  the other answers ALREADY_EXISTS;
- migrations run in one transaction under an advisory lock, with the schema version in the
  `specwire_schema` table, so replicas starting together migrate once;
- reads run in a REPEATABLE READ, READ ONLY transaction: one consistent snapshot per call.

Errors map like SQLite's: a lost connection, an unreachable server or an exhausted pool is UNAVAILABLE
(`StorageError`, nothing of a failed write stored), a unique violation ALREADY_EXISTS, a serialization
failure or deadlock ABORTED (retry); never INTERNAL.

Requires the `postgres` extra (`pip install 'specwire[postgres]'`: psycopg 3 and psycopg_pool).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg_pool
from psycopg.rows import dict_row

from specwire.config_service.storage.schema import MIGRATIONS, POSTGRES, SCHEMA_VERSION
from specwire.config_service.storage.store import RegistryStore, StorageError
from specwire.errors import Aborted, AlreadyExists, FailedPrecondition

log = logging.getLogger(__name__)

# pg_advisory_xact_lock key of the migrations: any fixed 64-bit number that other applications sharing
# the database are unlikely to use ("specwire" in ASCII).
MIGRATION_LOCK = 0x7370656377697265
DEFAULT_POOL_SIZE = 4
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# How long one registry call waits for a connection while the database is unreachable before it
# answers UNAVAILABLE: short, so a caller's deadline (the target's lookup) is left time to retry.
DEFAULT_CALL_TIMEOUT_S = 5.0


def redacted(url: str) -> str:
    """`url` with its password replaced by `***`, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[-1]}"))


class PostgresStore(RegistryStore):
    """The registry's tables in a PostgreSQL database.

    Args:
        url (`str`): a libpq URL, `postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?sslmode=...]`.
        pool_size (`int`, defaults to 4): most connections this process holds (the servicer makes at
            most two storage calls at once; the rest is headroom for a replaced broken connection).
        connect_timeout (`float`, defaults to 10.0): seconds to wait for the first connections at start.
        call_timeout (`float`, defaults to 5.0): seconds one call waits for a connection before UNAVAILABLE.
    """

    dialect = POSTGRES

    def __init__(
        self,
        url: str,
        pool_size: int = DEFAULT_POOL_SIZE,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        call_timeout: float = DEFAULT_CALL_TIMEOUT_S,
    ):
        self.url = url
        self.description = redacted(url)
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        # One direct connection first: the pool retries in the background and would only say "timed out";
        # this says why (wrong password, no such database, nothing listening).
        try:
            psycopg.connect(url, connect_timeout=max(1, int(connect_timeout))).close()
        except psycopg.Error as exc:
            raise StorageError(
                f"cannot connect to the registry database {self.description}: {str(exc).strip()}; "
                "check --db / SPECWIRE_DB (host, port, user, password, database) and that PostgreSQL is up"
            ) from exc
        self._pool = psycopg_pool.ConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            # autocommit: transactions are explicit (`conn.transaction()`), never left open by a read.
            kwargs={"autocommit": True, "row_factory": dict_row},
            # A connection the server dropped (restart, failover, idle timeout) is replaced on checkout
            # instead of failing the call that drew it.
            check=psycopg_pool.ConnectionPool.check_connection,
            timeout=call_timeout,
            name="specwire-registry",
            open=False,
        )
        self._pool.open(wait=True, timeout=connect_timeout)
        try:
            self._migrate()
        except BaseException:
            self._pool.close()
            raise

    def close(self) -> None:
        self._pool.close()

    @contextmanager
    def _transaction(self, read_only: bool) -> Iterator[psycopg.Connection[Any]]:
        try:
            with self._pool.connection() as conn, conn.transaction():
                if read_only:
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                yield conn
        except psycopg.errors.UniqueViolation as exc:
            raise AlreadyExists(
                f"another writer stored the same entry first ({exc.diag.message_detail}); re-read"
            ) from exc
        except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected) as exc:
            raise Aborted(f"a concurrent registry write conflicted with this one ({exc}); retry it") from exc
        except psycopg_pool.PoolTimeout as exc:
            raise StorageError(
                f"no connection to the registry database {self.description} within {self.call_timeout}s "
                f"({exc}); nothing was stored: check that PostgreSQL is up and reachable, then retry"
            ) from exc
        except psycopg.Error as exc:
            raise StorageError(
                f"the registry database {self.description} failed this call ({str(exc).strip()}); "
                "nothing of a write was stored: retry once PostgreSQL is reachable"
            ) from exc

    def _write(self):
        return self._transaction(read_only=False)

    def _read(self):
        return self._transaction(read_only=True)

    def schema_version(self) -> int:
        with self._transaction(read_only=True) as conn:
            row = conn.execute("SELECT version FROM specwire_schema").fetchone()
        return 0 if row is None else row["version"]

    def _migrate(self) -> None:
        """Bring the schema to `SCHEMA_VERSION`, in one transaction under an advisory lock: a second
        replica starting at the same moment waits, then finds the schema current."""
        with self._transaction(read_only=False) as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS specwire_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM specwire_schema").fetchone()
            if row is None:
                conn.execute("INSERT INTO specwire_schema (version) VALUES (0)")
            current = 0 if row is None else row["version"]
            if current > SCHEMA_VERSION:
                raise FailedPrecondition(
                    f"{self.description} has schema version {current}, newer than this server's {SCHEMA_VERSION}: "
                    "upgrade specwire instead of opening it with an older release"
                )
            for version in range(current, SCHEMA_VERSION):
                for statement in MIGRATIONS[version]:
                    conn.execute(self.dialect.sql(statement))
                conn.execute("UPDATE specwire_schema SET version = %s", (version + 1,))
                log.info("registry database %s migrated to schema version %d", self.description, version + 1)
