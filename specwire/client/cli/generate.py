"""`specwire generate`: generate through a running target service, and how an output is printed (also `demo`'s)."""

from __future__ import annotations

import json
import sys
from typing import Any

from specwire.vocabulary import PROPOSER_NONE, PROPOSER_UNSPECIFIED, PROPOSERS

from .common import (
    ADDRESS_FORMS,
    DEFAULT_GENERATE_TIMEOUT_S,
    EXIT_OK,
    UsageError,
    add_chat_option,
    add_command,
    add_load_balancing_option,
    add_retries_option,
    add_token_option,
    connected,
    parse_assignments,
)


def add_generate_parser(sub: Any) -> None:
    """Register `specwire generate` on the CLI's subparsers."""
    gen = add_command(sub, "generate", help="generate through a running target service")
    gen.add_argument("prompt", nargs="*", help="prompt text (several = a batch)")
    gen.add_argument("--address", default="127.0.0.1:50052", help=f"target service: {ADDRESS_FORMS}")
    gen.add_argument("--config", default=None, help="registry reference: name, name@VERSION or name:TAG")
    gen.add_argument("--set", action="append", metavar="KEY=VALUE", help="GenerationConfig field override")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", dest="as_json", action="store_true", help="print the whole output as JSON")
    add_chat_option(gen)
    gen.add_argument(
        "--proposer",
        choices=list(PROPOSERS),
        default=None,
        help="speculation (default: the target's --default-proposer)",
    )
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema", metavar="FILE", default=None, help="the output is JSON valid against this JSON Schema file"
    )
    shape.add_argument("--regex", default=None, help="the whole output matches this regex")
    shape.add_argument("--grammar", metavar="FILE", default=None, help="the output follows this Lark grammar file")
    shape.add_argument(
        "--choice", action="append", default=None, help="the output is one of these strings (repeat the option)"
    )
    gen.add_argument(
        "--processor",
        action="append",
        metavar="NAME[=JSON]",
        default=None,
        help="a server plugin logits processor the target enabled, with its JSON arguments (repeat the option)",
    )
    gen.add_argument(
        "--stopping-criterion",
        action="append",
        metavar="NAME[=JSON]",
        default=None,
        help="a server plugin stopping criterion the target enabled, with its JSON arguments (repeat the option)",
    )
    gen.add_argument(
        "--generate-method",
        metavar="NAME[=JSON]",
        default=None,
        help="a server plugin generate method the target enabled, with its JSON arguments, in place of the "
        "built-in decoding (transformers' custom_generate, installed on the server)",
    )
    gen.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_GENERATE_TIMEOUT_S,
        help="deadline of the generation in seconds, 0 for none",
    )
    add_retries_option(gen)
    add_token_option(gen)
    add_load_balancing_option(gen)


def structured_output_of(args) -> dict[str, Any] | None:
    """The `structured_output=` argument from `--json-schema`, `--regex`, `--grammar` or `--choice`."""
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as file:
                return {"json_schema": file.read()}
        except OSError as exc:
            raise UsageError(f"--json-schema {args.json_schema}: cannot read it ({exc.strerror})") from None
    if args.grammar is not None:
        try:
            with open(args.grammar, encoding="utf-8") as file:
                return {"grammar": file.read()}
        except OSError as exc:
            raise UsageError(f"--grammar {args.grammar}: cannot read it ({exc.strerror})") from None
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": list(args.choice)}
    return None


def plugin_calls_of(values: list[str] | None, option: str) -> list[dict[str, Any]]:
    """`[{"name": ..., "args": {...}}]` from `--processor` / `--stopping-criterion` values `NAME[=JSON]`."""
    calls = []
    for value in values or []:
        name, _, text = value.partition("=")
        try:
            args = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise UsageError(f"{option} {value}: the arguments after '=' are not JSON ({exc})") from None
        if not name or not isinstance(args, dict):
            raise UsageError(f'{option} {value}: give NAME or NAME=JSON-object, e.g. ban_tokens={{"token_ids": [5]}}')
        calls.append({"name": name, "args": args})
    return calls


def generate_method_of(value: str | None) -> dict[str, Any] | None:
    """The `generate_method=` argument from `--generate-method NAME[=JSON]` (None without the option)."""
    return plugin_calls_of([value], "--generate-method")[0] if value else None


def generate_command(args) -> int:
    """Run `specwire generate`; the exit code."""
    from specwire.client import SpecwireRpcError, TargetClient

    if not args.prompt:
        raise UsageError('give a prompt, e.g. specwire generate "Hello" (several prompts make a batch)')
    overrides = parse_assignments(args.set)
    prompts = args.prompt
    with connected(TargetClient, args) as client:
        kwargs = dict(
            text=prompts if len(prompts) > 1 else prompts[0],
            generation_config=args.config,
            apply_chat_template=not args.no_chat,
            proposer=args.proposer,
            structured_output=structured_output_of(args),
            processors=plugin_calls_of(args.processor, "--processor"),
            stopping_criteria=plugin_calls_of(args.stopping_criterion, "--stopping-criterion"),
            generate_method=generate_method_of(args.generate_method),
            **overrides,
        )
        if args.stream and not args.as_json:
            try:
                output = _stream(client, kwargs)
            except SpecwireRpcError as exc:
                if not any(v.field == "config.num_beams" for v in exc.violations):
                    raise
                # Beam search cannot stream (the best beam is known at the end): say so, answer anyway.
                print("note: beam search cannot stream; printing the answer when the search ends", file=sys.stderr)
                output = None
            if output is not None:
                print_warnings(output)
                print_stats(output)
                return EXIT_OK
        output = client.generate(**kwargs)
    if args.as_json:
        print(
            json.dumps(
                {
                    "text": output.text,
                    "finish_reasons": output.finish_reasons,
                    "sequences": output.sequences.tolist(),
                    "speculation": output.speculation.__dict__,
                    "config": {"name": output.config_name, "version": output.config_version},
                    "warnings": [w.__dict__ for w in output.warnings],
                },
                indent=2,
            )
        )
        print_warnings(output)
        return EXIT_OK
    for i, text in enumerate(output.text):
        prefix = f"[{i}] " if len(output.text) > 1 else ""
        print(f"{prefix}{text}")
    print_warnings(output)
    print_stats(output)
    return EXIT_OK


def _stream(client, kwargs):
    """Print the text as it comes; the final `GenerateOutput`."""
    output = None
    for item in client.stream(**kwargs):
        if hasattr(item, "row"):
            print(item.text, end="", flush=True)
        else:
            output = item
    print()
    return output


def print_warnings(output) -> None:
    """The server's warnings (transformers' own, e.g. a temperature without sampling) on stderr."""
    for w in output.warnings if output is not None else ():
        print(f"warning: {w.field}: {w.message}", file=sys.stderr)


def speculation_ran(stats) -> bool:
    """Whether the request speculated (or tried to): plain requests print no speculation line."""
    return (
        stats.proposer not in ("", PROPOSER_NONE, PROPOSER_UNSPECIFIED)
        or stats.rounds > 0
        or bool(stats.fallback_reason)
    )


def print_stats(output) -> None:
    """The finish reasons and model, then the speculation line(s) when the request speculated."""
    if output is None:
        return
    s = output.speculation
    print(f"-- finish: {', '.join(output.finish_reasons)} | model: {output.model_id}")
    if not speculation_ran(s):
        return
    mean_length = 1 + s.accepted_tokens / s.rounds if s.rounds else 1.0
    print(
        f"-- speculation: proposer={s.proposer} rounds={s.rounds} drafted={s.drafted_tokens} "
        f"accepted={s.accepted_tokens} acceptance_rate={s.acceptance_rate:.2f} "
        f"mean_acceptance_length={mean_length:.2f}"
    )
    if s.rounds:
        print(
            f"-- accepted by draft position: {s.accepted_by_position} | draft {s.draft_seconds:.2f}s, "
            f"verify {s.verify_seconds:.2f}s"
        )
    lengths = draft_lengths_line(s)
    if lengths:
        print(lengths)
    if s.fallback_reason:
        print(f"-- fell back to plain decoding: {s.fallback_reason}")


# Runs of draft lengths the stats line shows before it elides the rest.
_RUNS_SHOWN = 12


def draft_lengths_line(stats) -> str:
    """`-- draft lengths (controller): 3x5 0x4 2 ...`: the length asked per round as `length x rounds`
    runs, who chose them, and the controller's time off; "" when no round ran."""
    runs = getattr(stats, "draft_lengths", None)
    if not runs:
        return ""
    shown = " ".join(f"{length}x{rounds}" if rounds > 1 else str(length) for length, rounds in runs[:_RUNS_SHOWN])
    more = len(runs) - _RUNS_SHOWN + (1 if stats.draft_length_rounds_dropped else 0)
    if more > 0:
        shown += f" ... ({sum(r for _, r in runs) + stats.draft_length_rounds_dropped} rounds)"
    line = f"-- draft lengths ({stats.draft_length_source}): {shown}"
    if stats.tokens_without_draft or stats.probes:
        line += f" | without drafting: {stats.tokens_without_draft} tokens, {stats.probes} probes"
    return line
