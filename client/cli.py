"""`specwire`: the command line.

specwire demo ["prompt"]        start every service locally, generate with speculation, print text and stats, stop
specwire serve                  start every service locally with the embedded model until Ctrl-C
specwire generate "prompt"      generate through a running target service
specwire config ...             the config registry: create/get/list/update/delete/tag/validate/import/export
specwire stats --prometheus URL speculative acceptance per proposer and config (optionally a PNG)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Deadlines of the CLI's calls: the clients' defaults (`TargetClient`: 600 s, `ConfigClient`: 30 s),
# repeated here because the clients are imported only when a command runs (they import torch).
DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_CONFIG_TIMEOUT_S = 30.0
DEFAULT_PROMPT = "Explain in two sentences why speculative decoding makes text generation faster."


def parse_assignments(items: list[str] | None, what: str = "--set") -> dict[str, Any]:
    """`key=value` pairs; values are JSON when they parse as JSON (numbers, true, lists), else strings."""
    values: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what} expects key=value, got {item!r}")
        try:
            values[key] = json.loads(raw)
        except json.JSONDecodeError:
            values[key] = raw
    return values


def _config_from_args(args) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if getattr(args, "json", None):
        text = sys.stdin.read() if args.json == "-" else Path(args.json).read_text()
        config.update(json.loads(text))
    config.update(parse_assignments(getattr(args, "set", None)))
    return config


def _print_record(record, as_json: bool = False) -> None:
    if as_json:
        print(
            json.dumps(
                {
                    "name": record.name,
                    "version": record.version,
                    "latest_version": record.latest_version,
                    "tags": record.tags,
                    "labels": record.labels,
                    "config": record.config.to_dict(),
                    "warnings": [w.__dict__ for w in record.warnings],
                },
                indent=2,
            )
        )
        return
    tags = f"  tags: {', '.join(record.tags)}" if record.tags else ""
    print(f"{record.name}@{record.version} (latest {record.latest_version}){tags}")
    print(json.dumps(record.config.to_dict(), indent=2, sort_keys=True))
    for w in record.warnings:
        print(f"warning: {w.field}: {w.message}", file=sys.stderr)


def _config_command(args) -> int:
    from client import ConfigClient

    with ConfigClient(args.address, timeout=args.timeout or None) as client:
        cmd = args.config_command
        if cmd == "create":
            _print_record(
                client.create(args.name, _config_from_args(args), parse_assignments(args.label, "--label")),
                args.as_json,
            )
        elif cmd == "get":
            _print_record(client.get(args.ref), args.as_json)
        elif cmd == "list":
            for record in client.iter(args.prefix):
                tags = f" [{', '.join(record.tags)}]" if record.tags else ""
                print(f"{record.name}@{record.version}{tags}")
        elif cmd == "update":
            _print_record(client.update(args.name, _config_from_args(args), args.expected_version), args.as_json)
        elif cmd == "delete":
            print(f"deleted {client.delete(args.name, args.expected_version)} version(s) of {args.name}")
        elif cmd == "tag":
            _print_record(client.set_tag(args.name, args.tag, args.version), args.as_json)
        elif cmd == "validate":
            result = client.validate(_config_from_args(args), strict=args.strict)
            for v in result.violations:
                print(f"{v.severity}: {v.field} = {v.value}: {v.message}")
            print("valid" if result.valid else "invalid")
            return 0 if result.valid else 1
        elif cmd == "import":
            if args.hub:
                record = client.import_from_hub(args.hub, args.revision, args.filename, args.name)
            else:
                if not args.name:
                    raise SystemExit("specwire config import --json FILE needs --name")
                text = sys.stdin.read() if args.json == "-" else Path(args.json).read_text()
                record = client.import_json(text, args.name)
            _print_record(record, args.as_json)
        elif cmd == "export":
            print(client.export(args.ref))
    return 0


def _generate_command(args) -> int:
    from client import TargetClient

    overrides = parse_assignments(args.set)
    prompts = args.prompt or [DEFAULT_PROMPT]
    with TargetClient(args.address, timeout=args.timeout or None) as client:
        kwargs = dict(
            text=prompts if len(prompts) > 1 else prompts[0],
            generation_config=args.config,
            apply_chat_template=not args.no_chat,
            proposer=args.proposer,
            **overrides,
        )
        if args.stream and not args.as_json:
            output = None
            for item in client.stream(**kwargs):
                if hasattr(item, "row"):
                    print(item.text, end="", flush=True)
                else:
                    output = item
            print()
            _print_stats(output)
            return 0
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
                },
                indent=2,
            )
        )
        return 0
    for i, text in enumerate(output.text):
        prefix = f"[{i}] " if len(output.text) > 1 else ""
        print(f"{prefix}{text}")
    _print_stats(output)
    return 0


def _print_stats(output) -> None:
    if output is None:
        return
    s = output.speculation
    print(f"-- finish: {', '.join(output.finish_reasons)} | model: {output.model_id}")
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
    if s.fallback_reason:
        print(f"-- fell back to plain decoding: {s.fallback_reason}")


def _spawn(args: list[str], drop: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.Popen([sys.executable, "-m", *args], env={**env, "PYTHONUNBUFFERED": "1"})


def _wait_healthy(address: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    from client.health import NotHealthy, wait_healthy

    try:
        wait_healthy(address, timeout=timeout, process=process)
    except NotHealthy as exc:
        raise SystemExit(f"{' '.join(process.args[2:4])} on {address} {exc}") from None


class LocalStack:
    """Config, draft and target services as child processes on loopback (what `serve` and `demo` run)."""

    def __init__(self, args):
        self.args = args
        self.processes: list[subprocess.Popen] = []
        self.config_address = f"{args.host}:{args.config_port}"
        self.draft_address = f"{args.host}:{args.draft_port}"
        self.target_address = f"{args.host}:{args.target_port}"

    def __enter__(self) -> LocalStack:
        a = self.args
        log = ["--log-level", a.log_level]
        print(f"starting config-service on {self.config_address} (registry {a.db})", file=sys.stderr)
        # SPECWIRE_PROMETHEUS_PORT goes to the target only (its speculation metrics): servers can't share a port.
        config = _spawn(
            ["config_service", "--host", a.host, "--port", str(a.config_port), "--db", a.db, *log],
            drop=("SPECWIRE_PROMETHEUS_PORT",),
        )
        draft_model = [] if a.draft_model == "none" else ["--model", a.draft_model]
        print(
            f"starting draft-service on {self.draft_address} (prompt lookup"
            f"{'' if a.draft_model == 'none' else ', draft model ' + a.draft_model})",
            file=sys.stderr,
        )
        draft = _spawn(
            ["draft_service", "--host", a.host, "--port", str(a.draft_port), *draft_model, *log],
            drop=("SPECWIRE_PROMETHEUS_PORT",),
        )
        print(
            f"starting target-service on {self.target_address} (model {a.model}; loading takes a while)",
            file=sys.stderr,
        )
        target = _spawn(
            [
                "target_service",
                "--host",
                a.host,
                "--port",
                str(a.target_port),
                "--model",
                a.model,
                "--config-address",
                self.config_address,
                "--draft-address",
                self.draft_address,
                "--device",
                a.device,
                "--dtype",
                a.dtype,
                *log,
            ]
        )
        self.processes += [config, draft, target]
        try:
            _wait_healthy(self.config_address, config)
            _wait_healthy(self.draft_address, draft)
            _wait_healthy(self.target_address, target)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        print("all services healthy", file=sys.stderr)
        return self

    def __exit__(self, *exc) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _serve_command(args) -> int:
    with LocalStack(args) as stack:
        print("press Ctrl-C to stop", file=sys.stderr)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            while all(p.poll() is None for p in stack.processes):
                time.sleep(1.0)
            print("a service exited: stopping the others", file=sys.stderr)
        except KeyboardInterrupt:
            pass
    return 0


def _demo_command(args) -> int:
    from client import ConfigClient

    with tempfile.TemporaryDirectory() as tmp:
        if args.db is None:
            args.db = str(Path(tmp) / "registry.db")
        with LocalStack(args) as stack:
            with ConfigClient(stack.config_address) as registry:
                record = registry.create("demo-greedy", {"max_new_tokens": args.max_new_tokens, "do_sample": False})
                print(f"stored config {record.name}@{record.version} in the registry", file=sys.stderr)
            prompt = args.prompt or DEFAULT_PROMPT
            proposer = "prompt_lookup" if args.draft_model == "none" else "draft_model"
            print(f"\nprompt: {prompt}\n(speculation: {proposer})\n", file=sys.stderr)
            gen_args = argparse.Namespace(
                address=stack.target_address,
                timeout=None,
                prompt=[prompt],
                config="demo-greedy",
                set=args.set,
                stream=True,
                as_json=False,
                no_chat=args.no_chat,
                proposer=proposer,
            )
            return _generate_command(gen_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specwire", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def stack_options(p):
        p.add_argument("--model", default="default", help="model of the target service (default: embedded SmolLM2)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--config-port", type=int, default=50051)
        p.add_argument("--target-port", type=int, default=50052)
        p.add_argument("--draft-port", type=int, default=50053)
        p.add_argument(
            "--draft-model",
            default="default-int8",
            help="draft service model ('none' = prompt lookup only; default: the embedded model in int8)",
        )
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default="float32")

    demo = sub.add_parser("demo", help="start the services, generate one answer, print text and stats, stop")
    demo.add_argument("prompt", nargs="?", default=None)
    demo.add_argument("--db", default=None, help="registry file (default: a temporary one)")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument(
        "--no-chat",
        action="store_true",
        help="send the prompt as plain text (models without a chat template)",
    )
    demo.add_argument("--set", action="append", metavar="KEY=VALUE", help="GenerationConfig override")
    demo.add_argument("--log-level", default="WARNING", help="log level of the services (default WARNING)")
    stack_options(demo)

    serve = sub.add_parser("serve", help="start every service locally until Ctrl-C")
    serve.add_argument("--db", default="specwire-registry.db", help="registry SQLite file")
    serve.add_argument("--log-level", default="INFO", help="log level of the services (default INFO)")
    stack_options(serve)

    gen = sub.add_parser("generate", help="generate through a running target service")
    gen.add_argument("prompt", nargs="*", help="prompt text (several = a batch)")
    gen.add_argument("--address", default="127.0.0.1:50052", help="target service host:port")
    gen.add_argument("--config", default=None, help="registry reference: name, name@VERSION or name:TAG")
    gen.add_argument("--set", action="append", metavar="KEY=VALUE", help="GenerationConfig field override")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", dest="as_json", action="store_true", help="print the whole output as JSON")
    gen.add_argument("--no-chat", action="store_true", help="send the prompt as plain text, without the chat template")
    gen.add_argument("--proposer", choices=["none", "prompt_lookup", "draft_model"], default=None)
    gen.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_GENERATE_TIMEOUT_S,
        help=f"deadline of the generation in seconds, 0 for none (default {DEFAULT_GENERATE_TIMEOUT_S:g})",
    )

    cfg = sub.add_parser("config", help="the config registry")
    cfg.add_argument("--address", default="127.0.0.1:50051", help="config service host:port")
    cfg.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_CONFIG_TIMEOUT_S,
        help=f"deadline of each registry call in seconds, 0 for none (default {DEFAULT_CONFIG_TIMEOUT_S:g})",
    )
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)

    def config_source(p):
        p.add_argument("--json", help="generation_config.json file ('-' for stdin)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="field value (JSON or text)")

    def json_flag(p):
        p.add_argument("--as-json", dest="as_json", action="store_true", help="print the record as JSON")

    p = cfg_sub.add_parser("create", help="store a new named config (version 1)")
    p.add_argument("name")
    config_source(p)
    p.add_argument("--label", action="append", metavar="KEY=VALUE")
    json_flag(p)
    p = cfg_sub.add_parser("get", help="show name, name@VERSION or name:TAG")
    p.add_argument("ref")
    json_flag(p)
    p = cfg_sub.add_parser("list", help="list configs (latest versions)")
    p.add_argument("--prefix", default="")
    p = cfg_sub.add_parser("update", help="store a new version")
    p.add_argument("name")
    config_source(p)
    p.add_argument("--expected-version", type=int, default=None)
    json_flag(p)
    p = cfg_sub.add_parser("delete", help="delete a config and all its versions")
    p.add_argument("name")
    p.add_argument("--expected-version", type=int, default=None)
    p = cfg_sub.add_parser("tag", help="point NAME:TAG at VERSION")
    p.add_argument("name")
    p.add_argument("tag")
    p.add_argument("version", type=int)
    json_flag(p)
    p = cfg_sub.add_parser("validate", help="check a config without storing it")
    config_source(p)
    p.add_argument("--strict", action="store_true", help="warnings count as errors")
    p = cfg_sub.add_parser("import", help="import a generation_config.json from the Hub or a file")
    p.add_argument("--hub", help="Hub repo id")
    p.add_argument("--revision", default="main")
    p.add_argument("--filename", default="generation_config.json")
    p.add_argument("--json", help="a local generation_config.json ('-' for stdin)")
    p.add_argument("--name", default=None)
    json_flag(p)
    p = cfg_sub.add_parser("export", help="print a version as generation_config.json")
    p.add_argument("ref")

    from client.stats import add_parser as add_stats_parser

    add_stats_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from client.errors import SpecwireRpcError
    from specwire.telemetry import get_tracer, setup_telemetry

    if args.command == "stats":
        from client.stats import stats_command

        return stats_command(args)
    # OTEL_* tracing of the client's calls; the scrape port is for servers, not for the CLI.
    setup_telemetry("specwire-cli", env={k: v for k, v in os.environ.items() if k != "SPECWIRE_PROMETHEUS_PORT"})
    try:
        if args.command in ("config", "generate"):
            with get_tracer().start_as_current_span(f"specwire {args.command}"):  # the trace's root
                return _config_command(args) if args.command == "config" else _generate_command(args)
        if args.command == "serve":
            return _serve_command(args)
        if args.command == "demo":
            return _demo_command(args)
    except SpecwireRpcError as exc:
        print(f"error: {exc.code().name}: {exc.message}", file=sys.stderr)
        for v in exc.violations:
            print(f"  {v.field} = {v.value}: {v.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
