"""The batched scheduler's gather policy and request states, without a model: when the next forward
runs, and which requests it waits for (preparing ones, never starting or drafting ones)."""

from __future__ import annotations

import pytest

from specwire.target_service.scheduler.gather_policy import MIN_WINDOW_S, decide
from specwire.target_service.scheduler.request import ProcessWork, Request, RequestState


def request(seq: int, state: RequestState, work=None, ready_since: float = 0.0, shares: bool = False) -> Request:
    made = Request(job=None, plan=None, loop=None, seq=seq)
    made.state, made.work, made.ready_since, made.shares_processing = state, work, ready_since, shares
    return made


def posted(seq: int, ready_since: float = 10.0, work=None) -> Request:
    return request(seq, RequestState.POSTED, work if work is not None else object(), ready_since)


def test_nothing_posted_waits_until_notified():
    decision = decide([request(1, RequestState.PREPARING)], set(), 0.1, 0.0, 0.5, now=10.0)
    assert decision.ready is None and decision.wait_s is None


def test_runs_at_once_when_every_running_request_posted():
    running = [posted(1), posted(2)]
    assert decide(running, {1, 2}, 0.1, 0.0, 0.5, now=10.0).ready == running


@pytest.mark.parametrize("state", [RequestState.STARTING, RequestState.DRAFTING])
def test_starting_and_drafting_requests_are_not_waited_for(state):
    running = [posted(1), request(2, state)]
    assert decide(running, {1, 2}, 0.1, 0.0, 0.5, now=10.0).ready == running[:1]


def test_a_preparing_request_is_waited_for_one_gather_window():
    running = [posted(1, ready_since=10.0), request(2, RequestState.PREPARING)]
    # Window: gather_fraction (0.5) of the forwards' time (0.1 s), from the later of post and last forward.
    decision = decide(running, {1, 2}, forward_ema=0.1, last_forward_end=9.0, gather_fraction=0.5, now=10.01)
    assert decision.ready is None and decision.wait_s == pytest.approx(0.04)
    assert decide(running, {1, 2}, 0.1, 9.0, 0.5, now=10.06).ready == running[:1]
    # Never shorter than the minimum window.
    assert decide(running, {1, 2}, 0.0, 9.0, 0.5, now=10.0).wait_s == pytest.approx(MIN_WINDOW_S)


def test_processing_runs_once_every_sharer_of_the_last_forward_posted():
    work = ProcessWork([])
    sharer = request(2, RequestState.PREPARING, shares=True)
    running = [posted(1, work=work), sharer]
    assert decide(running, {1, 2}, 0.1, 9.0, 0.5, now=10.0).ready is None  # waits for request 2
    # A sharer that was not in the last forward is not waited for.
    assert decide(running, {1}, 0.1, 9.0, 0.5, now=10.0).ready == running[:1]


def test_request_states_follow_its_work_and_drafting():
    made = request(1, RequestState.STARTING)
    before = made.start_drafting()
    assert made.state is RequestState.DRAFTING
    made.stop_drafting(before)
    assert made.state is RequestState.STARTING
    work = object()
    made.post_work(work)
    assert made.state is RequestState.POSTED and made.work is work
    made.take_work()
    assert made.state is RequestState.PREPARING and made.work is None
    # A cancellation while drafting is not undone when the wait ends.
    before = made.start_drafting()
    made.state = RequestState.CANCELLED
    made.stop_drafting(before)
    assert made.ended
