"""`draft-service`: proposes speculative tokens for target services.

Usage: draft-service --host 127.0.0.1 --port 50053 [--model M] [--device D] [--dtype T]
                     [--prompt-lookup-rule longest|transformers]
                     [--max-sessions N] [--session-idle-timeout S]

Prompt lookup is always available on the stream; `--model` adds a draft model (`default-int8` is the
embedded SmolLM2 quantized to int8, a realistic CPU draft). A target service asks only for the model: it runs
prompt lookup in its own process (no model needed, and no round trip per round).
"""

from __future__ import annotations

import argparse

from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
from specwire.draft_service.service import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_IDLE_TIMEOUT_S, DraftServicer
from specwire.generation.speculation.drafters import PROMPT_LOOKUP_RULES
from specwire.heap import fix_mmap_threshold
from specwire.model_thread import exit_if_stuck
from specwire.models import ModelLoadError, load_model
from specwire.security.access import AccessPolicy, ServerAccess, access_from_args, add_access_arguments
from specwire.security.tokens import SecuritySettingsError
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

SERVICE_NAME = "specwire.draft.v1.DraftService"
# Draft streams served at once: one per speculating target request, open for its whole generation.
DEFAULT_MAX_CONCURRENT_RPCS = 512


def build_server(
    draft_model=None,
    host: str = "127.0.0.1",
    port: int = 0,
    grace: float = 10.0,
    prompt_lookup_rule: str = "longest",
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_concurrent_rpcs: int | None = DEFAULT_MAX_CONCURRENT_RPCS,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    session_idle_timeout_s: float | None = DEFAULT_SESSION_IDLE_TIMEOUT_S,
    access: ServerAccess | None = None,
) -> GrpcServer:
    """A ready-to-start draft server (prompt lookup, plus `draft_model` if given).

    `max_sessions` and `session_idle_timeout_s` bound the open sessions (see `DraftServicer`); `access`
    holds `--allow-insecure-token` (default: its environment variable).
    """
    servicer = DraftServicer(draft_model, prompt_lookup_rule, max_sessions, session_idle_timeout_s)
    # Streams are long-lived: a bounded connection age lets targets find replicas added by a scale-up.
    options = [("grpc.max_connection_age_ms", 300_000), ("grpc.max_connection_age_grace_ms", 60_000)]
    return GrpcServer(
        [ServiceBinding(pb_grpc.add_DraftServiceServicer_to_server, servicer, SERVICE_NAME)],
        host=host,
        port=port,
        grace=grace,
        options=options,
        max_message_bytes=max_message_bytes,
        max_concurrent_rpcs=max_concurrent_rpcs,
        access=access,
        on_stop=servicer.close,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _idle_timeout(text: str) -> float | None:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: never), got {value:g}")
    return value or None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="draft-service", description="specwire draft (speculation) service")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50053, help="port to bind, 0 for any free one (default 50053)")
    parser.add_argument(
        "--model",
        default=None,
        help="draft model: 'default-int8', 'default', a folder, a .gguf file or a Hub id (omit for prompt lookup only)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--prompt-lookup-rule",
        default="longest",
        choices=list(PROMPT_LOOKUP_RULES),
        help="prompt lookup on the stream (targets run their own, with their own rule): longest, the longest "
        "earlier suffix match of 2+ tokens; transformers, its exact rule (n-gram, then shorter ones down to 1). "
        "Outputs are the same; drafts differ (default longest)",
    )
    # Sessions: how many, and how long an idle one is kept.
    parser.add_argument(
        "--max-sessions",
        type=_positive_int,
        default=DEFAULT_MAX_SESSIONS,
        help="drafting sessions (one per target request, each with its KV caches) open at once; beyond "
        f"them a new stream gets RESOURCE_EXHAUSTED with a retry hint (default {DEFAULT_MAX_SESSIONS})",
    )
    parser.add_argument(
        "--session-idle-timeout",
        type=_idle_timeout,
        default=DEFAULT_SESSION_IDLE_TIMEOUT_S,
        help="seconds a stream may send nothing before it is ended with DEADLINE_EXCEEDED and its session "
        f"freed; 0 for never (default {DEFAULT_SESSION_IDLE_TIMEOUT_S:g})",
    )
    parser.add_argument("--grace", type=float, default=10.0, help="seconds open streams get on SIGTERM")
    add_capacity_arguments(parser, DEFAULT_MAX_CONCURRENT_RPCS, "draft streams")
    add_access_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    check_transport_security("draft-service")  # TLS settings that fail closed, before any model loads
    fix_mmap_threshold()  # freed tensors go back to the system (see specwire.heap)
    setup_telemetry("specwire-draft")  # OTEL_* / SPECWIRE_PROMETHEUS_PORT; nothing when unset
    access = access_from_args(args)
    try:  # the credentials checked before the model loads (the server checks them again at start)
        AccessPolicy.from_env(args.host, access)
    except SecuritySettingsError as error:
        raise SystemExit(f"draft-service: {error}") from None
    try:
        draft_model = load_model(args.model, device=args.device, dtype=args.dtype) if args.model else None
    except ModelLoadError as error:  # what was tried and the fix, without a traceback
        raise SystemExit(f"draft-service: {error}") from None
    server = build_server(
        draft_model,
        args.host,
        args.port,
        args.grace,
        args.prompt_lookup_rule,
        args.max_message_bytes,
        args.max_concurrent_rpcs,
        args.max_sessions,
        args.session_idle_timeout,
        access,
    )
    run_until_signal(server, "draft-service")
    exit_if_stuck("draft-service")


if __name__ == "__main__":
    main()
