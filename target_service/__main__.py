"""`target-service`: serves generation on one model.

Usage: target-service --host 127.0.0.1 --port 50052 --model default [--config-address A]
       [--draft-address A] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import asyncio

from specwire.models import load_model
from specwire.serving import GrpcServer, ServiceBinding, setup_logging
from specwire.target.v1 import target_service_pb2_grpc as pb_grpc
from target_service.config_resolver import ConfigResolver
from target_service.drafting import DraftPolicy
from target_service.service import TargetServicer

SERVICE_NAME = "specwire.target.v1.TargetService"


def build_server(
    loaded,
    config_address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    grace: float = 30.0,
    drafting: DraftPolicy | None = None,
) -> GrpcServer:
    """A ready-to-start target server over an already loaded model."""
    servicer = TargetServicer(loaded, ConfigResolver(config_address), drafting)
    return GrpcServer([ServiceBinding(pb_grpc.add_TargetServiceServicer_to_server, servicer, SERVICE_NAME)],
                      host=host, port=port, grace=grace)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="target-service", description="specwire target (generation) service")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50052, help="port to bind, 0 for any free one (default 50052)")
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), a folder, a .gguf file or a Hub repo id")
    parser.add_argument("--config-address", default=None, help="host:port of the config service (for config_ref)")
    parser.add_argument("--draft-address", default=None,
                        help="draft service: host:port, or dns:///name:port to spread streams over replicas")
    parser.add_argument("--default-proposer", default="none", choices=["none", "prompt_lookup", "draft_model"],
                        help="drafter for requests that choose none (prompt_lookup_num_tokens always picks prompt lookup)")
    parser.add_argument("--draft-timeout", type=float, default=5.0,
                        help="seconds a draft answer may take before the request falls back to plain decoding")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    drafting = DraftPolicy(args.draft_address, args.default_proposer, args.draft_timeout)
    server = build_server(loaded, args.config_address, args.host, args.port, args.grace, drafting)
    asyncio.run(server.serve_until_signal())


if __name__ == "__main__":
    main()
