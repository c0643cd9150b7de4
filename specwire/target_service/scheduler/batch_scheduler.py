"""`BatchScheduler`: one model forward per step for every running request of the target service.

It owns the shared state (one lock, `cond`, guards all of it: the requests, the slots, the lane's
posted calls, the counters) and the public face the engine uses: `lane_reason` (routing), `run`
(admit a request and stream its events), `forward` (a sequential-lane model call), `problem`
(liveness), `queue_full`, `stats`, `close`. The parts it is built from live next to it in this
package (see `specwire.target_service.scheduler`).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, cast

import torch

from specwire.errors import Unavailable
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.planning import prepare_generation
from specwire.generation.processors.batched import BatchedChains
from specwire.model_thread import STOP_TIMEOUT_S, join_or_report
from specwire.runtime.lean_decoder import LeanDecoder
from specwire.runtime.slot_cache import SlotKVCache, slot_support
from specwire.target_service.scheduler.forward_loop import ForwardLoop, LaneCall
from specwire.target_service.scheduler.options import SchedulerOptions
from specwire.target_service.scheduler.request import Request, RequestState
from specwire.target_service.scheduler.request_thread import RequestThread
from specwire.target_service.scheduler.routing import lane_reason
from specwire.target_service.scheduler.slot_admission import SlotAdmission
from specwire.target_service.scheduler.startup_probe import SlotSetup
from specwire.target_service.scheduler.stats import SchedulerStats

log = logging.getLogger("specwire.target_service.scheduler")


class BatchScheduler:
    """
    Runs the model steps of many requests as shared packed forwards (see the package docstring).

    Its parts (`ForwardLoop`, `RequestThread`, `SlotAdmission`) share its state, all under `cond`:
    `admission` (the requests and their slots), `calls` (posted lane calls), `counters`,
    `failure_reason`, `closed`. `cache`, `decoder` and `admission` are set once, by the scheduler thread
    at start-up (`set_up`), before anything else reads them.

    Args:
        model (`PreTrainedModel`): the served model.
        start (`Callable`): `start(job, rows_factory, drafting=..., plan=...) -> step generator` (the
            engine's loop factory; `plan` is the one `lane_reason` made).
        options (`SchedulerOptions`, *optional*): limits.
        max_position_embeddings (`int`, *optional*): the model's context length.
    """

    def __init__(
        self,
        model: Any,
        start: Callable[..., Any],
        options: SchedulerOptions | None = None,
        max_position_embeddings: int | None = None,
        tokenizer: Any = None,
    ):
        self.model = model
        self.tokenizer = tokenizer  # for structured output (a request's grammar is compiled for it)
        self.start = start
        self.options = options or SchedulerOptions()
        self.max_position_embeddings = max_position_embeddings
        self.cond = threading.Condition()
        self.counters = SchedulerStats()  # updated under `cond`; `stats()` hands out copies
        self.chains = BatchedChains()
        self.calls: deque[LaneCall] = deque()  # sequential-lane model calls posted to the scheduler thread
        self.request_threads: set[threading.Thread] = set()  # admitted requests' own threads (under `cond`)
        self.closed = False
        # Liveness: why the scheduler can no longer serve (sticky).
        self.failure_reason = ""
        self._seq = 0
        # Set up on the scheduler thread (`set_up`); None while (or when) the batched path cannot serve.
        self.cache: SlotKVCache | None = None
        self.decoder: LeanDecoder | None = None  # see `SchedulerOptions.lean_forward`
        self.admission: SlotAdmission | None = None
        self.unsupported = slot_support(model)
        self.threads = torch.get_num_threads()
        self.loop = ForwardLoop(self)
        self.thread: threading.Thread | None = None
        if not self.unsupported:
            # The start-up probe runs forwards, so it runs on the scheduler thread too.
            built = threading.Event()
            self.thread = threading.Thread(target=self.loop.run, args=(built,), name="specwire-scheduler", daemon=True)
            self.thread.start()
            built.wait()
        if self.cache is None:
            log.warning("batched scheduler disabled, serving every request sequentially: %s", self.unsupported)

    def set_up(self, setup: SlotSetup) -> None:
        """Take what the start-up probe found (on the scheduler thread, before it serves)."""
        self.cache, self.decoder = setup.cache, setup.decoder
        self.unsupported = setup.unsupported or self.unsupported
        if setup.cache is not None:
            self.admission = SlotAdmission(
                self.cond,
                setup.cache,
                self.options.max_queued,
                self.counters,
                lambda request: RequestThread(self, request).start(),
            )

    @property
    def enabled(self) -> bool:
        return self.cache is not None

    # -- routing and the async side ----------------------------------------------------------------

    def lane_reason(self, job: Any) -> tuple[str, Any]:
        """Why `job` runs in the sequential lane ("" when it is batched), and its resolved plan."""
        if self.cache is None:
            return self.unsupported or "batched scheduler disabled", None
        plan = prepare_generation(
            self.model,
            job.input_ids,
            job.attention_mask,
            config=job.config,
            max_position_embeddings=self.max_position_embeddings,
            structured_output=job.structured_output,
            tokenizer=self.tokenizer,
            allowed_token_sequences=job.allowed_token_sequences,
            logits_processor=job.logits_processor,
            stopping_criteria=job.stopping_criteria,
        )
        return lane_reason(plan, self.cache), plan

    async def run(self, job: Any, plan: Any) -> AsyncIterator[StepEvent | GenerationResult]:
        """Admit `job`, yield its step events, then its `GenerationResult`."""
        loop = asyncio.get_running_loop()
        with self.cond:
            if self.failure_reason:
                raise Unavailable(f"the target service cannot generate: {self.failure_reason}")
            self._seq += 1
            request = Request(job, plan, loop, self._seq)
            # The request's thread runs in the RPC's context (tracing spans, telemetry).
            request.context = contextvars.copy_context()
            cast(SlotAdmission, self.admission).admit(request, self.loop.forward_ema)  # callers check `enabled`
        try:
            while True:
                kind, value = await request.events.get()
                if kind == "error":
                    raise value
                yield value
                if kind == "result":
                    return
        finally:
            self.cancel(request)

    def cancel(self, request: Request) -> None:
        """The request's RPC ended: drop it from the queue or free its slots before the next forward."""
        with self.cond:
            cast(SlotAdmission, self.admission).cancel(request)

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` (a sequential-lane request's model call) on the scheduler thread,
        between packed forwards, and return its result; the caller's thread waits for it."""
        future: Future[Any] = Future()
        with self.cond:
            if self.failure_reason:
                raise Unavailable(f"the target service cannot generate: {self.failure_reason}")
            if self.closed or self.cache is None:
                raise Unavailable("the batched scheduler is not running")
            self.calls.append((future, _in_inference_mode, (fn, args, kwargs), time.perf_counter()))
            self.cond.notify_all()
        return future.result()

    # -- liveness ---------------------------------------------------------------------------------

    def fail_all(self, reason: str) -> None:
        """Stop serving for `reason`: running and queued requests fail UNAVAILABLE, new ones are refused."""
        error = Unavailable(f"the target service cannot generate: {reason}")
        with self.cond:
            self.failure_reason = self.failure_reason or reason
            admission = cast(SlotAdmission, self.admission)  # only the batched path fails this way
            for request in admission.running:
                request.failure = error
                request.take_work()  # not run again: its thread raises `error`
            while admission.waiting:
                request = admission.waiting.popleft()
                request.state = RequestState.FINISHED
                request.send("error", error)
            calls = list(self.calls)
            self.calls.clear()
            self.cond.notify_all()
        for future, *_ in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def problem(self, stuck_after: float) -> str:
        """Why this scheduler cannot serve now ("" when it can): dead thread, device error, or stuck.

        Args:
            stuck_after (`float`): seconds posted work may wait with no forward (or processing, or lane
                forward) done before the forward loop counts as stuck.
        """
        if self.cache is None:
            return ""
        # Never block the caller (the server's event loop) on a lock held by a stuck thread.
        if not self.cond.acquire(timeout=1.0):
            return "the scheduler's lock has been held for over 1s"
        try:
            if self.failure_reason:
                return self.failure_reason
            # A cache was set up on the scheduler thread, and with it the admission.
            if not cast(threading.Thread, self.thread).is_alive() and not self.closed:
                return "the scheduler thread is dead"
            # `work` (not the state): a cancelled request's work counts until the scheduler thread reaps it.
            pending = [r.ready_since for r in cast(SlotAdmission, self.admission).running if r.work is not None]
            pending += [posted for *_, posted in self.calls]
            if not pending:
                return ""
            stalled = time.perf_counter() - max(self.loop.progress_at, min(pending))
        finally:
            self.cond.release()
        if stalled > stuck_after:
            return (
                f"the forward loop is stuck: work has waited {stalled:.1f}s with no forward done "
                f"(--stuck-after {stuck_after:g})"
            )
        return ""

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Cancel the running requests and stop the scheduler thread, waiting up to `timeout` seconds for it
        (the requests' threads end at their next work: `join_requests`)."""
        with self.cond:
            self.closed = True
            if self.admission is not None:
                for request in self.admission.running:
                    request.state = RequestState.CANCELLED
            self.cond.notify_all()
        if self.thread is not None:
            join_or_report([self.thread], timeout)

    def join_requests(self, timeout: float) -> None:
        """Wait up to `timeout` seconds in all for the requests' own threads to end (after `close`)."""
        with self.cond:
            threads = list(self.request_threads)
        join_or_report(threads, timeout)

    # -- capacity and statistics --------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        with self.cond:
            return len(self.cache.free) if self.cache is not None else 0

    def queue_full(self) -> float | None:
        """A retry hint in seconds when the wait queue is full (a new request would be refused), else None."""
        with self.cond:
            if self.admission is None:
                return None
            return self.admission.full(self.loop.forward_ema)

    def stats(self) -> SchedulerStats:
        """A copy of the counters since start-up, with the gauges of this moment (running, queued, ...)."""
        with self.cond:
            admission = self.admission
            if admission is None:
                return dataclasses.replace(self.counters)
            return dataclasses.replace(
                self.counters,
                running=len(admission.running),
                queued=len(admission.waiting),
                drafting=sum(r.state is RequestState.DRAFTING for r in admission.running),
                free_slots=len(admission.cache.free),
            )


def _in_inference_mode(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Grad mode is per thread: the lane request's thread runs in inference mode, so its forwards do too.
    with torch.inference_mode():
        return fn(*args, **kwargs)
