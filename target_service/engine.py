"""Runs decoding jobs on the model, one step at a time, off the event loop.

With `scheduler="batched"` (the default), requests the slot cache can serve go to `BatchScheduler`
(`target_service/scheduler.py`): one packed forward per step for all of them. The rest (the
sequential lane: no cache, classifier-free guidance, over-long or over-wide requests) and every
request with `scheduler="sequential"` take the one-request-per-step path below.

One request per step: every model step runs on one model thread (the scheduler's, or a worker of
our own with `"sequential"`), so concurrent requests interleave step by step (the forward passes
never race on the model) and each request keeps its own state (its generator, its KV cache, its
`torch.Generator`). Between two steps the request's coroutine checks for cancellation: a cancelled
or timed-out request stops consuming compute within one step, and its generator is closed on the
model thread so its cache is freed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import AsyncIterator

import torch

from specwire.errors import ResourceExhausted
from specwire.generation.decoding import iter_generate
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.speculative_loop import iter_speculative
from specwire.model_thread import model_executor
from specwire.models import LoadedModel
from target_service.drafting import DraftPolicy
from target_service.requests import GenerationJob
from target_service.scheduler import SCHEDULERS, BatchScheduler, SchedulerOptions

log = logging.getLogger("specwire.target_service.engine")

_DONE = object()


class Engine:
    """Step-by-step execution of generation jobs on one model.

    Args:
        loaded (`LoadedModel`): the model, tokenizer and the model's generation config.
        drafting (`DraftPolicy`, *optional*): speculation settings.
        scheduler (`str`, defaults to `"batched"`): `"batched"` (shared packed forwards, see
            `target_service.scheduler`) or `"sequential"` (one request per forward).
        scheduler_options (`SchedulerOptions`, *optional*): limits of the batched scheduler.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        drafting: DraftPolicy | None = None,
        scheduler: str = "batched",
        scheduler_options: SchedulerOptions | None = None,
    ):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        self.loaded = loaded
        self.drafting = drafting or DraftPolicy()
        self.active = 0  # requests between their first and last step
        self.lane_active = 0  # requests in the batched scheduler's sequential lane
        self._lane_steps = 0
        self._lock = threading.Lock()
        self.scheduler = scheduler
        self.batcher: BatchScheduler | None = None
        if scheduler == "batched":
            self.batcher = BatchScheduler(
                loaded.model, self._start, scheduler_options, loaded.max_position_embeddings
            )
        # Every forward runs on one thread (`specwire.model_thread`): the scheduler's when it runs
        # (the sequential lane's steps run between its packed forwards), else a worker of our own.
        if self.batcher is not None and self.batcher.enabled:
            self.executor = self.batcher.executor
        else:
            self.executor = model_executor("specwire-model")

    @property
    def steps_run(self) -> int:
        """Model steps executed, over all requests (observability and tests)."""
        return self._lane_steps + (self.batcher.forwards if self.batcher is not None else 0)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _start(self, job: GenerationJob, rows_factory=None):
        generator = None
        if job.config.seed is not None:
            generator = torch.Generator(device=self.loaded.model.device).manual_seed(job.config.seed)
        device = self.loaded.model.device
        common = dict(
            config=job.config,
            tokenizer=self.loaded.tokenizer,
            generator=generator,
            negative_prompt_ids=job.negative_prompt_ids,
            negative_prompt_attention_mask=job.negative_prompt_attention_mask,
            max_position_embeddings=self.loaded.max_position_embeddings,
            rows_factory=rows_factory,
        )
        input_ids = job.input_ids.to(device)
        mask = None if job.attention_mask is None else job.attention_mask.to(device)
        proposer = self.drafting.proposer(job.proposer, job.config)
        job.speculation.proposer = proposer
        if proposer == "none":
            return iter_generate(self.loaded.model, input_ids, mask, **common)
        return iter_speculative(
            self.loaded.model,
            input_ids,
            mask,
            open_drafter=self.drafting.opener(proposer, self.loaded.vocab_size),
            stats=job.speculation,
            draft_length=self.drafting.draft_length(proposer, job.config),
            **common,
        )

    def _step(self, steps):
        self._lane_steps += 1  # only the worker thread writes it
        try:
            return next(steps)
        except StopIteration as stop:
            return _DONE, stop.value

    async def run(self, job: GenerationJob) -> AsyncIterator[StepEvent | GenerationResult]:
        """Yield the job's step events, then its `GenerationResult`."""
        if self.batcher is not None and self.batcher.enabled:
            lane, plan = self.batcher.lane_reason(job)  # invalid requests raise here
            if not lane:
                with self._lock:
                    self.active += 1
                try:
                    async for item in self.batcher.run(job, plan):
                        yield item
                finally:
                    with self._lock:
                        self.active -= 1
                return
            log.debug("request %s runs in the sequential lane: %s", job.request_id or "-", lane)
            limit = self.batcher.options.max_lane_requests
            with self._lock:
                if self.lane_active >= limit:
                    raise ResourceExhausted(
                        f"the target service's sequential lane (requests the batched scheduler cannot "
                        f"serve; this one: {lane}) is full: {self.lane_active} running "
                        f"(--max-lane-requests {limit}); retry later",
                        retry_after_s=1.0,
                    )
                self.lane_active += 1
            try:
                async for item in self._run_one_per_step(job):
                    yield item
            finally:
                with self._lock:
                    self.lane_active -= 1
            return
        async for item in self._run_one_per_step(job):
            yield item

    async def _run_one_per_step(self, job: GenerationJob) -> AsyncIterator[StepEvent | GenerationResult]:
        """The one-request-per-step path: every step of `job` a call on the model thread."""
        loop = asyncio.get_running_loop()
        # run_in_executor does not carry contextvars: the worker runs each call inside the request's
        # context, so the draft stream's client span is a child of the request's span (tracing).
        context = contextvars.copy_context()
        # Validation, length resolution and processor construction run here (errors raise here),
        # on the worker: building stop-string tables for a large vocabulary takes a moment.
        steps = await loop.run_in_executor(self.executor, context.run, _in_inference_mode, self._start, job)
        with self._lock:
            self.active += 1
        try:
            while True:
                item = await loop.run_in_executor(self.executor, context.run, _in_inference_mode, self._step, steps)
                if isinstance(item, tuple) and item and item[0] is _DONE:
                    yield item[1]
                    return
                yield item
        finally:
            with self._lock:
                self.active -= 1
            # Closing runs the generator's cleanup on the worker, after any step in flight.
            self.executor.submit(_close_quietly, steps, job.request_id)

    def queue_full(self) -> float | None:
        """A retry hint in seconds when the batched scheduler's queue is full, else None (a cheap probe:
        the service refuses a request with it before preparing the request)."""
        if self.batcher is not None and self.batcher.enabled:
            return self.batcher.queue_full()
        return None


def _in_inference_mode(fn, *args):
    with torch.inference_mode():
        return fn(*args)


def _close_quietly(steps, request_id: str) -> None:
    try:
        steps.close()
    except Exception:  # noqa: BLE001 - cleanup of an abandoned request must not kill the worker
        log.exception("closing request %s failed", request_id)
