"""The services on this machine: `LocalStack` (config, draft and target services as child processes) and
the commands that run or check it, `specwire serve`, `specwire demo` and `specwire health`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specwire.vocabulary import PROPOSER_DRAFT_MODEL, PROPOSER_NONE, PROPOSER_PROMPT_LOOKUP

from .common import (
    ADDRESS_FORMS,
    DEFAULT_PROMPT,
    EXIT_FAILED,
    EXIT_OK,
    HINTS,
    add_chat_option,
    add_command,
    ctrl_c_closes,
    parse_assignments,
)
from .generate import print_stats, print_warnings

# New tokens of the demo's warm-up requests (one with speculation, one without) before the timed pair.
WARM_UP_TOKENS = 8


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


def _service_name(process: subprocess.Popen) -> str:
    """`config-service`, `draft-service` or `target-service`, from the module the process runs."""
    return process.args[2].removeprefix("specwire.").replace("_", "-")


def _wait_healthy(address: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    from specwire.client.health import NotHealthy, wait_healthy

    try:
        wait_healthy(address, timeout=timeout, process=process)
    except NotHealthy as exc:
        raise ServiceFailed(f"{_service_name(process)} on {address} {exc}") from None


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
        from specwire.ports import port_free, port_in_use

        for port in (self.args.config_port, self.args.draft_port, self.args.target_port):
            if not port_free(self.args.host, port):
                raise ServiceFailed(str(port_in_use(self.args.host, port)))

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
        running = [process for process in reversed(self.processes) if process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        for process in running:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.returncode not in (0, -signal.SIGTERM):  # a clean stop exits 0
                print(f"warning: {_service_name(process)} exited {process.returncode} while stopping", file=sys.stderr)


def serve_command(args) -> int:
    """Run `specwire serve` until Ctrl-C or a service exits; the exit code."""
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
            name = _service_name(exited)
            print(
                f"{name} exited ({exited.returncode}){stack.last_words(exited)}: stopping the others", file=sys.stderr
            )
            return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        print("stopped", file=sys.stderr)


def health_command(args) -> int:
    """Run `specwire health`: one line per service; the exit code."""
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
        print(f"hint: {HINTS['UNAVAILABLE']}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def demo_command(args) -> int:
    """Run `specwire demo`: start the services, stream one speculative answer, time it against plain decoding, stop."""
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
            with TargetClient(stack.target_address) as client, ctrl_c_closes(client):
                # A short request each way first: the timed answers below then both run on warm services (a fresh
                # target's and draft service's first forwards are slower, which would be charged to one side only).
                print("warming up: one short request with speculation and one without", file=sys.stderr)
                for warm_up in (proposer, PROPOSER_NONE):
                    client.generate(proposer=warm_up, **{**request, "max_new_tokens": WARM_UP_TOKENS})
                started = time.perf_counter()
                output = None
                for item in client.stream(proposer=proposer, **request):
                    if hasattr(item, "row"):
                        print(item.text, end="", flush=True)
                    else:
                        output = item
                speculative_s = time.perf_counter() - started
                print()
                print_warnings(output)
                print_stats(output)
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


def add_local_parsers(sub: Any) -> None:
    """Register `specwire demo`, `specwire serve` and `specwire health` on the CLI's subparsers."""
    from specwire import paths

    demo = add_command(sub, "demo", help="start the services, generate one answer, print text and stats, stop")
    demo.add_argument("prompt", nargs="?", default=None, help=f"default: {DEFAULT_PROMPT!r}")
    demo.add_argument("--db", default=None, help="registry file (default: a temporary one)")
    demo.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    add_chat_option(demo)
    demo.add_argument("--set", action="append", metavar="KEY=VALUE", help="GenerationConfig override")
    demo.add_argument("--log-level", default="WARNING", help="log level of the services")
    _stack_options(demo)

    serve = add_command(sub, "serve", help="start every service locally until Ctrl-C")
    serve.add_argument(
        "--db", default=None, help=f"registry SQLite file (default: {paths.default_registry()}; SPECWIRE_HOME moves it)"
    )
    serve.add_argument(
        "--log-dir",
        default=str(paths.log_dir()),
        help="folder of the services' log files ('-': this terminal)",
    )
    serve.add_argument("--log-level", default="INFO", help="log level of the services")
    _stack_options(serve)

    health = add_command(sub, "health", help="check that the services answer (grpc.health.v1)")
    health.add_argument("--wait", type=float, default=0.0, help="seconds to wait for them to become healthy")
    health.add_argument("--config-address", default="127.0.0.1:50051", help=f"config service: {ADDRESS_FORMS}")
    health.add_argument("--target-address", default="127.0.0.1:50052", help=f"target service: {ADDRESS_FORMS}")
    health.add_argument("--draft-address", default="127.0.0.1:50053", help=f"draft service: {ADDRESS_FORMS}")


def _stack_options(p: Any) -> None:
    """What `LocalStack` reads: the models, the addresses, the target's device and dtype."""
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
