"""`specwire`: the command line.

specwire demo ["prompt"]        start every service locally, generate with speculation, print text and stats, stop
specwire serve                  start every service locally with the embedded model until Ctrl-C
specwire health [--wait S]      whether the local services answer SERVING (waits up to S seconds)
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

from specwire.vocabulary import (
    PROPOSER_DRAFT_MODEL,
    PROPOSER_NONE,
    PROPOSER_PROMPT_LOOKUP,
    PROPOSER_UNSPECIFIED,
    PROPOSERS,
)

# Deadlines of the CLI's calls: the clients' defaults (`TargetClient`: 600 s, `ConfigClient`: 30 s),
# repeated here because the clients are imported only when a command runs (they import torch).
DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_CONFIG_TIMEOUT_S = 30.0
DEFAULT_PROMPT = "Explain in two sentences why speculative decoding makes text generation faster."

# Exit codes, the same for every subcommand.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """The command line itself is wrong (exit 2, like argparse's own errors)."""


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


def _read_source(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _config_from_args(args) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if getattr(args, "file", None):
        try:
            config.update(json.loads(_read_source(args.file)))
        except ValueError as exc:
            raise UsageError(f"{args.file} is not a JSON object: {exc}") from None
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
    from specwire.client import ConfigClient

    with ConfigClient(args.address, timeout=args.timeout or None) as client:
        cmd = args.config_command
        if cmd == "create":
            record = client.create(
                args.name,
                _config_from_args(args),
                parse_assignments(args.label, "--label"),
                strict=args.strict,
                allow_custom=args.allow_custom,
            )
            _print_record(record, args.as_json)
        elif cmd == "get":
            _print_record(client.get(args.ref), args.as_json)
        elif cmd == "list":
            for record in client.iter(args.prefix):
                tags = f" [{', '.join(record.tags)}]" if record.tags else ""
                print(f"{record.name}@{record.version}{tags}")
        elif cmd == "update":
            record = client.update(
                args.name,
                _config_from_args(args),
                args.expected_version,
                strict=args.strict,
                allow_custom=args.allow_custom,
            )
            _print_record(record, args.as_json)
        elif cmd == "delete":
            print(f"deleted {client.delete(args.name, args.expected_version)} version(s) of {args.name}")
        elif cmd == "tag":
            _print_record(client.set_tag(args.name, args.tag, args.version), args.as_json)
        elif cmd == "validate":
            result = client.validate(_config_from_args(args), strict=args.strict, allow_custom=args.allow_custom)
            for v in result.violations:
                print(f"{v.severity}: {v.field} = {v.value}: {v.message}")
            print("valid" if result.valid else "invalid")
            return EXIT_OK if result.valid else EXIT_FAILED
        elif cmd == "import":
            if args.hub:
                record = client.import_from_hub(args.hub, args.revision, args.filename, args.name)
            else:
                if not args.file or not args.name:
                    raise UsageError("specwire config import needs --hub REPO, or --file FILE with --name NAME")
                record = client.import_json(_read_source(args.file), args.name)
            _print_record(record, args.as_json)
        elif cmd == "export":
            print(client.export(args.ref))
    return EXIT_OK


def _generate_command(args) -> int:
    from specwire.client import SpecwireRpcError, TargetClient

    if not args.prompt:
        raise UsageError('give a prompt, e.g. specwire generate "Hello" (several prompts make a batch)')
    overrides = parse_assignments(args.set)
    prompts = args.prompt
    with TargetClient(args.address, timeout=args.timeout or None) as client:
        kwargs = dict(
            text=prompts if len(prompts) > 1 else prompts[0],
            generation_config=args.config,
            apply_chat_template=not args.no_chat,
            proposer=args.proposer,
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
                _print_warnings(output)
                _print_stats(output)
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
        _print_warnings(output)
        return EXIT_OK
    for i, text in enumerate(output.text):
        prefix = f"[{i}] " if len(output.text) > 1 else ""
        print(f"{prefix}{text}")
    _print_warnings(output)
    _print_stats(output)
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


def _print_warnings(output) -> None:
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


def _print_stats(output) -> None:
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
    if s.fallback_reason:
        print(f"-- fell back to plain decoding: {s.fallback_reason}")


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the parent dies, even by SIGKILL (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: `serve`'s own exit path still stops them
        pass


def _spawn(args: list[str], drop: tuple[str, ...] = (), log: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    output = None if log is None else open(log, "ab")  # noqa: SIM115 - the child holds it; closed below
    try:
        return subprocess.Popen(
            [sys.executable, "-m", *args],
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            preexec_fn=_die_with_parent,
        )
    finally:
        if output is not None:
            output.close()


class ServiceFailed(Exception):
    """A local service did not come up (exit 1 with its reason)."""


def _wait_healthy(address: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    from specwire.client.health import NotHealthy, wait_healthy

    try:
        wait_healthy(address, timeout=timeout, process=process)
    except NotHealthy as exc:
        raise ServiceFailed(f"{process.args[2].replace('_', '-')} on {address} {exc}") from None


class LocalStack:
    """Config, draft and target services as child processes on loopback (what `serve` and `demo` run).

    The children die with this process (SIGTERM on its exit, even a SIGKILL of it, on Linux). With
    `log_dir`, each service writes its log to `<log_dir>/<service>.log` instead of this terminal.
    """

    def __init__(self, args, log_dir: Path | None = None):
        self.args = args
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path | None] = []
        self.config_address = f"{args.host}:{args.config_port}"
        self.draft_address = f"{args.host}:{args.draft_port}"
        self.target_address = f"{args.host}:{args.target_port}"

    def _start(self, name: str, args: list[str], drop: tuple[str, ...] = ()) -> subprocess.Popen:
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = self.log_dir / f"{name}.log"
        process = _spawn(args, drop, log)
        self.processes.append(process)
        self.logs.append(log)
        return process

    def _check_ports_free(self) -> None:
        """Fail before starting anything when a port is taken (a health check would reach its holder)."""
        import socket

        from specwire.ports import port_in_use

        for port in (self.args.config_port, self.args.draft_port, self.args.target_port):
            with socket.socket() as probe:
                try:
                    probe.bind((self.args.host, port))
                except OSError:
                    raise ServiceFailed(str(port_in_use(self.args.host, port))) from None

    def last_words(self, process: subprocess.Popen) -> str:
        """The last line of a service's log file, when it has one."""
        log = self.logs[self.processes.index(process)]
        if log is None or not log.is_file():
            return ""
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        return f": {lines[-1]} (log: {log})" if lines else ""

    def __enter__(self) -> LocalStack:
        a = self.args
        self._check_ports_free()
        log = ["--log-level", a.log_level]
        print(f"starting config-service on {self.config_address} (registry {a.db})", file=sys.stderr)
        # SPECWIRE_PROMETHEUS_PORT goes to the target only (its speculation metrics): servers can't share a port.
        self._start(
            "config-service",
            ["specwire.config_service", "--host", a.host, "--port", str(a.config_port), "--db", a.db, *log],
            drop=("SPECWIRE_PROMETHEUS_PORT",),
        )
        draft_model = [] if a.draft_model == "none" else ["--model", a.draft_model]
        print(
            f"starting draft-service on {self.draft_address} (prompt lookup"
            f"{'' if a.draft_model == 'none' else ', draft model ' + a.draft_model})",
            file=sys.stderr,
        )
        self._start(
            "draft-service",
            ["specwire.draft_service", "--host", a.host, "--port", str(a.draft_port), *draft_model, *log],
            drop=("SPECWIRE_PROMETHEUS_PORT",),
        )
        print(
            f"starting target-service on {self.target_address} (model {a.model}; loading takes a while)",
            file=sys.stderr,
        )
        self._start(
            "target-service",
            [
                "specwire.target_service",
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
            ],
        )
        if self.log_dir is not None:
            print(f"logs: {self.log_dir}/{{config,draft,target}}-service.log", file=sys.stderr)
        try:
            addresses = (self.config_address, self.draft_address, self.target_address)
            for address, process in zip(addresses, self.processes, strict=True):
                try:
                    _wait_healthy(address, process)
                except ServiceFailed as failed:  # with the service's own last log line, when it has one
                    raise ServiceFailed(f"{failed}{self.last_words(process)}") from None
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
    from specwire import paths

    if args.db is None:
        args.db = str(paths.default_registry())
        Path(args.db).parent.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(args, log_dir=None if args.log_dir == "-" else Path(args.log_dir))
    try:
        with stack:
            print(f"registry: {args.db}\npress Ctrl-C to stop", file=sys.stderr)
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            while all(p.poll() is None for p in stack.processes):
                time.sleep(1.0)
            exited = next(p for p in stack.processes if p.poll() is not None)
            name = exited.args[2].replace("_", "-")
            print(
                f"{name} exited ({exited.returncode}){stack.last_words(exited)}: stopping the others", file=sys.stderr
            )
            return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        print("stopped", file=sys.stderr)


def _health_command(args) -> int:
    from specwire.client.health import NotHealthy, wait_healthy

    failed = 0
    for name, address in (
        ("config", args.config_address),
        ("target", args.target_address),
        ("draft", args.draft_address),
    ):
        try:
            wait_healthy(address, timeout=max(args.wait, 0.5))
            print(f"{name}-service {address}: SERVING")
        except NotHealthy:
            print(f"{name}-service {address}: not serving", file=sys.stderr)
            failed += 1
    if failed:
        print(f"hint: {_HINTS['UNAVAILABLE']}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _demo_command(args) -> int:
    from specwire.client import ConfigClient, TargetClient

    with tempfile.TemporaryDirectory() as tmp:
        if args.db is None:
            args.db = str(Path(tmp) / "registry.db")
        with LocalStack(args) as stack:
            with ConfigClient(stack.config_address) as registry:
                record = registry.create("demo-greedy", {"max_new_tokens": args.max_new_tokens, "do_sample": False})
                print(f"stored config {record.name}@{record.version} in the registry", file=sys.stderr)
            prompt = args.prompt or DEFAULT_PROMPT
            proposer = PROPOSER_PROMPT_LOOKUP if args.draft_model == "none" else PROPOSER_DRAFT_MODEL
            print(f"\nprompt: {prompt}\n(speculation: {proposer})\n", file=sys.stderr)
            request = dict(
                text=prompt,
                generation_config="demo-greedy",
                apply_chat_template=not args.no_chat,
                **parse_assignments(args.set),
            )
            with TargetClient(stack.target_address) as client:
                started = time.perf_counter()
                output = None
                for item in client.stream(proposer=proposer, **request):
                    if hasattr(item, "row"):
                        print(item.text, end="", flush=True)
                    else:
                        output = item
                speculative_s = time.perf_counter() - started
                print()
                _print_warnings(output)
                _print_stats(output)
                # The same request without speculation: what speculation bought on this machine.
                started = time.perf_counter()
                plain = client.generate(proposer=PROPOSER_NONE, **request)
                plain_s = time.perf_counter() - started
            new_tokens = output.sequences.shape[1] - output.prompt_length
            plain_tokens = plain.sequences.shape[1] - plain.prompt_length
            same = "same text" if plain.text == output.text else "DIFFERENT text (please report this)"
            print(
                f"-- speed: {new_tokens / speculative_s:.1f} tokens/s with {proposer}, "
                f"{plain_tokens / plain_s:.1f} tokens/s plain decoding ({same})"
            )
            return EXIT_OK


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default in --help."""


def build_parser() -> argparse.ArgumentParser:
    from specwire import paths

    parser = argparse.ArgumentParser(
        prog="specwire",
        description=__doc__,
        formatter_class=_HelpFormatter,
        epilog="exit codes: 0 done, 1 the request or a service failed, 2 usage error, 130 interrupted (Ctrl-C)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(subparsers, name: str, **kwargs) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, formatter_class=_HelpFormatter, **kwargs)

    def stack_options(p):
        p.add_argument("--model", default="default", help="model of the target service ('default': embedded SmolLM2)")
        p.add_argument("--host", default="127.0.0.1", help="address every service binds")
        p.add_argument("--config-port", type=int, default=50051, help="config service port")
        p.add_argument("--target-port", type=int, default=50052, help="target service port")
        p.add_argument("--draft-port", type=int, default=50053, help="draft service port")
        p.add_argument(
            "--draft-model",
            default="default-int8",
            help="draft service model ('none': prompt lookup only; 'default-int8': the embedded model in int8)",
        )
        p.add_argument("--device", default="cpu", help="torch device of the target (cpu, cuda, cuda:1, ...)")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="target dtype")

    def chat_option(p):
        p.add_argument(
            "--no-chat",
            action="store_true",
            help="send the prompt as plain text, as the Python client does by default (the CLI wraps it in the "
            "model's chat template, as a chat UI would; the Python client's apply_chat_template=True does the same)",
        )

    demo = add(sub, "demo", help="start the services, generate one answer, print text and stats, stop")
    demo.add_argument("prompt", nargs="?", default=None, help=f"default: {DEFAULT_PROMPT!r}")
    demo.add_argument("--db", default=None, help="registry file (default: a temporary one)")
    demo.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    chat_option(demo)
    demo.add_argument("--set", action="append", metavar="KEY=VALUE", help="GenerationConfig override")
    demo.add_argument("--log-level", default="WARNING", help="log level of the services")
    stack_options(demo)

    serve = add(sub, "serve", help="start every service locally until Ctrl-C")
    serve.add_argument(
        "--db", default=None, help=f"registry SQLite file (default: {paths.default_registry()}; SPECWIRE_HOME moves it)"
    )
    serve.add_argument(
        "--log-dir",
        default=str(paths.log_dir()),
        help="folder of the services' log files ('-': this terminal)",
    )
    serve.add_argument("--log-level", default="INFO", help="log level of the services")
    stack_options(serve)

    health = add(sub, "health", help="check that the services answer (grpc.health.v1)")
    health.add_argument("--wait", type=float, default=0.0, help="seconds to wait for them to become healthy")
    health.add_argument("--config-address", default="127.0.0.1:50051", help="config service host:port")
    health.add_argument("--target-address", default="127.0.0.1:50052", help="target service host:port")
    health.add_argument("--draft-address", default="127.0.0.1:50053", help="draft service host:port")

    gen = add(sub, "generate", help="generate through a running target service")
    gen.add_argument("prompt", nargs="*", help="prompt text (several = a batch)")
    gen.add_argument("--address", default="127.0.0.1:50052", help="target service host:port")
    gen.add_argument("--config", default=None, help="registry reference: name, name@VERSION or name:TAG")
    gen.add_argument("--set", action="append", metavar="KEY=VALUE", help="GenerationConfig field override")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", dest="as_json", action="store_true", help="print the whole output as JSON")
    chat_option(gen)
    gen.add_argument(
        "--proposer",
        choices=list(PROPOSERS),
        default=None,
        help="speculation (default: the target's --default-proposer)",
    )
    gen.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_GENERATE_TIMEOUT_S,
        help="deadline of the generation in seconds, 0 for none",
    )

    cfg = add(sub, "config", help="the config registry")
    cfg.add_argument("--address", default="127.0.0.1:50051", help="config service host:port")
    cfg.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_CONFIG_TIMEOUT_S,
        help="deadline of each registry call in seconds, 0 for none",
    )
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)

    def config_source(p):
        p.add_argument("--file", default=None, help="a generation_config.json file ('-' for stdin)")
        # `--json` meant the input file here and the output format for `generate`; kept for one release.
        p.add_argument("--json", dest="file", default=None, help=argparse.SUPPRESS, action=_DeprecatedFile)
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="field value (JSON or text)")

    def checks(p):
        p.add_argument("--strict", action="store_true", help="warnings count as errors (unknown keys included)")
        p.add_argument(
            "--allow-custom",
            action="store_true",
            help="keys that are not GenerationConfig fields are meant (transformers' custom entries): no warning",
        )

    def json_flag(p):
        p.add_argument("--as-json", dest="as_json", action="store_true", help="print the record as JSON")

    p = add(cfg_sub, "create", help="store a new named config (version 1)")
    p.add_argument("name")
    config_source(p)
    p.add_argument("--label", action="append", metavar="KEY=VALUE", help="a label stored with the config")
    checks(p)
    json_flag(p)
    p = add(cfg_sub, "get", help="show name, name@VERSION or name:TAG")
    p.add_argument("ref")
    json_flag(p)
    p = add(cfg_sub, "list", help="list configs (latest versions)")
    p.add_argument("--prefix", default="", help="only names starting with this")
    p = add(cfg_sub, "update", help="store a new version")
    p.add_argument("name")
    config_source(p)
    p.add_argument("--expected-version", type=int, default=None, help="fail unless the latest version is this one")
    checks(p)
    json_flag(p)
    p = add(cfg_sub, "delete", help="delete a config and all its versions")
    p.add_argument("name")
    p.add_argument("--expected-version", type=int, default=None, help="fail unless the latest version is this one")
    p = add(cfg_sub, "tag", help="point NAME:TAG at VERSION")
    p.add_argument("name")
    p.add_argument("tag")
    p.add_argument("version", type=int)
    json_flag(p)
    p = add(cfg_sub, "validate", help="check a config without storing it")
    config_source(p)
    checks(p)
    p = add(cfg_sub, "import", help="import a generation_config.json from the Hub or a file")
    p.add_argument("--hub", help="Hub repo id (offline: read from the local Hugging Face cache)")
    p.add_argument("--revision", default="main", help="Hub revision")
    p.add_argument("--filename", default="generation_config.json", help="file in the Hub repo")
    p.add_argument("--file", default=None, help="a local generation_config.json ('-' for stdin)")
    p.add_argument("--json", dest="file", default=None, help=argparse.SUPPRESS, action=_DeprecatedFile)
    p.add_argument("--name", default=None, help="registry name (default: the Hub repo's)")
    json_flag(p)
    p = add(cfg_sub, "export", help="print a version as generation_config.json")
    p.add_argument("ref")

    from specwire.client.stats import add_parser as add_stats_parser

    add_stats_parser(sub)
    return parser


class _DeprecatedFile(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(
            "warning: `specwire config ... --json FILE` is now --file FILE (--json goes in a later release)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


_HINTS = {
    "UNAVAILABLE": "is the service running at that address? `specwire serve` starts all three locally",
    "DEADLINE_EXCEEDED": "raise --timeout, or ask for fewer tokens",
}


def _print_rpc_error(exc) -> None:
    """One line for the error; its field violations only where the message does not already say them."""
    print(f"error: {exc.code().name}: {exc.message}", file=sys.stderr)
    for v in exc.violations:
        if v.field not in exc.message:
            print(f"  {v.field} = {v.value}: {v.message}", file=sys.stderr)
    hint = _HINTS.get(exc.code().name)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
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
        if args.command in ("config", "generate"):
            with get_tracer().start_as_current_span(f"specwire {args.command}"):  # the trace's root
                return _config_command(args) if args.command == "config" else _generate_command(args)
        if args.command == "serve":
            return _serve_command(args)
        if args.command == "demo":
            return _demo_command(args)
        if args.command == "health":
            return _health_command(args)
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
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
