"""Admission: requests take KV slots in arrival order, wait in a bounded queue, and give the slots back.

- A request is admitted when its rows fit in the free slots, in arrival order (strict FIFO: a large
  request at the head of the queue is not overtaken by small ones, so it cannot starve). Up to
  `max_queued` requests wait; beyond that the request fails with RESOURCE_EXHAUSTED and a
  `retry-after-s` hint (an estimate of when the first running request ends).
- Cancellation: the RPC's coroutine ending marks its request cancelled (or takes it off the queue);
  before the next forward the scheduler thread frees its slots (`free`), and its thread stops within
  one step.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from specwire.errors import ResourceExhausted
from specwire.runtime.slot_cache import SlotKVCache
from specwire.target_service.scheduler.request import Request, RequestState
from specwire.target_service.scheduler.stats import SchedulerStats


class SlotAdmission:
    """
    The wait queue and the running requests of a `BatchScheduler`. Every method runs under its lock.

    Args:
        cond (`threading.Condition`): the scheduler's lock, notified when slots are freed.
        cache (`SlotKVCache`): the slots.
        max_queued (`int`): requests that may wait for slots.
        counters (`SchedulerStats`): where rows and cancellations are recorded (`forwards` dates them).
        start_thread (`Callable[[Request], None]`): starts an admitted request's thread.
    """

    def __init__(
        self,
        cond: threading.Condition,
        cache: SlotKVCache,
        max_queued: int,
        counters: SchedulerStats,
        start_thread: Callable[[Request], None],
    ):
        self.cond = cond
        self.cache = cache
        self.max_queued = max_queued
        self.counters = counters
        self.start_thread = start_thread
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def admit(self, request: Request, step_seconds: float) -> None:
        """Start `request` now if nobody waits and its rows fit, else queue it; refuse it when the queue is full.

        Args:
            request (`Request`): a new request (QUEUED).
            step_seconds (`float`): the forwards' recent time, for the retry hint.
        """
        if not self.waiting and self._try_start(request):
            return
        if len(self.waiting) >= self.max_queued:
            raise ResourceExhausted(
                f"the target service is at capacity: {len(self.running)} requests running, "
                f"{len(self.waiting)} queued (--max-queued {self.max_queued}); retry later",
                retry_after_s=self.retry_hint(step_seconds),
            )
        self.waiting.append(request)

    def admit_waiting(self) -> None:
        """Start the queued requests that fit now, in arrival order (the first that does not fit stops it)."""
        while self.waiting and self._try_start(self.waiting[0]):
            self.waiting.popleft()

    def _try_start(self, request: Request) -> bool:
        slots = self.cache.allocate(request.plan.rows)
        if slots is None:
            return False
        request.slots = slots
        request.state = RequestState.STARTING
        self.running.append(request)
        self.counters.record_rows(sum(len(r.slots) for r in self.running))
        self.start_thread(request)
        return True

    def cancel(self, request: Request) -> None:
        """The request's RPC ended: take it off the queue, or mark it for `free` before the next forward."""
        if request.state is RequestState.FINISHED:
            return
        if request.state is RequestState.QUEUED:
            self.waiting.remove(request)
            request.state = RequestState.FINISHED
            return
        request.state = RequestState.CANCELLED
        request.cancelled_at_forward = self.counters.forwards
        self.cond.notify_all()

    def free(self, request: Request) -> None:
        """Give `request`'s slots back; it is FINISHED."""
        if request in self.running:
            self.running.remove(request)
        self.cache.release(request.slots)
        request.slots = []
        request.state = RequestState.FINISHED
        request.freed_at_forward = self.counters.forwards
        if request.cancelled_at_forward is not None:
            self.counters.record_cancellation(request.cancelled_at_forward, request.freed_at_forward)
        self.cond.notify_all()

    def full(self, step_seconds: float) -> float | None:
        """A retry hint in seconds when the wait queue is full (a new request would be refused), else None."""
        if len(self.waiting) < self.max_queued:
            return None
        if not self.waiting and self.cache.free:
            return None  # a request that fits the free slots starts without queueing
        return self.retry_hint(step_seconds)

    def retry_hint(self, step_seconds: float) -> float:
        """Seconds until the first running request should end (a hint, not a promise)."""
        step = step_seconds or 0.05
        remaining = min((r.plan.max_new_tokens - r.steps for r in self.running), default=1)
        return float(min(max(step * max(remaining, 1), 0.05), 60.0))
