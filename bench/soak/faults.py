"""Faults on a schedule: the draft service killed (SIGKILL) and restarted, the config service restarted.

The config service gets SIGTERM (a clean stop within its grace) and starts again on the same port over
the same SQLite file, so every registry config made at the start must still resolve afterwards. The
draft service gets SIGKILL, as a crashed or evicted pod would, and starts again on the same port; the
target must fall back to plain decoding meanwhile and speculate again afterwards.

Each fault's window runs from the signal until the service is healthy again. A request that names a
registry config may get UNAVAILABLE if it overlapped a config window widened by `CONFIG_MARGIN_S`
(the target's channel reconnects with gRPC's backoff, so it can lag the registry's return by seconds).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from bench.progress import log
from bench.services import ServiceFailed, ServiceStack, wait_healthy

CONFIG_MARGIN_S = 20.0
DRAFT_KILL = "draft_kill"
CONFIG_RESTART = "config_restart"


def schedule(duration_s: float, minutes: float) -> list[tuple[float, str]]:
    """(seconds from the start, fault) pairs: each fault `max(1, minutes // 15)` times, interleaved, evenly spread."""
    per_kind = max(1, int(minutes // 15))
    events = [DRAFT_KILL, CONFIG_RESTART] * per_kind
    return [(duration_s * (i + 1) / (len(events) + 1), name) for i, name in enumerate(events)]


@dataclass
class FaultRecord:
    """One fault: when it began (signal sent) and ended (service healthy again), relative to the run start."""

    name: str
    service: str
    planned_s: float
    down_s: float
    up_s: float | None = None
    error: str | None = None
    old_pid: int | None = None
    new_pid: int | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class FaultInjector:
    """Runs `plan` in threads of its own (restarts take seconds; sampling must go on meanwhile).

    Args:
        stack (`ServiceStack`): the running services.
        env (`dict`): the environment to start services with.
        started (`float`): `time.monotonic()` of the run start.
        plan (`list[tuple[float, str]]`): from `schedule`.
        restart_timeout_s (`float`): how long a restarted service may take to be healthy.
    """

    stack: ServiceStack
    env: dict[str, str]
    started: float
    plan: list[tuple[float, str]]
    restart_timeout_s: float = 300.0
    records: list[FaultRecord] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)
    service_locks: dict[str, threading.Lock] = field(default_factory=dict)

    def now(self) -> float:
        return time.monotonic() - self.started

    def start(self) -> None:
        thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        thread.start()
        self.threads.append(thread)

    def stop(self, timeout: float) -> None:
        """No further faults; wait at most `timeout` seconds for restarts under way."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        # Each fault on its own thread at its time: a slow restart (a draft model loading) must not
        # push the next fault, of another service, out of the run.
        for at, name in self.plan:
            if self.stop_event.wait(max(0.0, at - self.now())):
                return
            thread = threading.Thread(target=self._guarded, args=(at, name), name=f"soak-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def _guarded(self, at: float, name: str) -> None:
        key = "draft" if name == DRAFT_KILL else "config"
        try:
            with self.service_locks.setdefault(key, threading.Lock()):  # one fault of a service at a time
                self._fault(at, name)
        except Exception as error:  # noqa: BLE001 - recorded as a failed fault, the run goes on
            log(f"fault {name} failed: {error}")

    def _fault(self, planned: float, name: str) -> None:
        key = "draft" if name == DRAFT_KILL else "config"
        service = self.stack.services[key]
        record = FaultRecord(name, key, round(planned, 1), self.now(), old_pid=service.process.pid)
        with self.lock:
            self.records.append(record)
        log(f"fault: {name} (pid {service.process.pid})")
        if name == DRAFT_KILL:
            service.process.send_signal(signal.SIGKILL)
            service.process.wait(30)
        else:
            service.process.send_signal(signal.SIGTERM)
            try:
                service.process.wait(60)
            except subprocess.TimeoutExpired:
                record.error = "did not exit within 60 s of SIGTERM; killed"
                service.process.kill()
                service.process.wait(30)
        if service.log_file is not None:
            service.log_file.close()
        with self.lock:
            restarts = sum(1 for r in self.records if r.service == key)
        service.log_path = self.stack.log_dir / f"{key}-restart{restarts}.log"
        service.start(self.env)
        try:
            wait_healthy(service, self.restart_timeout_s)
        except ServiceFailed as error:
            record.error = f"not healthy again: {str(error).splitlines()[0]}"
            log(f"fault {name}: {record.error}")
            return
        record.up_s = self.now()
        record.new_pid = service.process.pid
        log(f"fault {name}: back after {record.up_s - record.down_s:.1f}s (pid {record.new_pid})")

    def config_down_overlaps(self, t0: float, t1: float) -> bool:
        """Whether [t0, t1] overlaps a config-service window (widened by `CONFIG_MARGIN_S`)."""
        with self.lock:
            windows = [(r.down_s, r.up_s) for r in self.records if r.service == "config"]
        for down, up in windows:
            end = (up if up is not None else float("inf")) + CONFIG_MARGIN_S
            if t0 <= end and t1 >= down:
                return True
        return False

    def down_during(self, key: str, t0: float, t1: float) -> bool:
        """Whether one of the fault windows of the service `key` overlaps [t0, t1]."""
        with self.lock:
            windows = [(r.down_s, r.up_s) for r in self.records if r.service == key]
        return any(down <= t1 and t0 <= (up if up is not None else float("inf")) for down, up in windows)
