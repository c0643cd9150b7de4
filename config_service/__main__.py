"""`config-service`: the GenerationConfig registry server.

Usage: config-service --host 127.0.0.1 --port 50051 --db registry.db
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from config_service.service import ConfigServicer
from config_service.storage import ConfigStore
from specwire.config.v1 import config_service_pb2_grpc as pb_grpc
from specwire.paths import default_registry
from specwire.serving import GrpcServer, ServiceBinding, run_until_signal, setup_logging
from specwire.telemetry import setup_telemetry

SERVICE_NAME = "specwire.config.v1.ConfigService"


def build_server(db: str, host: str = "127.0.0.1", port: int = 0, grace: float = 10.0) -> GrpcServer:
    """A ready-to-start config server over the SQLite file `db`."""
    store = ConfigStore(db)
    binding = ServiceBinding(pb_grpc.add_ConfigServiceServicer_to_server, ConfigServicer(store), SERVICE_NAME)
    return GrpcServer([binding], host=host, port=port, grace=grace)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="config-service", description="specwire GenerationConfig registry")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=50051, help="port to bind, 0 for any free one (default 50051)"
    )
    parser.add_argument(
        "--db",
        default=str(default_registry()),
        help="SQLite file, created if missing (default: %(default)s; SPECWIRE_HOME moves it)",
    )
    parser.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    setup_telemetry("specwire-config")  # OTEL_* / SPECWIRE_PROMETHEUS_PORT; nothing when unset
    Path(args.db).parent.mkdir(parents=True, exist_ok=True)
    server = build_server(args.db, args.host, args.port, args.grace)
    logging.getLogger("specwire.config_service").info("registry database: %s", args.db)
    run_until_signal(server, "config-service")


if __name__ == "__main__":
    main()
