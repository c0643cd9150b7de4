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

import signal
import threading
from contextlib import ExitStack, suppress

import grpc
import pytest

from specwire.client import SpecwireRpcError, TargetClient
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.scheduler.options import SchedulerOptions
from tests.servers import free_port, subprocess_server, threaded_server
from tests.service.releases import (
    LANE_SLOT_TOKENS,
    LONG,
    PROMPT,
    Faults,
    Target,
    assert_released,
    cancel_after_two_deltas,
    concurrently,
    reference,
    warmed_baseline,
)

# "lane": the batched scheduler's sequential lane (slots of 64 positions: longer requests run there).
SCHEDULERS = ["batched", "sequential", "lane"]
DRAFT_MODEL = dict(proposer="draft_model", num_assistant_tokens=3, assistant_confidence_threshold=0.0)
# (id, request kwargs, where the target drafts: "local" (prompt lookup, always in the target's process, or
# none), "service" (the draft service), "colocated" (a draft model in the target's process, --draft-model))
PROPOSERS = [
    ("none", dict(proposer="none"), "local"),
    ("prompt_lookup", dict(proposer="prompt_lookup", prompt_lookup_num_tokens=4), "local"),
    ("draft_model-service", DRAFT_MODEL, "service"),
    ("draft_model-colocated", DRAFT_MODEL, "colocated"),
]
REMOTE = [p for p in PROPOSERS if p[2] == "service"]


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


def _stream_until_stopped(address: str, kwargs: dict, started: threading.Barrier) -> None:
    with TargetClient(address) as client, suppress(SpecwireRpcError):
        stream = client.stream(PROMPT, **LONG, **kwargs)
        next(stream)
        started.wait(60)
        for _ in stream:
            pass


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_target_stopped_mid_stream_ends_every_thread_it_started(tiny_draft_dir, tiny_model_dir, scheduler):
    """The target's server stopped while its streams wait for a slow draft service: by the time `stop` returns,
    every thread the target started has ended (the scheduler's, each request's, the model thread, the draft
    channel's, the preparation pool's), so none can still be in a forward when the interpreter finalizes (which
    aborts the process); the draft service's model thread ends with its server's stop too."""
    draft = load_model(str(tiny_draft_dir), progress=False)
    Faults(draft.model, delay_s=0.2)  # a request is in a draft wait most of the time
    before = set(threading.enumerate())
    with threaded_server(lambda: build_draft_server(draft)) as draft_server:
        with ExitStack() as stack:
            target = start_target(stack, tiny_model_dir, scheduler, draft_server.address)
            started = threading.Barrier(3)
            clients = [
                threading.Thread(target=_stream_until_stopped, args=(target.address, DRAFT_MODEL, started))
                for _ in range(2)
            ]
            for t in clients:
                t.start()
            started.wait(60)
        left = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("specwire-")]
        assert left == ["specwire-draft_0"]  # the draft service's model thread: its server still runs
        for t in clients:
            t.join(60)
    assert [t.name for t in threading.enumerate() if t not in before and t.name.startswith("specwire-")] == []


# The draft service's process killed (a connection reset) under a target of each scheduler at once (one process
# to start, not three); the test after this one stops a draft service that serves in the test's process (a
# threaded server, cheaper than a process: what the target sees differs only by how the stream ends).
def test_draft_service_killed_mid_stream_releases_everything(tiny_draft_dir, tiny_model_dir):
    port = free_port()
    args = ["specwire.draft_service", "--port", str(port), "--model", str(tiny_draft_dir)]
    with ExitStack() as stack:
        targets = [start_target(stack, tiny_model_dir, s, f"127.0.0.1:{port}") for s in SCHEDULERS]
        with subprocess_server(args, port) as draft:
            for target in targets:
                warmed_baseline(target, DRAFT_MODEL)
            baselines = [reference(target) for target in targets]  # the process's threads after every warm-up
            outputs: list = []
            started = threading.Barrier(2 * len(targets) + 1)
            threads = [
                threading.Thread(target=_stream_to_the_end, args=(target.address, DRAFT_MODEL, started, outputs))
                for target in targets
                for _ in range(2)
            ]
            for t in threads:
                t.start()
            started.wait(60)
            draft.send_signal(signal.SIGKILL)
            for t in threads:
                t.join(120)
        assert len(outputs) == len(threads)
        assert all("draft failed mid-request" in o.speculation.fallback_reason for o in outputs)
        for baseline, target in zip(baselines, targets, strict=True):
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
