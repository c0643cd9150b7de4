"""`target-service`: serves generation on one model.

Usage: target-service --host 127.0.0.1 --port 50052 --model default [--config-address A]
       [--draft-address A | --draft-model M] [--dflash-model M] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from specwire.generation.plugins import PluginLoadError, PluginRegistry, load_plugins
from specwire.generation.speculation.drafters import PROMPT_LOOKUP_RULES
from specwire.heap import fix_mmap_threshold
from specwire.model_thread import exit_if_stuck, without_thread_pool
from specwire.models import ModelLoadError, load_model
from specwire.models.dflash_assistant import load_dflash_assistant
from specwire.runtime.lean_draft import draft_decoder
from specwire.security.access import (
    ALLOW_INSECURE_TOKEN_ENV,
    AccessPolicy,
    ServerAccess,
    access_from_args,
    add_access_arguments,
)
from specwire.security.channels import check_token_transport
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
from specwire.target.v1 import target_service_pb2_grpc as pb_grpc
from specwire.target_service.admission import DEFAULT_MAX_PREPARING, DEFAULT_PREPARE_WORKERS, PreparationPool
from specwire.target_service.config_resolver import DEFAULT_STALE_MAX_S, ConfigResolver
from specwire.target_service.drafting import DraftPolicy, check_draft_model, draft_overlap_choice
from specwire.target_service.limits import RequestLimits, default_output_bytes
from specwire.target_service.scheduler.options import SchedulerKind, SchedulerOptions
from specwire.target_service.service import TargetServicer
from specwire.target_service.tensor_parallel import load_target, rank_from_env, run_follower, tensor_parallel_size
from specwire.telemetry import setup_telemetry
from specwire.vocabulary import PROPOSER_DFLASH, PROPOSER_EARLY_EXIT, PROPOSER_MTP, PROPOSER_NONE, PROPOSERS

SERVICE_NAME = "specwire.target.v1.TargetService"
# The scheduler when none is given; SPECWIRE_TARGET_SCHEDULER overrides it (deployments, and running
# the whole test suite against the sequential one). Measured on 2 CPU cores with SmolLM2, 64 new
# tokens: batched 29.1 tokens/s for one client and 95.9 for 8; sequential 26.8 and 25.4.
DEFAULT_SCHEDULER = os.environ.get("SPECWIRE_TARGET_SCHEDULER", "batched")
# Generate calls and streams served at once; the scheduler's own limits (--max-batch-rows running,
# --max-queued waiting, --max-lane-requests) refuse earlier under normal settings.
DEFAULT_MAX_CONCURRENT_RPCS = 256


def build_server(
    loaded,
    config_address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    grace: float = 30.0,
    drafting: DraftPolicy | None = None,
    scheduler: SchedulerKind | str = DEFAULT_SCHEDULER,
    scheduler_options: SchedulerOptions | None = None,
    limits: RequestLimits | None = None,
    pool: PreparationPool | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_concurrent_rpcs: int | None = DEFAULT_MAX_CONCURRENT_RPCS,
    stuck_after: float = 60.0,
    config_stale_max: float = DEFAULT_STALE_MAX_S,
    access: ServerAccess | None = None,
    plugins: PluginRegistry | None = None,
) -> GrpcServer:
    """A ready-to-start target server over an already loaded model.

    `scheduler` is `SchedulerKind.SEQUENTIAL` (one request per forward) or `BATCHED` (requests share
    forwards; `scheduler_options` sets its limits), see `specwire.target_service.scheduler`. `limits` caps what one
    request may ask (default `RequestLimits.for_model`, its output budget fitted to
    `max_message_bytes`); `pool` prepares requests off the event loop (see `specwire.target_service.admission`).
    Health follows the engine's liveness (`stuck_after`: seconds without progress while work waits
    before it counts as stuck). `config_stale_max` is the oldest a registry config may be when it is
    served from cache because the registry is unreachable (0: never; see `ConfigResolver`). `access`
    holds `--allow-insecure-token` (default: its environment variable). `plugins` are the server plugins
    requests may name (`load_plugins`, `--plugins`; none by default).
    """
    if limits is None:
        limits = RequestLimits.for_model(
            loaded.max_position_embeddings, max_output_bytes=default_output_bytes(max_message_bytes)
        )
    servicer = TargetServicer(
        loaded,
        ConfigResolver(config_address, stale_max_s=config_stale_max),
        drafting,
        scheduler,
        scheduler_options,
        limits=limits,
        pool=pool,
        max_message_bytes=max_message_bytes,
        stuck_after_s=stuck_after,
        plugins=plugins,
    )
    return GrpcServer(
        [ServiceBinding(pb_grpc.add_TargetServiceServicer_to_server, servicer, SERVICE_NAME)],
        host=host,
        port=port,
        grace=grace,
        max_message_bytes=max_message_bytes,
        max_concurrent_rpcs=max_concurrent_rpcs,
        liveness=servicer.liveness,
        access=access,
        on_stop=servicer.close,  # joins threads that may still post to the server's loop
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
        "--config-stale-max",
        type=float,
        default=DEFAULT_STALE_MAX_S,
        help="seconds a registry config (name or name:tag) may be served from cache, with a warning in the "
        "response, while the config service is unreachable; 0 fails such requests at once "
        f"(default {DEFAULT_STALE_MAX_S:g})",
    )
    parser.add_argument(
        "--draft-address",
        default=None,
        help="draft service: host:port, or dns:///name:port to spread streams over replicas",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="a draft model run in this process, no draft service (single-box deployments): 'default-int8', "
        "'default', a folder, a .gguf file or a Hub id, with the target's tokenizer; excludes --draft-address",
    )
    parser.add_argument(
        "--default-proposer",
        default=PROPOSER_NONE,
        # early_exit needs each request's layer count (assistant_early_exit), which also selects it; mtp is
        # selected by use_mtp and runs only on models with MTP layers.
        # dflash is selected by speculation_type="dflash" (transformers' switch for it).
        choices=[p for p in PROPOSERS if p not in (PROPOSER_EARLY_EXIT, PROPOSER_MTP, PROPOSER_DFLASH)],
        help="drafter for requests that choose none (prompt_lookup_num_tokens always picks prompt lookup, "
        "assistant_early_exit the early-exit draft, use_mtp the model's MTP layers, speculation_type='dflash' "
        "the --dflash-model assistant)",
    )
    parser.add_argument(
        "--dflash-model",
        default=None,
        # Not --draft-model: a DFlash assistant is no causal LM (no LM head, no tokenizer; it drafts through the
        # target's embeddings and head from its hidden states), so it cannot serve proposer draft_model, and it
        # can sit beside a draft model or a draft service.
        help="a DFlash assistant (e.g. a muse_glimmer_assistant checkpoint: folder or Hub id) run in this process "
        "for speculation_type='dflash' requests, on the target's device and dtype; checked against the target at "
        "start",
    )
    parser.add_argument(
        "--draft-overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="with --draft-address: let the draft service draft the next block ahead while this target verifies "
        "(on), or wait for each block (off); auto: on, unless this target runs on CPU and the draft service is "
        "on this machine (loopback or a Unix socket), where both would compute on the same cores: say on when "
        "they are pinned to separate ones (outputs are the same either way; default auto)",
    )
    parser.add_argument(
        "--no-draft-overlap",
        dest="draft_overlap",
        action="store_const",
        const="off",
        help="the same as --draft-overlap off",
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
        help="prompt lookup, which runs in this process even with a draft service: longest (the longest earlier "
        "suffix match of 2+ tokens) or transformers (its exact rule); outputs are the same, drafts differ "
        "(default longest)",
    )
    parser.add_argument(
        "--no-adaptive-speculation",
        dest="adaptive_speculation",
        action="store_false",
        help="turn the adaptive speculation controller off: requests that name no draft length draft "
        "transformers' constant 20 tokens a round (prompt lookup: 10) instead of the length the controller "
        "measures to be fastest (default: on)",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--attn-implementation",
        default=None,
        choices=["eager", "sdpa"],
        help="the model's attention implementation; eager computes attention weights (output_attentions) "
        "but cannot run the batched scheduler's packed forwards, so every request runs one per forward "
        "(default: the model's own, sdpa for most)",
    )
    parser.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument(
        "--scheduler",
        default=None,
        choices=[kind.value for kind in SchedulerKind],
        help=f"batched: one forward per step for all running requests; sequential: one request "
        f"per forward (default {DEFAULT_SCHEDULER})",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        help="shard the model over N processes with transformers' tensor parallelism (tp_plan='auto'): this "
        "process serves as rank 0 and starts ranks 1..N-1; on the CPU over gloo, with --device cuda over nccl "
        "with one GPU per rank; serves with the sequential scheduler. Under torchrun --nproc-per-node N the "
        "ranks come from its environment instead (default 1: no sharding)",
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
        default=None,
        choices=["lean", "transformers"],
        help="batched: run packed forwards through specwire's lean decoder (Llama-layout models whose "
        "logits it reproduces bitwise, checked at start-up; on float32 CPU weights it computes blocks of "
        "2-4 tokens the faster way round, each token's projections bitwise those of a forward of it "
        "alone, where checked to hold) or always through the model's own forward "
        "(default lean; transformers with --tensor-parallel, whose sharded layers only the model's own "
        "forward runs)",
    )
    add_limit_arguments(parser)
    add_access_arguments(parser)
    parser.add_argument(
        "--stuck-after",
        type=float,
        default=60.0,
        help="seconds the model may make no progress while requests wait before health says NOT_SERVING "
        "and new requests fail UNAVAILABLE (default 60)",
    )
    parser.add_argument(
        "--plugins",
        default=os.environ.get("SPECWIRE_TARGET_PLUGINS", ""),
        help="comma-separated server plugins to load (entry points in the groups specwire.logits_processors, "
        "specwire.stopping_criteria and specwire.generate_methods of installed packages), which requests may "
        "then name; a missing or broken one refuses to start (default: none; env SPECWIRE_TARGET_PLUGINS)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The per-request limits (`specwire.target_service.limits`), message size, RPC and preparation caps."""
    limits = parser.add_argument_group("request limits (refused with INVALID_ARGUMENT before any model work)")
    defaults = RequestLimits(max_model_len=2)
    limits.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt tokens + new tokens per row; a request that sets no length is clipped to it "
        "(default: the model's max_position_embeddings)",
    )
    limits.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="new tokens per row; lengths the request did not set are clipped to it (default: no cap but "
        "--max-model-len)",
    )
    limits.add_argument(
        "--max-request-rows",
        type=int,
        default=defaults.max_request_rows,
        help="rows one request decodes, prompts x max(num_beams, num_return_sequences); not --max-batch-rows, "
        f"the KV slots shared by all requests (default {defaults.max_request_rows})",
    )
    limits.add_argument(
        "--max-prompts",
        type=int,
        default=defaults.max_prompts,
        help=f"prompts per request (default {defaults.max_prompts})",
    )
    limits.add_argument(
        "--max-beams", type=int, default=defaults.max_beams, help=f"num_beams (default {defaults.max_beams})"
    )
    limits.add_argument(
        "--max-stop-strings",
        type=int,
        default=defaults.max_stop_strings,
        help=f"entries of stop_strings (default {defaults.max_stop_strings})",
    )
    limits.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=defaults.max_stop_string_chars,
        help=f"characters of one stop string (default {defaults.max_stop_string_chars})",
    )
    limits.add_argument(
        "--max-bias-entries",
        type=int,
        default=defaults.max_bias_entries,
        help=f"token ids in sequence_bias + bad_words_ids + force_words_ids (default {defaults.max_bias_entries})",
    )
    limits.add_argument(
        "--max-output-bytes",
        type=int,
        default=None,
        help="bytes of output_scores + output_logits in one response, rows x new tokens x vocab x 4 per "
        "tensor, computed before decoding (default 3/4 of --max-message-bytes: the response must fit in one "
        "message)",
    )
    limits.add_argument(
        "--max-prompt-chars",
        type=int,
        default=defaults.max_prompt_chars,
        help="characters of prompt text per request, checked before tokenization "
        f"(default {defaults.max_prompt_chars})",
    )
    server = parser.add_argument_group("server capacity (refused with RESOURCE_EXHAUSTED and retry-after-s)")
    add_capacity_arguments(server, DEFAULT_MAX_CONCURRENT_RPCS, "Generate calls and streams")
    server.add_argument(
        "--prepare-workers",
        type=int,
        default=DEFAULT_PREPARE_WORKERS,
        help=f"threads that validate and tokenize requests off the event loop (default {DEFAULT_PREPARE_WORKERS})",
    )
    server.add_argument(
        "--max-preparing",
        type=int,
        default=DEFAULT_MAX_PREPARING,
        help=f"requests being validated/tokenized or waiting for a worker (default {DEFAULT_MAX_PREPARING})",
    )


def limits_from_args(args: argparse.Namespace, max_position_embeddings: int | None) -> RequestLimits:
    """The `RequestLimits` the flags ask for (ValueError naming the bad flag)."""
    max_output_bytes = args.max_output_bytes or default_output_bytes(args.max_message_bytes)
    if max_output_bytes > args.max_message_bytes:
        raise ValueError(
            f"--max-output-bytes {max_output_bytes} is above --max-message-bytes {args.max_message_bytes}: "
            "such a response could never be sent; lower it or raise --max-message-bytes"
        )
    return RequestLimits.for_model(
        max_position_embeddings,
        max_model_len=args.max_model_len,
        max_new_tokens=args.max_new_tokens,
        max_request_rows=args.max_request_rows,
        max_prompts=args.max_prompts,
        max_beams=args.max_beams,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_bias_entries=args.max_bias_entries,
        max_output_bytes=max_output_bytes,
        max_prompt_chars=args.max_prompt_chars,
    )


def check_access(args: argparse.Namespace) -> ServerAccess:
    """The access flags, checked before the model loads: the server's credentials, and the token the
    target sends to the config and draft services (never in plaintext off this machine unless allowed)."""
    access = access_from_args(args)
    if access.allow_insecure_token:
        # The target's own channels to the config and draft services are opened later, by the resolver
        # and the drafting code; they read the permission from the environment like any client.
        os.environ[ALLOW_INSECURE_TOKEN_ENV] = "true"
    try:
        AccessPolicy.from_env(args.host, access)
        for flag, address in (("--config-address", args.config_address), ("--draft-address", args.draft_address)):
            if address:
                try:
                    check_token_transport(address)
                except SecuritySettingsError as error:
                    raise SecuritySettingsError(f"{flag} {address}: {error}") from None
    except SecuritySettingsError as error:
        raise SystemExit(f"target-service: {error}") from None
    return access


def load_draft_model(args: argparse.Namespace, target):
    """The co-located draft (`--draft-model`) on the target's device and dtype, checked against the
    target's vocabulary; None without the flag. Exits with the reason when it cannot be used."""
    if not args.draft_model:
        return None
    try:
        draft = load_model(args.draft_model, device=args.device, dtype=args.dtype)
        check_draft_model(target, draft)
    except (ModelLoadError, ValueError) as error:
        raise SystemExit(f"target-service: --draft-model {args.draft_model}: {error}") from None
    # The lean forward's one-time check (~150 ms for the int8 draft) now, not timed inside the first request's
    # catch-up, whose one-off the speculation controller's catch-up price kept; with no OpenMP pool left on
    # this thread, which runs no forwards.
    with without_thread_pool():
        draft_decoder(draft.model)
    return draft


def load_dflash_model(args: argparse.Namespace, target):
    """The DFlash assistant (`--dflash-model`) on the target's device and dtype, checked against the target;
    None without the flag. Exits with the reason when it cannot be used."""
    if not args.dflash_model:
        return None
    try:
        return load_dflash_assistant(args.dflash_model, target)
    except ModelLoadError as error:
        raise SystemExit(f"target-service: --dflash-model {args.dflash_model}: {error}") from None


def resolve_scheduler(args: argparse.Namespace) -> str:
    """The scheduler to serve with: `--scheduler`, else the default (under tensor parallelism too: the
    followers mirror the batched scheduler's slot cache, see `specwire.models.tensor_parallel`)."""
    return str(args.scheduler or DEFAULT_SCHEDULER)


def resolve_packed_forward(args: argparse.Namespace, tensor_parallel: int) -> str:
    """How the batched scheduler runs packed forwards: `--packed-forward`, else lean on one process and
    transformers under tensor parallelism. The lean decoder applies the layers' weights itself, which
    skips the collectives of transformers' sharded layers (each rank would compute a partial sum and
    keep it): asking for it with tensor parallelism is refused."""
    if tensor_parallel == 1:
        return str(args.packed_forward or "lean")
    if args.packed_forward == "lean":
        raise SystemExit(
            "target-service: --packed-forward lean cannot run with tensor parallelism (the lean decoder applies "
            "the layers' weights itself, without the all-reduces of transformers' sharded layers): use "
            "--packed-forward transformers, or leave --packed-forward out"
        )
    return "transformers"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.config_stale_max < 0:  # before the model loads: a typo should not cost minutes
        raise SystemExit(
            f"target-service: --config-stale-max {args.config_stale_max:g} is negative: give the seconds a cached "
            "config may be served while the registry is down, or 0 to never serve one"
        )
    setup_logging(args.log_level)
    tensor_parallel = tensor_parallel_size(args)
    if args.dflash_model and tensor_parallel > 1:  # every rank, before any model loads
        # The assistant drafts on rank 0 through the target's embeddings and LM head, which are sharded there.
        raise SystemExit(
            "target-service: --dflash-model cannot run with tensor parallelism (the DFlash assistant drafts through "
            "the target's sharded embeddings and LM head on one rank): serve it without --tensor-parallel"
        )
    check_transport_security("target-service")  # TLS settings that fail closed, before any model loads
    fix_mmap_threshold()  # freed tensors go back to the system (see specwire.heap)
    if tensor_parallel > 1 and rank_from_env() != 0:  # a follower: no server, no telemetry, no draft
        run_follower(args)
        return
    setup_telemetry("specwire-target")  # OTEL_* / SPECWIRE_PROMETHEUS_PORT; nothing when unset
    if args.draft_model and args.draft_address:  # before any model loads
        raise SystemExit(
            "target-service: --draft-model and --draft-address both name a draft model; give one: "
            "--draft-model runs it in this process, --draft-address on the draft service"
        )
    access = check_access(args)
    try:  # before the model loads: a typo should not cost minutes
        plugins = load_plugins(args.plugins.split(","))
    except PluginLoadError as error:
        raise SystemExit(f"target-service: --plugins: {error}") from None
    scheduler = resolve_scheduler(args)
    packed_forward = resolve_packed_forward(args, tensor_parallel)
    target = load_target(args, tensor_parallel, sys.argv[1:] if argv is None else list(argv))
    loaded = target.loaded
    draft_model = load_draft_model(args, loaded)
    dflash_model = load_dflash_model(args, loaded)
    overlap, why = draft_overlap_choice(args.draft_overlap, args.draft_address, loaded.device)
    if args.draft_address:
        logging.getLogger("specwire.target_service").info("draft overlap %s (%s)", "on" if overlap else "off", why)
    drafting = DraftPolicy(
        args.draft_address,
        args.default_proposer,
        args.draft_timeout,
        prompt_lookup_rule=args.prompt_lookup_rule,
        draft_model=draft_model,
        draft_overlap=overlap,
        adaptive=args.adaptive_speculation,
        dflash_model=dflash_model,
    )
    options = SchedulerOptions(
        max_batch_rows=args.max_batch_rows,
        max_tokens_per_step=args.max_tokens_per_step,
        max_queued=args.max_queued,
        slot_tokens=args.slot_tokens,
        kv_cache_mb=args.kv_cache_mb,
        max_lane_requests=args.max_lane_requests,
        lean_forward=packed_forward == "lean",
    )
    try:
        limits = limits_from_args(args, loaded.max_position_embeddings)
        pool = PreparationPool(args.prepare_workers, args.max_preparing)
    except ValueError as error:
        raise SystemExit(f"target-service: {error}") from None
    server = build_server(
        loaded,
        args.config_address,
        args.host,
        args.port,
        args.grace,
        drafting,
        scheduler,
        options,
        limits=limits,
        pool=pool,
        max_message_bytes=args.max_message_bytes,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        stuck_after=args.stuck_after,
        config_stale_max=args.config_stale_max,
        access=access,
        plugins=plugins,
    )
    target.watch(server, args.grace)
    try:
        run_until_signal(server, "target-service")
    finally:
        target.close()
    exit_if_stuck("target-service")


if __name__ == "__main__":
    main()
