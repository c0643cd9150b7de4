"""No leaks: every way a request can end gives back what it held.

On real servers over loopback, for every proposer (none, prompt lookup in-process, prompt lookup and
a draft model through a real draft service, a draft model co-located in the target's process) and
both schedulers, requests end by finishing, by the client closing the stream midway, by their
deadline, by an error inside the decoding loop (a device fault injected into the model's forward),
and by the draft service dying or stopping mid-stream. After they settle, the process has as many
threads as before (Python's and native ones, gRPC's included but for its elastic EventEngine pool),
the target no draft stream (or co-located drafter) open and no request counted as drafting, the
batched scheduler all its KV slots free, and the draft service no session open.

The target model's forward takes a few milliseconds more than it needs (`Faults.delay_s`), so that a
request is still running when its client cancels it or its deadline passes.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
import pytest

from specwire.client import SpecwireRpcError, TargetClient
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.scheduler.options import SchedulerOptions
from tests.servers import free_port, subprocess_server, threaded_server

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]  # repetitive: prompt lookup finds matches
LONG = dict(max_new_tokens=200, min_new_tokens=200)  # far from done when cancelled (256 positions)
# "lane": the batched scheduler's sequential lane (slots of 64 positions: longer requests run there).
SCHEDULERS = ["batched", "sequential", "lane"]
LANE_SLOT_TOKENS = 64
DRAFT_MODEL = dict(proposer="draft_model", num_assistant_tokens=3, assistant_confidence_threshold=0.0)
# (id, request kwargs, where the target drafts: "local" (in-process prompt lookup or none), "service"
# (the draft service), "colocated" (a draft model in the target's process, --draft-model))
PROPOSERS = [
    ("none", dict(proposer="none"), "local"),
    ("prompt_lookup-local", dict(proposer="prompt_lookup", prompt_lookup_num_tokens=4), "local"),
    ("prompt_lookup-service", dict(proposer="prompt_lookup", prompt_lookup_num_tokens=4), "service"),
    ("draft_model-service", DRAFT_MODEL, "service"),
    ("draft_model-colocated", DRAFT_MODEL, "colocated"),
]
REMOTE = [p for p in PROPOSERS if p[2] == "service"]
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


@pytest.fixture(scope="module")
def draft_server(tiny_draft_dir):
    draft = load_model(str(tiny_draft_dir), progress=False)
    with threaded_server(lambda: build_draft_server(draft)) as server:
        yield server


def start_target(stack: ExitStack, model_dir, scheduler: str, draft_address: str | None, draft_model=None) -> Target:
    loaded = load_model(str(model_dir), progress=False)
    faults = Faults(loaded.model, delay_s=0.01)
    policy = DraftPolicy(draft_address, round_timeout_s=10.0, draft_model=draft_model)
    # Packed forwards through `model(...)`, so that the injected faults reach them.
    options = SchedulerOptions(lean_forward=False, slot_tokens=LANE_SLOT_TOKENS if scheduler == "lane" else None)
    server = stack.enter_context(
        threaded_server(
            lambda: build_target_server(
                loaded,
                drafting=policy,
                scheduler="sequential" if scheduler == "sequential" else "batched",
                scheduler_options=options,
            )
        )
    )
    stack.callback(policy.close)
    return Target(server, faults, scheduler, policy)


@pytest.fixture(scope="module")
def targets(tiny_model_dir, tiny_draft_dir, draft_server):
    """`targets(scheduler, where)`: a target service (built once per module) on the draft service, with a
    co-located draft model, or with neither."""
    built: dict[tuple[str, str], Target] = {}
    with ExitStack() as stack:

        def get(scheduler: str, where: str) -> Target:
            if (scheduler, where) not in built:
                address = draft_server.address if where == "service" else None
                draft = load_model(str(tiny_draft_dir), progress=False) if where == "colocated" else None
                built[scheduler, where] = start_target(stack, tiny_model_dir, scheduler, address, draft)
            return built[scheduler, where]

        yield get


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


def _params(proposers):
    return [
        pytest.param(scheduler, kwargs, where, id=f"{scheduler}-{name}")
        for scheduler in SCHEDULERS
        for name, kwargs, where in proposers
    ]


@pytest.mark.parametrize("scheduler, kwargs, where", _params(PROPOSERS))
def test_finished_requests_release_everything(targets, draft_server, scheduler, kwargs, where):
    target = targets(scheduler, where)
    drafts = draft_server if where == "service" else None
    baseline = warmed_baseline(target, kwargs, drafts)
    with TargetClient(target.address) as client:
        for _ in range(3):
            client.generate(PROMPT, max_new_tokens=LANE_SLOT_TOKENS, **kwargs)
    assert_released(baseline, target, drafts)


@pytest.mark.parametrize("scheduler, kwargs, where", _params(PROPOSERS))
def test_cancelled_streams_release_everything(targets, draft_server, scheduler, kwargs, where):
    target = targets(scheduler, where)
    drafts = draft_server if where == "service" else None
    baseline = warmed_baseline(target, kwargs, drafts)
    for _ in range(2):  # one after the other, then several at once
        cancel_after_two_deltas(target.address, kwargs)
    concurrently(lambda: cancel_after_two_deltas(target.address, kwargs), 3)
    assert_released(baseline, target, drafts)


@pytest.mark.parametrize("scheduler, kwargs, where", _params(PROPOSERS))
def test_deadline_exceeded_requests_release_everything(targets, draft_server, scheduler, kwargs, where):
    target = targets(scheduler, where)
    drafts = draft_server if where == "service" else None
    baseline = warmed_baseline(target, kwargs, drafts)

    def late():
        with TargetClient(target.address, timeout=0.4) as client:
            with pytest.raises(SpecwireRpcError) as info:
                client.generate(PROMPT, **LONG, **kwargs)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    late()
    concurrently(late, 2)
    assert_released(baseline, target, drafts)


@pytest.mark.parametrize("scheduler, kwargs, where", _params(PROPOSERS))
def test_failed_requests_release_everything(targets, draft_server, scheduler, kwargs, where):
    target = targets(scheduler, where)
    drafts = draft_server if where == "service" else None
    baseline = warmed_baseline(target, kwargs, drafts)
    with TargetClient(target.address) as client:
        for _ in range(2):
            failures = target.faults.failures
            target.faults.fail_after(4)  # the prefill, then a few steps or rounds, then the fault
            with pytest.raises(SpecwireRpcError) as info:
                client.generate(PROMPT, **LONG, **kwargs)
            # A bug-like failure: INTERNAL with an error id, never the exception's text.
            assert info.value.code() == grpc.StatusCode.INTERNAL and "internal error (id " in info.value.message
            assert target.faults.failures == failures + 1
    assert_released(baseline, target, drafts)


def _stream_to_the_end(address: str, kwargs: dict, started: threading.Barrier, outputs: list) -> None:
    with TargetClient(address) as client:
        stream = client.stream(PROMPT, **LONG, **kwargs)
        first = next(stream)
        started.wait(60)
        outputs.append([first, *stream][-1])


# The draft service's process killed (a connection reset) on each scheduler, with the proposer that holds a
# model session there; both remote proposers meet a draft service that stops serving in the test after this
# one (a threaded server, cheaper than a process: what the target sees differs only by how the stream ends).
KILLED = [p for p in REMOTE if p[0] == "draft_model-service"]


@pytest.mark.parametrize("scheduler, kwargs, remote", _params(KILLED))
def test_draft_service_killed_mid_stream_releases_everything(tiny_draft_dir, tiny_model_dir, scheduler, kwargs, remote):
    port = free_port()
    args = ["specwire.draft_service", "--port", str(port), "--model", str(tiny_draft_dir)]
    with ExitStack() as stack:
        target = start_target(stack, tiny_model_dir, scheduler, f"127.0.0.1:{port}")
        with subprocess_server(args, port) as draft:
            baseline = warmed_baseline(target, kwargs)
            outputs: list = []
            started = threading.Barrier(3)
            threads = [
                threading.Thread(target=_stream_to_the_end, args=(target.address, kwargs, started, outputs))
                for _ in range(2)
            ]
            for t in threads:
                t.start()
            started.wait(60)
            draft.send_signal(signal.SIGKILL)
            for t in threads:
                t.join(120)
        assert len(outputs) == 2
        assert all("draft failed mid-request" in o.speculation.fallback_reason for o in outputs)
        assert_released(baseline, target)


@pytest.mark.parametrize("scheduler, kwargs, remote", _params(REMOTE))
def test_draft_service_stopped_mid_stream_releases_everything(
    tiny_draft_dir, tiny_model_dir, scheduler, kwargs, remote
):
    draft = load_model(str(tiny_draft_dir), progress=False)
    with ExitStack() as stack:
        draft_server = stack.enter_context(threaded_server(lambda: build_draft_server(draft)))
        target = start_target(stack, tiny_model_dir, scheduler, draft_server.address)
        baseline = warmed_baseline(target, kwargs, draft_server)
        outputs: list = []
        started = threading.Barrier(3)
        threads = [
            threading.Thread(target=_stream_to_the_end, args=(target.address, kwargs, started, outputs))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        started.wait(60)
        draft_server.run(draft_server.server.stop(0.1))
        for t in threads:
            t.join(120)
        assert len(outputs) == 2
        assert all("draft failed mid-request" in o.speculation.fallback_reason for o in outputs)
        assert_released(baseline, target, draft_server)
