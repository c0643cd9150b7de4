"""`target-service`: serves generation on one model.

Usage: target-service --host 127.0.0.1 --port 50052 --model default [--config-address A]
       [--draft-address A] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import asyncio
import os

from specwire.generation.drafters import PROMPT_LOOKUP_RULES
from specwire.heap import fix_mmap_threshold
from specwire.models import ModelLoadError, load_model
from specwire.serving import GrpcServer, ServiceBinding, setup_logging
from specwire.target.v1 import target_service_pb2_grpc as pb_grpc
from specwire.telemetry import setup_telemetry
from target_service.config_resolver import ConfigResolver
from target_service.drafting import DraftPolicy
from target_service.scheduler import SCHEDULERS, SchedulerOptions
from target_service.service import TargetServicer

SERVICE_NAME = "specwire.target.v1.TargetService"
# The scheduler when none is given; SPECWIRE_TARGET_SCHEDULER overrides it (deployments, and running
# the whole test suite against the sequential one). Measured on 2 CPU cores with SmolLM2, 64 new
# tokens: batched 29.1 tokens/s for one client and 95.9 for 8; sequential 26.8 and 25.4.
DEFAULT_SCHEDULER = os.environ.get("SPECWIRE_TARGET_SCHEDULER", "batched")


def build_server(
    loaded,
    config_address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    grace: float = 30.0,
    drafting: DraftPolicy | None = None,
    scheduler: str = DEFAULT_SCHEDULER,
    scheduler_options: SchedulerOptions | None = None,
    stuck_after: float = 60.0,
) -> GrpcServer:
    """A ready-to-start target server over an already loaded model.

    `scheduler` is `"sequential"` (one request per forward) or `"batched"` (requests share forwards;
    `scheduler_options` sets its limits), see `target_service.scheduler`. Health follows the engine's
    liveness (`stuck_after`: seconds without progress while work waits before it counts as stuck).
    """
    servicer = TargetServicer(
        loaded, ConfigResolver(config_address), drafting, scheduler, scheduler_options, stuck_after
    )
    return GrpcServer(
        [ServiceBinding(pb_grpc.add_TargetServiceServicer_to_server, servicer, SERVICE_NAME)],
        host=host,
        port=port,
        grace=grace,
        liveness=servicer.liveness,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="target-service", description="specwire target (generation) service")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50052, help="port to bind, 0 for any free one (default 50052)")
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct), a folder, a .gguf file or a Hub repo id",
    )
    parser.add_argument("--config-address", default=None, help="host:port of the config service (for config_ref)")
    parser.add_argument(
        "--draft-address",
        default=None,
        help="draft service: host:port, or dns:///name:port to spread streams over replicas",
    )
    parser.add_argument(
        "--default-proposer",
        default="none",
        choices=["none", "prompt_lookup", "draft_model"],
        help="drafter for requests that choose none (prompt_lookup_num_tokens always picks prompt lookup)",
    )
    parser.add_argument(
        "--draft-timeout",
        type=float,
        default=5.0,
        help="seconds a draft answer may take before the request falls back to plain decoding",
    )
    parser.add_argument(
        "--prompt-lookup-rule",
        default="longest",
        choices=list(PROMPT_LOOKUP_RULES),
        help="prompt lookup without a draft service: longest (the longest earlier suffix match of 2+ "
        "tokens) or transformers (its exact rule); outputs are the same, drafts differ (default longest)",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument(
        "--scheduler",
        default=DEFAULT_SCHEDULER,
        choices=list(SCHEDULERS),
        help=f"batched: one forward per step for all running requests; sequential: one request "
        f"per forward (default {DEFAULT_SCHEDULER})",
    )
    defaults = SchedulerOptions()
    parser.add_argument(
        "--max-batch-rows",
        type=int,
        default=defaults.max_batch_rows,
        help="batched: rows (KV slots) running at once",
    )
    parser.add_argument(
        "--max-tokens-per-step",
        type=int,
        default=defaults.max_tokens_per_step,
        help="batched: tokens per forward (prefills are chunked to fit)",
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=defaults.max_queued,
        help="batched: requests waiting for a slot before RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--slot-tokens",
        type=int,
        default=None,
        help="batched: positions per KV slot (default min(context, 2048); longer requests run alone)",
    )
    parser.add_argument(
        "--kv-cache-mb",
        type=float,
        default=defaults.kv_cache_mb,
        help="batched: memory budget of the KV slots",
    )
    parser.add_argument(
        "--max-lane-requests",
        type=int,
        default=defaults.max_lane_requests,
        help="batched: requests running at once in the sequential lane (no cache, guidance, too wide or "
        "too long for a slot), whose KV caches are outside --kv-cache-mb",
    )
    parser.add_argument(
        "--packed-forward",
        default="lean",
        choices=["lean", "transformers"],
        help="batched: run packed forwards through specwire's lean decoder (Llama-layout models whose "
        "logits it reproduces bitwise, checked at start-up) or always through the model's own forward "
        "(default lean)",
    )
    parser.add_argument(
        "--stuck-after",
        type=float,
        default=60.0,
        help="seconds the model may make no progress while requests wait before health says NOT_SERVING "
        "and new requests fail UNAVAILABLE (default 60)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    fix_mmap_threshold()  # freed tensors go back to the system (see specwire.heap)
    setup_telemetry("specwire-target")  # OTEL_* / SPECWIRE_PROMETHEUS_PORT; nothing when unset
    try:
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    except ModelLoadError as error:  # what was tried and the fix, without a traceback
        raise SystemExit(f"target-service: {error}") from None
    drafting = DraftPolicy(
        args.draft_address, args.default_proposer, args.draft_timeout, prompt_lookup_rule=args.prompt_lookup_rule
    )
    options = SchedulerOptions(
        max_batch_rows=args.max_batch_rows,
        max_tokens_per_step=args.max_tokens_per_step,
        max_queued=args.max_queued,
        slot_tokens=args.slot_tokens,
        kv_cache_mb=args.kv_cache_mb,
        max_lane_requests=args.max_lane_requests,
        lean_forward=args.packed_forward == "lean",
    )
    server = build_server(
        loaded,
        args.config_address,
        args.host,
        args.port,
        args.grace,
        drafting,
        args.scheduler,
        options,
        args.stuck_after,
    )
    asyncio.run(server.serve_until_signal())


if __name__ == "__main__":
    main()
