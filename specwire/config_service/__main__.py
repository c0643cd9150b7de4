"""`config-service`: the GenerationConfig registry server.

Usage:
    config-service --host 127.0.0.1 --port 50051 --db registry.db   # serve (SQLite, the default)
    SPECWIRE_DB=postgresql://user:pass@db:5432/registry config-service --host 0.0.0.0   # PostgreSQL
    config-service --read-only ...                                  # a read replica: writes refused
    config-service backup PATH --db registry.db                     # safe while serving
    config-service restore PATH --db registry.db [--force]          # with the service stopped
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import sys
from pathlib import Path

from specwire.config.v1 import config_service_pb2_grpc as pb_grpc
from specwire.config_service.backup import backup, restore
from specwire.config_service.service import DEFAULT_MAX_CONFIG_BYTES, DEFAULT_MAX_EXTRA_BYTES, ConfigServicer
from specwire.config_service.storage import is_postgres_url, open_store
from specwire.errors import SpecwireError
from specwire.paths import default_registry
from specwire.security.access import ServerAccess, access_from_args, add_access_arguments
from specwire.serving import (
    DEFAULT_MAX_MESSAGE_BYTES,
    GrpcServer,
    ServiceBinding,
    add_capacity_arguments,
    check_transport_security,
    run_until_signal,
    setup_logging,
)
from specwire.telemetry import setup_telemetry

SERVICE_NAME = "specwire.config.v1.ConfigService"
# `--db` when the flag is not given: a URL with a password then comes from a secret, not the command line.
DB_ENV = "SPECWIRE_DB"
# Registry calls are short; this bounds the memory of a burst (every call holds its request).
DEFAULT_MAX_CONCURRENT_RPCS = 256


def describe_db(db: str) -> str:
    """`--db` as logs may show it: a PostgreSQL URL without its password."""
    if is_postgres_url(db):
        from specwire.config_service.storage.postgres import redacted

        return redacted(db)
    return db


def build_server(
    db: str,
    host: str = "127.0.0.1",
    port: int = 0,
    grace: float = 10.0,
    max_config_bytes: int = DEFAULT_MAX_CONFIG_BYTES,
    max_extra_bytes: int = DEFAULT_MAX_EXTRA_BYTES,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_concurrent_rpcs: int | None = DEFAULT_MAX_CONCURRENT_RPCS,
    access: ServerAccess | None = None,
) -> GrpcServer:
    """A ready-to-start config server over `db`, a SQLite file or a `postgresql://` URL (size caps: see
    `ConfigServicer`).

    `access` holds `--read-only`, `--allow-anonymous-writes` and `--allow-insecure-token` (default: their
    environment variables); the credentials come from the environment (`specwire.security.access`).
    """
    store = open_store(db)
    servicer = ConfigServicer(store, max_config_bytes, max_extra_bytes)
    binding = ServiceBinding(pb_grpc.add_ConfigServiceServicer_to_server, servicer, SERVICE_NAME)
    return GrpcServer(
        [binding],
        host=host,
        port=port,
        grace=grace,
        max_message_bytes=max_message_bytes,
        max_concurrent_rpcs=max_concurrent_rpcs,
        access=access,
        on_stop=store.close,  # PostgreSQL: its connection pool
    )


def _db_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=os.environ.get(DB_ENV) or str(default_registry()),
        help="the registry database: a SQLite file, created if missing, or a PostgreSQL URL "
        "postgresql://USER:PASSWORD@HOST:PORT/DATABASE (needs the `postgres` extra) for several replicas "
        f"(env {DB_ENV}, which keeps a password off the command line; default: {default_registry()}; "
        "SPECWIRE_HOME moves it)",
    )


def copy_main(command: str, argv: list[str]) -> None:
    """`config-service backup PATH` / `config-service restore PATH`: exits 1 with the reason on refusal."""
    parser = argparse.ArgumentParser(
        prog=f"config-service {command}",
        description="copy the registry database to PATH (safe while the service runs)"
        if command == "backup"
        else "replace the registry database with the backup PATH (stop the service first)",
    )
    parser.add_argument("path", help="the backup file")
    _db_argument(parser)
    parser.add_argument("--force", action="store_true", help="replace the file written to if it exists")
    args = parser.parse_args(argv)
    if is_postgres_url(args.db):
        sys.exit(
            f"config-service {command}: the registry is in PostgreSQL ({describe_db(args.db)}): "
            + (
                "back it up with pg_dump, e.g. `pg_dump --format=custom --file PATH DATABASE_URL`"
                if command == "backup"
                else "restore it with pg_restore, e.g. `pg_restore --clean --dbname DATABASE_URL PATH`"
            )
        )
    try:
        if command == "backup":
            backup(args.db, args.path, force=args.force)
        else:
            restore(args.path, args.db, force=args.force)
    except (SpecwireError, OSError, sqlite3.Error) as exc:
        sys.exit(f"config-service {command}: {exc}")
    print(f"{command}: {args.db} {'->' if command == 'backup' else '<-'} {args.path}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Subcommands are matched by hand: the serving flags (`config-service --port ...`) stay as they were.
    if argv and argv[0] in ("backup", "restore"):
        copy_main(argv[0], argv[1:])
        return
    parser = argparse.ArgumentParser(
        prog="config-service",
        description="specwire GenerationConfig registry (also: `config-service backup|restore PATH --db DB`)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051, help="port to bind, 0 for any free one (default 50051)")
    _db_argument(parser)
    parser.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    parser.add_argument(
        "--max-config-bytes",
        type=int,
        default=DEFAULT_MAX_CONFIG_BYTES,
        help=f"size of one config (wire form or imported JSON), refused before parsing "
        f"(default {DEFAULT_MAX_CONFIG_BYTES})",
    )
    parser.add_argument(
        "--max-extra-bytes",
        type=int,
        default=DEFAULT_MAX_EXTRA_BYTES,
        help=f"size of a config's extra (custom) entries (default {DEFAULT_MAX_EXTRA_BYTES})",
    )
    add_capacity_arguments(parser, DEFAULT_MAX_CONCURRENT_RPCS)
    add_access_arguments(parser, registry=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    check_transport_security("config-service")  # TLS settings that fail closed, before the registry opens
    setup_telemetry("specwire-config")  # OTEL_* / SPECWIRE_PROMETHEUS_PORT; nothing when unset
    if not is_postgres_url(args.db):
        Path(args.db).parent.mkdir(parents=True, exist_ok=True)
    try:
        server = build_server(
            args.db,
            args.host,
            args.port,
            args.grace,
            args.max_config_bytes,
            args.max_extra_bytes,
            args.max_message_bytes,
            args.max_concurrent_rpcs,
            access_from_args(args),
        )
    except SpecwireError as exc:  # an unreachable database, a newer schema: one line, not a traceback
        sys.exit(f"config-service: {exc}")
    logging.getLogger("specwire.config_service").info("registry database: %s", describe_db(args.db))
    run_until_signal(server, "config-service")


if __name__ == "__main__":
    main()
