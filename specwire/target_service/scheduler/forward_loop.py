"""The scheduler thread: it runs every forward of the model, and nothing else.

Each turn (under the scheduler's lock) it frees cancelled requests' slots, admits queued requests,
then runs, by priority:
1. the posted sequential-lane model calls (`BatchScheduler.forward`), between two packed forwards;
2. posted logits processing, as one `BatchedChains.apply` with each row's parameters as `[rows]`
   tensors (rebuilt only when the batch's requests change);
3. one packed forward over the posted work of every running request the gather policy picked
   (`gather_policy`): decode rows give 1 token, verify rows their own block, new requests' prefills
   share the rest of `max_tokens_per_step` (at least `min_prefill_tokens`), chunked in admission
   order so a long prompt does not stall the running requests.
No request's loop and no draft wait runs here (see `specwire.model_thread` for why one thread).

A forward that raises fails the requests in it, not the server; a device error (after a CUDA error
the device context is unusable) stops the scheduler for good: every request then fails UNAVAILABLE.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

import torch

from specwire.errors import Unavailable
from specwire.model_thread import claim_torch_threads, is_device_error
from specwire.runtime.slot_cache import SlotKVCache, SlotWork, execute
from specwire.target_service.scheduler import gather_policy
from specwire.target_service.scheduler.request import ProcessWork, Request, RequestState
from specwire.target_service.scheduler.slot_admission import SlotAdmission
from specwire.target_service.scheduler.startup_probe import build_slot_cache

if TYPE_CHECKING:
    from specwire.target_service.scheduler.batch_scheduler import BatchScheduler

log = logging.getLogger("specwire.target_service.scheduler")

# A sequential-lane model call: (future, fn, args, posted at).
LaneCall = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], float]


class ForwardLoop:
    """
    The body of the scheduler thread of a `BatchScheduler` (see the module docstring).

    Args:
        scheduler (`BatchScheduler`): its lock, requests, slot cache, lane calls and counters.
    """

    def __init__(self, scheduler: BatchScheduler):
        self.scheduler = scheduler
        self.cond = scheduler.cond
        self.forward_ema = 0.0  # the forwards' recent time (gather window, retry hint)
        self.last_forward_end = time.perf_counter()
        self.last_batch: set[int] = set()  # `seq` of the requests in the last forward
        self.progress_at = time.perf_counter()  # the last forward, processing or lane call done (liveness)

    def run(self, built: threading.Event) -> None:
        """The thread: set up the slot cache (its probes run forwards), then serve until closed."""
        scheduler = self.scheduler
        claim_torch_threads(scheduler.threads)
        try:
            scheduler.set_up(build_slot_cache(scheduler.model, scheduler.options, scheduler.max_position_embeddings))
        finally:
            built.set()
        if scheduler.admission is None:
            return
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread dies: say so, fail everyone waiting on it
            log.critical("the batched scheduler's thread died", exc_info=exc)
            scheduler.fail_all(f"the scheduler thread died: {type(exc).__name__}: {exc}")
            return
        with self.cond:
            calls = list(scheduler.calls)
            scheduler.calls.clear()
        for future, *_ in calls:
            future.cancel()

    def _gather(self) -> list[Request] | None:
        """Wait (holding the lock) until something should run; the requests of the next forward or
        processing ([] for lane calls only), or None when closed."""
        scheduler = self.scheduler
        admission = cast(SlotAdmission, scheduler.admission)  # the loop serves only where it is set
        while True:
            if scheduler.closed:
                return None
            for request in [r for r in admission.running if r.state is RequestState.CANCELLED]:
                request.work = None
                admission.free(request)
            admission.admit_waiting()
            if scheduler.calls:  # sequential-lane forwards go first; the packed forward follows right after
                return []
            decision = gather_policy.decide(
                admission.running,
                self.last_batch,
                self.forward_ema,
                self.last_forward_end,
                scheduler.options.gather_fraction,
                time.perf_counter(),
            )
            if decision.ready is not None:
                return decision.ready
            self.cond.wait(decision.wait_s)

    def _serve(self) -> None:
        options = self.scheduler.options
        while True:
            with self.cond:
                ready = self._gather()
                if ready is None:
                    return
                calls = list(self.scheduler.calls)
                self.scheduler.calls.clear()
                processing = [r for r in ready if isinstance(r.work, ProcessWork)]
                if not calls and not processing:
                    # No processing: every ready request posted a forward (`SlotWork`).
                    steps = [r for r in ready if cast(SlotWork, r.work).keep_all]
                    prefills = sorted((r for r in ready if not cast(SlotWork, r.work).keep_all), key=lambda r: r.seq)
                    step_tokens = sum(cast(SlotWork, r.work).remaining for r in steps)
                    budget = step_tokens + max(options.max_tokens_per_step - step_tokens, options.min_prefill_tokens)
                    batch = steps + prefills
                    works = [cast(SlotWork, r.work) for r in batch]
            if calls:
                self._run_calls(calls)
            elif processing:
                self._run_processing(processing)
            else:
                self._run_forward(batch, works, budget)

    def _run_forward(self, batch: list[Request], works: list[SlotWork], budget: int) -> None:
        """One packed forward over `works` (of `batch`'s requests) within `budget` tokens."""
        started = time.perf_counter()
        failure = None
        try:
            with torch.inference_mode():
                ran = execute(
                    self.scheduler.model, cast(SlotKVCache, self.scheduler.cache), works, budget, self.scheduler.decoder
                )
        except Exception as exc:  # noqa: BLE001 - fails the requests in this forward, not the server
            log.exception("batched forward failed")
            failure, ran = exc, 0
            if is_device_error(exc):
                failure = self._device_failed(exc)
        ended = time.perf_counter()
        with self.cond:
            elapsed = ended - started
            self.scheduler.counters.record_forward(len(batch), ran, elapsed, started - self.last_forward_end)
            self.forward_ema = elapsed if not self.forward_ema else 0.8 * self.forward_ema + 0.2 * elapsed
            self.last_forward_end = self.progress_at = ended
            self.last_batch = {r.seq for r in batch}
            for request, work in zip(batch, works, strict=True):
                if failure is not None:
                    request.failure = failure
                    request.take_work()
                elif work.finished and request.work is work:
                    request.take_work()
                    request.steps += 1
            self.cond.notify_all()

    def _run_calls(self, calls: list[LaneCall]) -> None:
        """Run the posted sequential-lane forwards (between packed forwards)."""
        for future, fn, args, _ in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - delivered to the lane request
                if is_device_error(exc):
                    exc = self._device_failed(exc)
                future.set_exception(exc)
            except BaseException as exc:  # the thread dies (see `run`): its caller must not wait forever
                future.set_exception(Unavailable(f"the target service cannot generate: {type(exc).__name__}"))
                raise
        with self.cond:
            self.scheduler.counters.lane_forwards += len(calls)
            self.progress_at = time.perf_counter()

    def _run_processing(self, requests: list[Request]) -> None:
        """One `BatchedChains.apply` over the posted processing of `requests`."""
        works = [cast(ProcessWork, r.work) for r in requests]
        items = [item for work in works for item in work.items]
        failure = None
        try:
            with torch.inference_mode():
                outputs = self.scheduler.chains.apply(items)
        except Exception as exc:  # noqa: BLE001 - fails these requests, not the server
            log.exception("batched logits processing failed")
            failure = exc
        with self.cond:
            self.progress_at = time.perf_counter()
            self.scheduler.counters.record_processing(len(requests))
            for request, work in zip(requests, works, strict=True):
                if failure is not None:
                    request.failure = failure
                else:
                    work.outputs, outputs = outputs[: len(work.items)], outputs[len(work.items) :]
                if request.work is work:
                    request.take_work()
            self.cond.notify_all()

    def _device_failed(self, exc: BaseException) -> Unavailable:
        """A forward raised a device error: the scheduler stops serving (sticky), every request fails."""
        log.critical("device error in a forward: the target service stops serving", exc_info=exc)
        reason = f"the device failed in a forward ({type(exc).__name__}: {exc}); restart the service"
        self.scheduler.fail_all(reason)
        return Unavailable(f"the target service cannot generate: {reason}")
