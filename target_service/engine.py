"""Runs decoding jobs on the model, one step at a time, off the event loop.

Every model step of every request runs on one worker thread, so concurrent requests interleave
step by step (the forward passes never race on the model) and each request keeps its own state
(its generator, its KV cache, its `torch.Generator`). Between two steps the request's coroutine
checks for cancellation: a cancelled or timed-out request stops consuming compute within one
step, and its generator is closed on the worker so its cache is freed.

The scheduler of a later stage can replace this one-request-per-step policy by batching steps of
several requests (the decoding loop is already shaped as steps over rows).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import torch

from specwire.generation.decoding import iter_generate
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.speculative_loop import iter_speculative
from specwire.models import LoadedModel
from target_service.drafting import DraftPolicy
from target_service.requests import GenerationJob

log = logging.getLogger("specwire.target_service.engine")

_DONE = object()


class Engine:
    """Step-by-step execution of generation jobs on one model.

    Args:
        loaded (`LoadedModel`): the model, tokenizer and the model's generation config.
    """

    def __init__(self, loaded: LoadedModel, drafting: DraftPolicy | None = None):
        self.loaded = loaded
        self.drafting = drafting or DraftPolicy()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specwire-model")
        self.active = 0  # requests between their first and last step
        self.steps_run = 0  # model steps executed, over all requests (observability and tests)
        self._lock = threading.Lock()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _start(self, job: GenerationJob):
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
        )
        input_ids = job.input_ids.to(device)
        mask = None if job.attention_mask is None else job.attention_mask.to(device)
        proposer = self.drafting.proposer(job.proposer, job.config)
        job.speculation.proposer = proposer
        if proposer == "none":
            return iter_generate(self.loaded.model, input_ids, mask, **common)
        return iter_speculative(
            self.loaded.model, input_ids, mask,
            open_drafter=self.drafting.opener(proposer, self.loaded.vocab_size),
            stats=job.speculation,
            draft_length=self.drafting.draft_length(proposer, job.config),
            **common,
        )

    def _step(self, steps):
        self.steps_run += 1  # only the worker thread writes it
        try:
            return next(steps)
        except StopIteration as stop:
            return _DONE, stop.value

    async def run(self, job: GenerationJob) -> AsyncIterator[StepEvent | GenerationResult]:
        """Yield the job's step events, then its `GenerationResult`."""
        loop = asyncio.get_running_loop()
        # Validation, length resolution and processor construction run here (errors raise here),
        # on the worker: building stop-string tables for a large vocabulary takes a moment.
        steps = await loop.run_in_executor(self.executor, _in_inference_mode, self._start, job)
        with self._lock:
            self.active += 1
        try:
            while True:
                item = await loop.run_in_executor(self.executor, _in_inference_mode, self._step, steps)
                if isinstance(item, tuple) and item and item[0] is _DONE:
                    yield item[1]
                    return
                yield item
        finally:
            with self._lock:
                self.active -= 1
            # Closing runs the generator's cleanup on the worker, after any step in flight.
            self.executor.submit(_close_quietly, steps, job.request_id)


def _in_inference_mode(fn, *args):
    with torch.inference_mode():
        return fn(*args)


def _close_quietly(steps, request_id: str) -> None:
    try:
        steps.close()
    except Exception:  # noqa: BLE001 - cleanup of an abandoned request must not kill the worker
        log.exception("closing request %s failed", request_id)
