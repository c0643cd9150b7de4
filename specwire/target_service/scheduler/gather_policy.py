"""The gather policy: when the scheduler thread runs the next forward (or batched processing).

A forward starts when every running request that is preparing its next step has posted it, or after
a gather window (`gather_fraction` of the last forward's time, at least 2 ms), so a request still
preparing joins the next forward instead of holding up the others. Requests not waited for:
- STARTING ones (no step in the rhythm of the forwards yet),
- DRAFTING ones: a request waiting on its draft service must not slow anybody else's (no
  head-of-line blocking; `tests/service/test_head_of_line.py`).
Posted logits processing runs as soon as every request of the last forward that shares processing
has posted its own, so the batch is as wide as it can be without waiting a window.
"""

from __future__ import annotations

import dataclasses

from specwire.target_service.scheduler.request import ProcessWork, Request, RequestState

# The shortest gather window: below it, waking the thread costs more than a straggler would.
MIN_WINDOW_S = 0.002


@dataclasses.dataclass
class Decision:
    """What the scheduler thread does next: run `ready` now, or wait `wait_s` seconds (None: until
    something changes) and decide again."""

    ready: list[Request] | None = None
    wait_s: float | None = None


def decide(
    running: list[Request],
    last_batch: set[int],
    forward_ema: float,
    last_forward_end: float,
    gather_fraction: float,
    now: float,
) -> Decision:
    """The next step of the scheduler thread (see the module docstring).

    Args:
        running (`list[Request]`): the admitted requests, none of them cancelled.
        last_batch (`set[int]`): `seq` of the requests in the last forward.
        forward_ema (`float`): the forwards' recent time, in seconds.
        last_forward_end (`float`): when the last forward ended (`time.perf_counter()`).
        gather_fraction (`float`): the gather window as a fraction of `forward_ema`.
        now (`float`): `time.perf_counter()`.
    """
    ready = [r for r in running if r.state is RequestState.POSTED]
    if any(isinstance(r.work, ProcessWork) for r in ready) and not any(
        r.state is RequestState.PREPARING and r.shares_processing and r.seq in last_batch for r in running
    ):
        # Every request of the last forward that shares processing has posted it: run it now.
        return Decision(ready=ready)
    if not ready:
        return Decision()
    if not any(r.state is RequestState.PREPARING for r in running):
        return Decision(ready=ready)
    window = max(MIN_WINDOW_S, gather_fraction * forward_ema)
    since = max(last_forward_end, min(r.ready_since for r in ready))
    left = since + window - now
    if left <= 0:
        return Decision(ready=ready)
    return Decision(wait_s=left)
