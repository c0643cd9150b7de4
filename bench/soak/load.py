"""The client side of the soak: threads sending the request mix, and the record of how each request ended."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from bench.soak.faults import FaultInjector
from bench.soak.kinds import EXPECTED, RUNNERS, Caller, ModelFacts, classify

MAX_FAILURES_KEPT = 200


@dataclass
class Recorder:
    """Every finished request: counted per kind, outcome and code, per interval; failures kept (bounded)."""

    by_kind: dict[str, Counter] = field(default_factory=dict)
    by_code: Counter = field(default_factory=Counter)
    by_outcome: Counter = field(default_factory=Counter)
    unexpected_by_kind: Counter = field(default_factory=Counter)
    failures: list[dict] = field(default_factory=list)
    internal_messages: Counter = field(default_factory=Counter)
    draft_fallbacks: int = 0
    interval_outcomes: Counter = field(default_factory=Counter)
    interval_codes: Counter = field(default_factory=Counter)
    interval_seconds: list[float] = field(default_factory=list)  # of the interval's finished requests
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, code: str, outcome: str, t0: float, t1: float, message: str, note: dict) -> None:
        with self.lock:
            self.by_kind.setdefault(kind, Counter())[code] += 1
            self.by_code[code] += 1
            self.by_outcome[outcome] += 1
            self.interval_outcomes[outcome] += 1
            self.interval_codes[code] += 1
            if outcome == "finished":
                self.interval_seconds.append(t1 - t0)
            if note.get("fallback") and kind.startswith("draft_model"):
                self.draft_fallbacks += 1
            if code == "INTERNAL":
                self.internal_messages[f"{kind}: {message[:300]}"] += 1
            if outcome == "unexpected":
                self.unexpected_by_kind[f"{kind} -> {code}"] += 1
                if len(self.failures) < MAX_FAILURES_KEPT:
                    self.failures.append(
                        {
                            "kind": kind,
                            "code": code,
                            "start_s": round(t0, 2),
                            "seconds": round(t1 - t0, 3),
                            "message": message[:500],
                            "note": {k: v for k, v in note.items() if k != "fallback"},
                        }
                    )

    def take_interval(self, t: float) -> dict:
        """Counts by outcome and by code since the last call, and the finished requests' median and max
        seconds (a stall shows as an interval with none finished, or a max near the deadline)."""
        with self.lock:
            outcomes, codes = dict(self.interval_outcomes), dict(self.interval_codes)
            seconds = sorted(self.interval_seconds)
            self.interval_outcomes.clear()
            self.interval_codes.clear()
            self.interval_seconds.clear()
        return {
            "t": round(t, 1),
            "by_outcome": outcomes,
            "by_code": codes,
            "finished_median_s": round(seconds[len(seconds) // 2], 3) if seconds else None,
            "finished_max_s": round(seconds[-1], 3) if seconds else None,
        }


@dataclass
class ClientPool:
    """`clients` threads, each with its own channel, sending weighted random kinds until `end_s`.

    Args:
        address (`str`): the target service.
        clients (`int`): threads.
        weights (`dict[str, float]`): kind -> relative frequency.
        facts (`ModelFacts`): vocabulary and positions of the served model.
        started (`float`): `time.monotonic()` of the run start; `end_s` is relative to it.
        end_s (`float`): no request starts after this; each one in flight ends by its own deadline.
        seed (`int`): seeds each thread's generator (`seed * 1000 + thread`).
    """

    address: str
    clients: int
    weights: dict[str, float]
    facts: ModelFacts
    started: float
    end_s: float
    seed: int
    max_new_tokens: int
    timeout_s: float
    hostile_timeout_s: float
    recorder: Recorder
    injector: FaultInjector | None
    stop_event: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)

    def start(self) -> None:
        for index in range(self.clients):
            thread = threading.Thread(target=self._guarded, args=(index,), name=f"soak-client-{index}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self, timeout: float) -> list[str]:
        """Stop and wait at most `timeout` seconds in all; the names of threads still running."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]

    def _now(self) -> float:
        return time.monotonic() - self.started

    def _guarded(self, index: int) -> None:
        try:
            self._loop(index)
        except Exception as error:  # noqa: BLE001 - a client bug must show in the report, not kill silently
            self.crashes.append(f"client {index}: {type(error).__name__}: {error}")

    def _loop(self, index: int) -> None:
        from specwire.client import SpecwireRpcError, TargetClient

        rng = random.Random(self.seed * 1000 + index)
        kinds, weights = list(self.weights), list(self.weights.values())
        client = TargetClient(self.address)
        caller = Caller(client, rng, self.facts, self.max_new_tokens, self.timeout_s, self.hostile_timeout_s)
        try:
            while not self.stop_event.is_set() and self._now() < self.end_s:
                kind = rng.choices(kinds, weights)[0]
                caller.note = {}
                message = ""
                t0 = self._now()
                try:
                    code = RUNNERS[kind](caller)
                except SpecwireRpcError as error:
                    code, message = error.code().name, error.message
                except Exception as error:  # noqa: BLE001 - a client-side failure is a finding too
                    code, message = "CLIENT_ERROR", f"{type(error).__name__}: {error}"
                t1 = self._now()
                if code == "OK":
                    message = f"answered OK; expected {' or '.join(sorted(EXPECTED[kind]))}"
                overlapped = self.injector is not None and self.injector.config_down_overlaps(t0, t1)
                outcome = classify(kind, code, overlapped)
                self.recorder.add(kind, code, outcome, t0, t1, message, caller.note)
        finally:
            client.close()
