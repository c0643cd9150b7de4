"""`specwire`: the command line.

specwire demo ["prompt"]        start every service locally, generate with speculation, print text and stats, stop
specwire serve                  start every service locally with the embedded model until Ctrl-C
specwire health [--wait S]      whether the local services answer SERVING (waits up to S seconds)
specwire generate "prompt"      generate through a running target service
specwire config ...             the config registry: create/get/list/update/delete/tag/validate/import/export
specwire stats --prometheus URL speculative acceptance per proposer and config (optionally a PNG)
specwire watermark detect ...   score texts or token ids for a config's watermark (green list or SynthID)
"""

from __future__ import annotations

import argparse
import os
import sys

from .common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, HINTS, HelpFormatter, UsageError
from .config_commands import add_config_parser, config_command
from .generate import add_generate_parser, generate_command
from .local_stack import ServiceFailed, add_local_parsers, demo_command, health_command, serve_command
from .watermark import add_watermark_parser, watermark_command


def build_parser() -> argparse.ArgumentParser:
    """The `specwire` parser: one subparser per command, each registered by its command's module."""
    parser = argparse.ArgumentParser(
        prog="specwire",
        description=__doc__,
        formatter_class=HelpFormatter,
        epilog="exit codes: 0 done, 1 the request or a service failed, 2 usage error, 130 interrupted (Ctrl-C)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_local_parsers(sub)
    add_generate_parser(sub)
    add_config_parser(sub)
    add_watermark_parser(sub)
    from specwire.client.stats import add_parser as add_stats_parser

    add_stats_parser(sub)
    return parser


def _print_rpc_error(exc) -> None:
    """One line for the error; its field violations only where the message does not already say them."""
    print(f"error: {exc.code().name}: {exc.message}", file=sys.stderr)
    for v in exc.violations:
        if v.field not in exc.message:
            print(f"  {v.field} = {v.value}: {v.message}", file=sys.stderr)
    hint = HINTS.get(exc.code().name)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run `specwire` with `argv` (default: the process's arguments); the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from specwire.client.errors import SpecwireRpcError
    from specwire.telemetry import get_tracer, setup_telemetry
    from specwire.wire.generation_config import WireFormatError

    try:
        if args.command == "stats":
            from specwire.client.stats import stats_command

            return stats_command(args)
        # OTEL_* tracing of the client's calls; the scrape port is for servers, not for the CLI.
        setup_telemetry("specwire-cli", env={k: v for k, v in os.environ.items() if k != "SPECWIRE_PROMETHEUS_PORT"})
        if args.command in ("config", "generate", "watermark"):
            commands = {"config": config_command, "generate": generate_command, "watermark": watermark_command}
            with get_tracer().start_as_current_span(f"specwire {args.command}"):  # the trace's root
                return commands[args.command](args)
        if args.command == "serve":
            return serve_command(args)
        if args.command == "demo":
            return demo_command(args)
        if args.command == "health":
            return health_command(args)
    except SpecwireRpcError as exc:
        _print_rpc_error(exc)
        return EXIT_FAILED
    except (UsageError, WireFormatError, ValueError, TypeError) as exc:
        # A bad --set value or argument, found before anything was sent (SPECWIRE_DEBUG=1: the traceback).
        if os.environ.get("SPECWIRE_DEBUG"):
            raise
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ServiceFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (KeyboardInterrupt, RuntimeError) as exc:
        # Ctrl-C landing inside grpc's wait for the next streamed message (`threading.Condition.wait`, while it hands
        # its lock back) leaves that lock released, and leaving grpc's `with` then raises "cannot release un-acquired
        # lock" with the KeyboardInterrupt as its context: still the user's Ctrl-C, not a failure.
        if isinstance(exc, RuntimeError) and not isinstance(exc.__context__, KeyboardInterrupt):
            raise
        print("\nstopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK
