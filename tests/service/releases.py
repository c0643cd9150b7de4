"""What a request holds on a target service, and whether it gave it back: shared by the tests of every way a
request ends (`test_leaks`, and the co-located draft's, the controller's and the CLI's own).

A `Target` is a real target service on loopback whose model's forward takes a few milliseconds more than it needs
(`Faults.delay_s`), so that a request is still running when its client cancels it or its deadline passes; its
`snapshot` counts the process's threads (Python's and native ones, but gRPC's elastic EventEngine pool), the draft
streams or co-located drafters open, the requests counted as drafting, the batched scheduler's free KV slots and
the draft service's open sessions.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from dataclasses import dataclass

from specwire.client import TargetClient
from specwire.target_service.drafting import DraftPolicy

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]  # repetitive: prompt lookup finds matches
LONG = dict(max_new_tokens=200, min_new_tokens=200)  # far from done when cancelled (256 positions)
# Slot positions of a target in the "lane" case: longer requests run in the batched scheduler's sequential lane.
LANE_SLOT_TOKENS = 64
# How long `settled` waits for what the requests held to be given back.
SETTLE_S = 30.0


class Faults:
    """Faults injected into a real model's forward: a delay per call, and a failure on a later call.

    Args:
        model (`PreTrainedModel`): the model whose `forward` gets wrapped (its signature is kept).
        delay_s (`float`): added to every forward.
    """

    def __init__(self, model, delay_s: float):
        self.delay_s = delay_s
        self.fail_in: int | None = None
        self.failures = 0
        self.lock = threading.Lock()
        original = model.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            time.sleep(self.delay_s)
            with self.lock:
                if self.fail_in is not None:
                    self.fail_in -= 1
                    if self.fail_in <= 0:
                        self.fail_in = None
                        self.failures += 1
                        raise RuntimeError("injected device fault")
            return original(*args, **kwargs)

        model.forward = forward

    def fail_after(self, forwards: int) -> None:
        """The forward after the next `forwards` ones raises (once)."""
        with self.lock:
            self.fail_in = forwards + 1


@dataclass
class Target:
    server: object
    faults: Faults
    scheduler: str
    policy: DraftPolicy

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def engine(self):
        return self.server.server.bindings[0].servicer.engine

    @property
    def batcher(self):
        return self.engine.batcher


# gRPC's EventEngine pool grows by a thread while its work queues back up and lets an extra thread go
# after 20 s idle: its size is gRPC's to choose, held by no request, so it is left out of the count.
ELASTIC_THREADS = {"event_engine"}


def thread_names() -> collections.Counter[str]:
    """Every thread of this process by its name (Linux's `comm`: Python's threads and OpenMP's read
    "python"; gRPC names its own)."""
    names: collections.Counter[str] = collections.Counter()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names[comm.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            pass
    return names


def native_threads() -> int:
    """The threads of this process, native ones included (gRPC core, OpenMP), but gRPC's elastic pool."""
    return sum(count for name, count in thread_names().items() if name not in ELASTIC_THREADS)


def sessions_of(draft_server) -> int:
    return draft_server.server.bindings[0].servicer.open_sessions


def snapshot(target: Target, draft_server=None) -> dict[str, int]:
    now = {
        "python_threads": threading.active_count(),
        "native_threads": native_threads(),
        "draft_streams": target.policy.open_streams,
        "running_proposers": len(target.engine._proposers),
    }
    if target.batcher is not None and target.batcher.enabled:
        now["free_slots"] = target.batcher.free_slots
    if draft_server is not None:
        now["draft_sessions"] = sessions_of(draft_server)
    return now


def held(baseline: dict[str, int], now: dict[str, int]) -> dict[str, tuple[int, int]]:
    """What `now` holds beyond `baseline`: more threads or sessions, fewer free slots (now, before)."""
    return {k: (now[k], v) for k, v in baseline.items() if (now[k] < v if k == "free_slots" else now[k] > v)}


def settled(baseline: dict[str, int], target: Target, draft_server=None) -> dict[str, int]:
    """Poll until nothing is held beyond `baseline` (or `SETTLE_S` passed); the last snapshot."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = snapshot(target, draft_server)
        if not held(baseline, now) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def assert_released(baseline: dict[str, int], target: Target, draft_server=None) -> None:
    now = settled(baseline, target, draft_server)
    assert not held(baseline, now), (
        f"held after the requests settled (now, before): {held(baseline, now)}; threads: {dict(thread_names())}"
    )


def reference(target: Target, draft_server=None) -> dict[str, int]:
    """What the process holds with nothing running (slots all free, no stream or session open)."""
    now = snapshot(target, draft_server)
    now["draft_streams"] = 0
    now["running_proposers"] = 0
    if "free_slots" in now:
        now["free_slots"] = target.batcher.cache.num_slots
    if draft_server is not None:
        now["draft_sessions"] = 0
    return now


def warmed_baseline(target: Target, kwargs: dict, draft_server=None) -> dict[str, int]:
    """Run one short request of the kind under test (lazy threads start), then take the baseline."""
    # In the lane, it must be longer than a slot.
    new_tokens = LANE_SLOT_TOKENS if target.scheduler == "lane" else 8
    forwards = target.batcher.stats().forwards if target.batcher is not None else 0
    with TargetClient(target.address) as client:
        output = client.generate(PROMPT, max_new_tokens=new_tokens, **kwargs)
    if target.scheduler == "lane":
        assert target.batcher.stats().forwards == forwards, "the request did not run in the sequential lane"
    assert output.speculation.fallback_reason == "" or kwargs["proposer"] == "none"
    baseline = reference(target, draft_server)
    settled(baseline, target, draft_server)  # the warm-up's own call has ended everywhere
    return reference(target, draft_server)


def cancel_after_two_deltas(address: str, kwargs: dict) -> None:
    with TargetClient(address) as client:
        stream = client.stream(PROMPT, **LONG, **kwargs)
        deltas = 0
        for item in stream:
            deltas += 1
            assert not hasattr(item, "sequences"), "the request finished before it was cancelled"
            if deltas == 2:
                break
        stream.close()  # cancels the call


def concurrently(fn, count: int) -> None:
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
