"""The services under test as child processes on free loopback ports: config, draft and target.

`ServiceStack` starts all three at once (loading overlaps), waits for `grpc.health.v1` SERVING,
and reads each process' peak resident size (`VmHWM` in /proc/PID/status) for the memory workload.
Service logs go to a temporary folder; the tail of a log is printed when its service fails.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.progress import log


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def service_env() -> dict[str, str]:
    """The environment of a benchmarked service: nothing in a benchmark may reach the network (these also make a
    missing model fail fast), and its log lines come as they are written."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def add_log_options(parser: argparse.ArgumentParser) -> None:
    """`--target-arg` (repeatable) and `--log-dir`, for a tool that starts its own services (`log_folder`)."""
    parser.add_argument("--target-arg", action="append", default=[], help="a further target-service argument")
    parser.add_argument("--log-dir", type=Path, help="keep the services' logs here")


def log_folder(given: Path | None, prefix: str) -> Path:
    """The folder for the services' logs: `given` (`--log-dir`, made if missing), else a new temporary one."""
    folder = given or Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def read_memory_kib(pid: int) -> dict[str, int]:
    """`VmHWM` (peak resident) and `VmRSS` (current resident) of a live process, in KiB."""
    values: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                values[key] = int(rest.split()[0])
    except (OSError, ValueError):
        pass
    return values


@dataclass
class Service:
    """One server process."""

    name: str
    module: str
    args: list[str]
    port: int
    log_path: Path
    process: subprocess.Popen | None = None
    log_file: object = None
    cpus: str | None = None  # `taskset -c` list: the process and its threads run on these cores only

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, env: dict[str, str]) -> None:
        self.log_file = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        command = ["taskset", "-c", self.cpus] if self.cpus else []
        command += [
            sys.executable,
            "-m",
            self.module,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
        ]
        self.process = subprocess.Popen(command, env=env, stdout=self.log_file, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def memory(self) -> dict[str, int]:
        return read_memory_kib(self.process.pid) if self.process and self.process.poll() is None else {}

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None


class ServiceFailed(RuntimeError):
    """A service exited or stayed unhealthy while starting."""

    def __init__(self, service: Service, reason: str):
        self.service = service
        super().__init__(f"{service.name} ({' '.join(service.args)}) {reason}:\n{service.log_tail()}")


def wait_healthy(service: Service, timeout: float) -> None:
    """Poll `grpc.health.v1` until SERVING; raise `ServiceFailed` if the process exits or time runs out."""
    from specwire.client.health import NotHealthy
    from specwire.client.health import wait_healthy as wait

    try:
        wait(service.address, timeout=timeout, process=service.process)
    except NotHealthy as exc:
        raise ServiceFailed(service, str(exc)) from None


@dataclass
class ServiceStack:
    """Config, draft and target services on loopback.

    Args:
        model (`str`): the target's model (`default`, a folder, a `.gguf` file, a Hub id).
        draft_model (`str`, *optional*): the draft service's model; None starts it with prompt lookup only.
            If the draft service cannot load it, it is restarted without a model and
            `draft_model_error` says why.
        device, dtype (`str`): the target's torch device and weights dtype (`--device`, `--dtype`).
        draft_device, draft_dtype (`str`): the draft model's device and dtype.
        target_args (`list[str]`): further target-service options.
        timeout (`float`): seconds to wait for each service to become healthy (model loading included).
    """

    model: str
    draft_model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    draft_device: str = "cpu"
    draft_dtype: str = "float32"
    target_args: list[str] = field(default_factory=list)
    timeout: float = 900.0
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="specwire-bench-")))
    services: dict[str, Service] = field(default_factory=dict)
    draft_model_error: str | None = None

    def _env(self) -> dict[str, str]:
        return service_env()

    def start(self) -> None:
        """Start every service (without waiting); call `wait()` next."""
        config_port, draft_port, target_port = free_port(), free_port(), free_port()
        self.services["config"] = Service(
            "config-service",
            "specwire.config_service",
            ["--db", str(self.log_dir / "registry.db")],
            config_port,
            self.log_dir / "config.log",
        )
        self.services["draft"] = self._draft_service(draft_port, self.draft_model)
        self.services["target"] = Service(
            "target-service",
            "specwire.target_service",
            [
                "--model",
                self.model,
                "--config-address",
                f"127.0.0.1:{config_port}",
                "--draft-address",
                f"127.0.0.1:{draft_port}",
                "--device",
                self.device,
                "--dtype",
                self.dtype,
                *self.target_args,
            ],
            target_port,
            self.log_dir / "target.log",
        )
        env = self._env()
        for service in self.services.values():
            log(f"starting {service.name} on {service.address} ({' '.join(service.args) or 'no options'})")
            service.start(env)

    def _draft_service(self, port: int, model: str | None) -> Service:
        args = ["--model", model, "--device", self.draft_device, "--dtype", self.draft_dtype] if model else []
        return Service("draft-service", "specwire.draft_service", args, port, self.log_dir / "draft.log")

    def wait(self) -> None:
        """Wait until all services are healthy, falling back to a model-less draft service if needed."""
        try:
            wait_healthy(self.services["config"], self.timeout)
            try:
                wait_healthy(self.services["draft"], self.timeout)
            except ServiceFailed as error:
                if not self.draft_model:
                    raise
                last = [line for line in error.service.log_tail(40).splitlines() if line.strip()]
                reason = next(
                    (line.strip() for line in last if "cannot load model" in line),
                    last[-1].strip() if last else str(error).splitlines()[0],
                )
                self.draft_model_error = reason
                log(
                    f"draft service could not load {self.draft_model!r} ({reason}); "
                    "restarting it with prompt lookup only"
                )
                port = self.services["draft"].port
                self.services["draft"].stop()
                self.services["draft"] = self._draft_service(port, None)
                self.services["draft"].log_path = self.log_dir / "draft-fallback.log"
                self.services["draft"].start(self._env())
                wait_healthy(self.services["draft"], self.timeout)
            wait_healthy(self.services["target"], self.timeout)
        except BaseException:
            self.stop()
            raise
        log("all services healthy")

    def address(self, name: str) -> str:
        return self.services[name].address

    def memory(self) -> dict[str, dict[str, int]]:
        return {name: service.memory() for name, service in self.services.items()}

    def stop(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()

    def __enter__(self) -> ServiceStack:
        self.start()
        self.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def served_prompt(address: str, text: str) -> list[int]:
    """`text`'s token ids as the target's tokenizer makes them for a chat, as the benchmarks send prompts: in the
    model's chat template when its tokenizer has one (a small test model's may not: plain text then)."""
    import grpc

    from specwire.client import SpecwireRpcError, TargetClient

    with TargetClient(address) as client:
        try:
            out = client.generate(text=text, apply_chat_template=True, max_new_tokens=1)
        except SpecwireRpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            out = client.generate(text=text, max_new_tokens=1)
    return out.sequences[0, :-1].tolist()
