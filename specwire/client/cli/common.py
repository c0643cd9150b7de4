"""What every `specwire` subcommand shares: exit codes, deadlines, usage errors, `key=value` parsing, help format."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specwire.vocabulary import LOAD_BALANCING_POLICIES

# Deadlines of the CLI's calls: the clients' defaults (`TargetClient`: 600 s, `ConfigClient`: 30 s),
# repeated here because the clients are imported only when a command runs (they import torch).
DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_CONFIG_TIMEOUT_S = 30.0
DEFAULT_PROMPT = "Explain in two sentences why speculative decoding makes text generation faster."

# Exit codes, the same for every subcommand.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """The command line itself is wrong (exit 2, like argparse's own errors)."""


@contextlib.contextmanager
def connected(client_class: Any, args: argparse.Namespace) -> Iterator[Any]:
    """A `TargetClient` or `ConfigClient` as the command line says (address, deadline, token policy, retries, load
    balancing where the command has it), closed by Ctrl-C (`ctrl_c_closes`) and at the end."""
    with client_class(
        args.address,
        timeout=args.timeout or None,
        allow_insecure_token=args.allow_insecure_token or None,  # unset: SPECWIRE_ALLOW_INSECURE_TOKEN decides
        load_balancing=getattr(args, "load_balancing", None),
        retries=args.retries,
    ) as client:
        with ctrl_c_closes(client):
            yield client


@contextlib.contextmanager
def ctrl_c_closes(client: Any) -> Iterator[None]:
    """While the body runs, Ctrl-C closes `client` (from a thread of its own) instead of raising KeyboardInterrupt
    wherever the main thread is: its call ends CANCELLED, the server stops the work, and the body's error becomes the
    KeyboardInterrupt that `main` reports as "stopped". Raised inside grpc's wait for a message, a KeyboardInterrupt
    could leave grpc's state half-updated: its condition's lock released, and at exit its threads raising or the
    process aborting. A second Ctrl-C raises at once. Where SIGINT is not Python's default (ignored, as after `nohup`,
    or handled by someone else) or off the main thread, nothing changes."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pressed = threading.Event()

    def on_ctrl_c(signum: int, frame: Any) -> None:
        if pressed.is_set():
            raise KeyboardInterrupt
        pressed.set()
        threading.Thread(target=client.close, name="specwire-ctrl-c", daemon=True).start()

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield
    except Exception:
        if pressed.is_set():  # the call failed because its channel was closed
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed.is_set():  # the body finished as the channel closed
        raise KeyboardInterrupt


def parse_assignments(items: list[str] | None, what: str = "--set") -> dict[str, Any]:
    """`key=value` pairs; values are JSON when they parse as JSON (numbers, true, lists), else strings."""
    values: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{what} expects key=value, got {item!r}")
        try:
            values[key] = json.loads(raw)
        except json.JSONDecodeError:
            values[key] = raw
    return values


def read_source(path: str) -> str:
    """The text of a file, or of stdin for `-`."""
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The usage text (the package docstring) as written, and every option's default in --help."""


def add_command(subparsers: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand's parser, with the shared help format."""
    return subparsers.add_parser(name, formatter_class=HelpFormatter, **kwargs)


def add_chat_option(p: argparse.ArgumentParser) -> None:
    """`--no-chat`, for the commands that send a prompt (`demo`, `generate`)."""
    p.add_argument(
        "--no-chat",
        action="store_true",
        help="send the prompt as plain text, as the Python client does by default (the CLI wraps it in the "
        "model's chat template, as a chat UI would; the Python client's apply_chat_template=True does the same)",
    )


def add_token_option(p: argparse.ArgumentParser) -> None:
    """`--allow-insecure-token`, for the commands that call a service (the token is SPECWIRE_AUTH_TOKEN)."""
    p.add_argument(
        "--allow-insecure-token",
        action="store_true",
        help="send SPECWIRE_AUTH_TOKEN in plaintext to a non-loopback address (refused otherwise: set "
        "SPECWIRE_TLS_CA_FILE to use TLS)",
    )


def add_retries_option(p: argparse.ArgumentParser) -> None:
    """`--retries`, for the commands whose client takes `retries=` (`generate`, `config`, `watermark detect`)."""
    p.add_argument(
        "--retries",
        type=count,
        default=0,
        help="how many times a call the service refused for load (RESOURCE_EXHAUSTED with a retry hint) is sent "
        "again after the hinted wait, within --timeout; 0 never retries",
    )


def count(text: str) -> int:
    """A `--retries` value: an int >= 0 (argparse turns the ValueError into a usage error naming the option)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


# The target forms every `--address` takes (gRPC's name syntax).
ADDRESS_FORMS = (
    "host:port, dns:///name:port (every address the name resolves to, e.g. a headless Service's pods) "
    "or ipv4:a.b.c.d:port,e.f.g.h:port (a list of replicas)"
)


def add_load_balancing_option(p: argparse.ArgumentParser) -> None:
    """`--load-balancing`, for the commands that call a service."""
    p.add_argument(
        "--load-balancing",
        choices=list(LOAD_BALANCING_POLICIES),
        default=None,
        help="how calls spread over the addresses of --address: round_robin (each call to the next replica) or "
        "pick_first (all to one); default round_robin for dns:/// and address lists, pick_first for host:port",
    )


# Said after an error with this gRPC status code.
HINTS = {
    "UNAVAILABLE": "is the service running at that address? `specwire serve` starts all three locally",
    "DEADLINE_EXCEEDED": "raise --timeout, or ask for fewer tokens",
    "UNAUTHENTICATED": "export SPECWIRE_AUTH_TOKEN=<token>: the service's reader token for reads and generation, "
    "its admin token for registry writes",
    "PERMISSION_DENIED": "the message names the role this call needs: export SPECWIRE_AUTH_TOKEN=<that role's token>",
}
