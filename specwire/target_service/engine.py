"""Runs decoding jobs on the model, one step at a time, off the event loop.

With `SchedulerKind.BATCHED` (the default), requests the slot cache can serve go to `BatchScheduler`
(`specwire.target_service.scheduler`): one packed forward per step for all of them. The rest (the
sequential lane: no cache, classifier-free guidance, over-long or over-wide requests) and every
request with `SchedulerKind.SEQUENTIAL` take the one-request-per-step path below.

One request per step. With `SEQUENTIAL`, every step runs on one model thread (a worker of our
own), so concurrent requests interleave step by step (the forward passes never race on the model).
In the batched scheduler's lane, each request's steps run in a thread of its own and only its model
calls run on the scheduler thread (`BatchScheduler.forward`), so its draft waits and loop work never
hold up the packed forwards. Each request keeps its own state (its generator, its KV cache, its
`torch.Generator`). Between two steps the request's coroutine checks for cancellation: a cancelled
or timed-out request stops consuming compute within one step, and its generator is closed on the
thread that ran it so its cache is freed.

A request with a generate method plugin (`specwire.generation.generate_methods`) always takes the
sequential lane; its one step runs the whole method on the model thread, and the method's own
`check()` calls are where it notices cancellation and its deadline.

Liveness (`problem`): the scheduler's report (dead thread, device error, stuck forward loop), a
device error on the sequential path, or a sequential step running longer than `stuck_after_s`.
New requests then fail UNAVAILABLE at once; the server's watchdog reports NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from specwire.deadline import caller_deadline
from specwire.errors import FieldProblem, InvalidArgument, ResourceExhausted, Unavailable
from specwire.generation.compilation import compile_warning, compiled_call
from specwire.generation.config import uses_static_cache
from specwire.generation.generate_methods import GenerateMethodSteps, run_generate_method
from specwire.generation.loops.generate import generate_from_plan
from specwire.generation.loops.speculative import speculate_from_plan, speculation_blocker
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.planning import GenerationPlan, prepare_generation
from specwire.generation.speculation.drafters import Drafter, Proposal
from specwire.model_thread import STOP_TIMEOUT_S, ModelExecutor, is_device_error
from specwire.models import LoadedModel
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.requests import GenerationJob
from specwire.target_service.scheduler.batch_scheduler import BatchScheduler
from specwire.target_service.scheduler.options import SchedulerKind, SchedulerOptions
from specwire.vocabulary import PROPOSER_NONE

log = logging.getLogger("specwire.target_service.engine")

_DONE = object()


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is at one moment: the autoscaling signals (`specwire.target_service.observability`).

    Args:
        running (`int`): requests generating (holding KV slots, in the sequential lane, or stepping one
            per forward).
        queued (`int`): requests waiting for KV slots (the batched scheduler's FIFO queue).
        kv_slots_used (`int`): KV-cache slots (one per running row) taken.
        kv_slots (`int`): KV-cache slots in all; 0 when no slot cache serves (sequential scheduling).
    """

    running: int
    queued: int
    kv_slots_used: int
    kv_slots: int


class Engine:
    """Step-by-step execution of generation jobs on one model.

    Args:
        loaded (`LoadedModel`): the model, tokenizer and the model's generation config.
        drafting (`DraftPolicy`, *optional*): speculation settings; the engine owns it (`close` closes its channel).
        scheduler (`SchedulerKind` or its value, defaults to `SchedulerKind.BATCHED`): `BATCHED` (shared
            packed forwards, see `specwire.target_service.scheduler`) or `SEQUENTIAL` (one request per
            forward).
        scheduler_options (`SchedulerOptions`, *optional*): limits of the batched scheduler.
        stuck_after_s (`float`, defaults to 60.0): seconds the model may make no progress while work
            waits before the engine reports itself stuck (`problem`).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        drafting: DraftPolicy | None = None,
        scheduler: SchedulerKind | str = SchedulerKind.BATCHED,
        scheduler_options: SchedulerOptions | None = None,
        stuck_after_s: float = 60.0,
    ):
        try:
            kind = SchedulerKind(scheduler)
        except ValueError:
            raise ValueError(
                f"scheduler must be one of {[member.value for member in SchedulerKind]}, got {scheduler!r}"
            ) from None
        if stuck_after_s <= 0:
            raise ValueError(f"stuck_after_s must be > 0, got {stuck_after_s}")
        self.stuck_after_s = stuck_after_s
        self.device_error = ""  # sticky: set when a sequential step failed on the device
        self._step_started: float | None = None  # a step running on the model thread, since
        # id(job) -> the drafters it opened: closed when its RPC ends, so that a cancelled request's
        # thread stops waiting on its draft service at once (not after the round's timeout).
        self._drafters: dict[int, list[Drafter]] = {}
        # id(job) -> its proposer, while it runs (only beside its `_drafters` entry, popped with it): requests
        # drafting with the same draft service wait for each other's drafts (the controller's `draft_load`).
        self._proposers: dict[int, str] = {}
        self.loaded = loaded
        self.drafting = drafting or DraftPolicy()
        self.active = 0  # requests between their first and last step
        self.lane_active = 0  # requests in the batched scheduler's sequential lane
        self._lane_steps = 0
        self._lock = threading.Lock()
        # The batched scheduler, None with SchedulerKind.SEQUENTIAL (`scheduler` is derived from it).
        self.batcher: BatchScheduler | None = None
        if kind is SchedulerKind.BATCHED:
            self.batcher = BatchScheduler(
                loaded.model, self._start, scheduler_options, loaded.max_position_embeddings, loaded.tokenizer
            )
        # Every forward runs on one thread (`specwire.model_thread`): the scheduler's when it runs
        # (the sequential lane posts its forwards there), else this worker of our own.
        self.executor = ModelExecutor("specwire-model")
        # The lane's requests' model: the served one, with every call posted to the scheduler thread.
        self._lane_model = _ForwardsOn(loaded.model, self._serving) if self._serving is not None else None
        # The served model for model work that a preparation thread starts (token healing): every call runs
        # on the model thread, the scheduler's or this engine's worker, and the calling thread waits for it.
        self.on_model_thread: Any = (
            self._lane_model if self._lane_model is not None else _CallsOn(loaded.model, self.executor)
        )

    @property
    def scheduler(self) -> SchedulerKind:
        """The scheduler this engine was built with. A `BATCHED` one whose model the slot cache cannot
        serve (`batcher.enabled` is False, `batcher.unsupported` says why) runs every request one per
        forward, as `SEQUENTIAL` does."""
        return SchedulerKind.SEQUENTIAL if self.batcher is None else SchedulerKind.BATCHED

    @property
    def _serving(self) -> BatchScheduler | None:
        """The batched scheduler when it serves (its start-up probe accepted the model), else None."""
        return self.batcher if self.batcher is not None and self.batcher.enabled else None

    @property
    def steps_run(self) -> int:
        """Model steps executed, over all requests (observability and tests)."""
        return self._lane_steps + (self.batcher.stats().forwards if self.batcher is not None else 0)

    def load(self) -> EngineLoad:
        """Running and queued requests and KV slot use, now (cheap: one lock, no model work)."""
        batcher = self._serving
        if batcher is None:
            return EngineLoad(running=self.active, queued=0, kv_slots_used=0, kv_slots=0)
        stats = batcher.stats()
        slots = batcher.cache.num_slots if batcher.cache is not None else 0
        # `active` also counts the batched requests still queued: the scheduler's own gauges say who runs.
        return EngineLoad(
            running=stats.running + self.lane_active,
            queued=stats.queued,
            kv_slots_used=slots - stats.free_slots if slots else 0,
            kv_slots=slots,
        )

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop every thread the engine started, within `timeout` seconds for each kind: the running requests
        are cancelled and the scheduler thread stops, the draft streams are cancelled (a request waiting for a
        draft falls back and meets its cancel at its next forward), then the requests' threads and the model
        thread are joined; any still running is reported (`specwire.model_thread.join_or_report`)."""
        if self.batcher is not None:
            self.batcher.close(timeout)
        self.drafting.close()
        if self.batcher is not None:
            self.batcher.join_requests(timeout)
        self.executor.close(timeout)

    def problem(self) -> str:
        """Why this engine cannot generate now ("" when it can); see the module docstring."""
        if self.device_error:
            return self.device_error
        if self.batcher is not None:
            found = self.batcher.problem(self.stuck_after_s)
            if found:
                return found
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stuck_after_s:
            return (
                f"a model step has been running for {time.monotonic() - started:.1f}s "
                f"(--stuck-after {self.stuck_after_s:g})"
            )
        return ""

    def _start(
        self,
        job: GenerationJob,
        rows_factory=None,
        drafting: Callable[[], contextlib.AbstractContextManager] | None = None,
        model: Any = None,
        plan: GenerationPlan | None = None,
    ):
        """The request's step generator. `drafting()` wraps every wait for its drafter; `model` replaces
        the served model (the lane's, whose calls run on the scheduler thread); `plan` is the request's
        `GenerationPlan` when routing already made it (a request is planned once)."""
        model = model if model is not None else self.loaded.model
        generator = None
        if job.config.seed is not None:
            generator = torch.Generator(device=self.loaded.model.device).manual_seed(job.config.seed)
        common = dict(
            tokenizer=self.loaded.tokenizer,
            generator=generator,
            negative_prompt_ids=job.negative_prompt_ids,
            negative_prompt_attention_mask=job.negative_prompt_attention_mask,
            max_position_embeddings=self.loaded.max_position_embeddings,
            rows_factory=rows_factory,
        )
        if plan is None:  # (prepare_generation moves the prompts to the model's device)
            plan = prepare_generation(
                model,
                job.input_ids,
                job.attention_mask,
                config=job.config,
                max_position_embeddings=self.loaded.max_position_embeddings,
                structured_output=job.structured_output,
                tokenizer=self.loaded.tokenizer,
                allowed_token_sequences=job.allowed_token_sequences,
                logits_processor=job.logits_processor,
                stopping_criteria=job.stopping_criteria,
            )
        if job.generate_method is not None:
            return self._method_steps(job, plan, generator, lane=model is not self.loaded.model)
        proposer = self.drafting.proposer(job.proposer, job.config)
        job.speculation.proposer = proposer
        with self._lock:
            if id(job) in self._drafters:  # `run` has not ended: a cancelled request's thread may start late
                self._proposers[id(job)] = proposer
        if proposer != PROPOSER_NONE and plan.num_beams == 1 and uses_static_cache(job.config):
            # Rejected drafts are cropped from the cache, which a StaticCache cannot do.
            raise InvalidArgument.for_field(
                "config.cache_implementation",
                job.config.cache_implementation,
                f"speculative decoding ({proposer}) does not run with a static cache (transformers refuses "
                "assisted generation with one too): unset cache_implementation or use proposer='none'",
            )
        ensemble = self.drafting.ensemble_warning(proposer, job.config, plan.num_beams)
        if ensemble is not None:
            job.warnings.append(ensemble)
        compiling = compile_warning(model, job.config)
        if compiling is not None:
            job.warnings.append(FieldProblem("config.compile_config", job.config.compile_config, compiling, "warning"))
        if proposer == PROPOSER_NONE:
            if job.config.assistant_early_exit is not None:
                job.warnings.append(
                    FieldProblem(
                        "config.assistant_early_exit",
                        job.config.assistant_early_exit,
                        "not honoured: the request asks for proposer none (plain decoding, no early-exit draft)",
                        "warning",
                    )
                )
            if job.config.use_mtp:
                job.warnings.append(
                    FieldProblem(
                        "config.use_mtp",
                        True,
                        "not honoured: the request asks for proposer none (plain decoding, no MTP draft)",
                        "warning",
                    )
                )
            if job.config.speculation_type is not None:
                job.warnings.append(
                    FieldProblem(
                        "config.speculation_type",
                        job.config.speculation_type,
                        "not honoured: the request asks for proposer none (plain decoding, no DFlash draft)",
                        "warning",
                    )
                )
            return generate_from_plan(model, plan, **common)
        blocker = speculation_blocker(plan)
        if blocker and job.config.speculation_type is not None:  # transformers ignores it there (a log line)
            job.warnings.append(
                FieldProblem(
                    "config.speculation_type", job.config.speculation_type, f"not honoured: {blocker}", "warning"
                )
            )
        with self._lock:
            opened = self._drafters.get(id(job))
        opener = self.drafting.opener(
            proposer,
            self.loaded.vocab_size,
            target=self.loaded.model,
            early_exit=job.config.assistant_early_exit,
            stats=job.speculation,
            tokenizer=self.loaded.tokenizer,
            speculates=not blocker,
            # A drafter in this process runs its forwards where the target's run: the batched scheduler's thread
            # (batched and lane requests alike), else the model thread, which runs this request's steps.
            run_forward=self._serving.forward if self._serving is not None else None,
        )
        open_drafter = _opener(opener, drafting, opened)
        controller = self.drafting.controller(
            proposer,
            job.draft_fields,
            self._others_waiting,
            greedy=not job.config.do_sample,
            draft_load=lambda: self._others_drafting(proposer),
        )
        return speculate_from_plan(
            model,
            plan,
            open_drafter=open_drafter,
            stats=job.speculation,
            draft_length=None
            if controller is not None
            else self.drafting.draft_length(proposer, job.config, self.loaded.model),
            controller=controller,
            hidden_layers=self.drafting.hidden_layers(proposer),
            prefill_apart=self.drafting.prefills_apart(proposer),
            **common,
        )

    def _method_steps(
        self, job: GenerationJob, plan: GenerationPlan, generator: torch.Generator | None, lane: bool
    ) -> GenerateMethodSteps:
        """The steps of a request with a generate method plugin: one step that runs it whole on the model
        thread (the batched scheduler's for the lane, with the served model itself: the method may call
        `model.generate`, which a lane model's posted forwards would not cover)."""
        method = job.generate_method
        assert method is not None
        # A method replaces the loop that speculates (a proposer the request asked for was refused).
        job.speculation.proposer = PROPOSER_NONE
        batcher = self._serving if lane else None

        def heartbeat() -> None:  # the method's check(), on the model thread: progress for `problem`
            if batcher is not None:
                batcher.loop.progress_at = time.perf_counter()
            else:
                self._step_started = time.monotonic()

        def run(check: Callable[[], None]) -> Any:
            with torch.inference_mode():
                return run_generate_method(
                    method.plugin,
                    method.method,
                    method.args,
                    self.loaded.model,
                    plan,
                    check=check,
                    tokenizer=self.loaded.tokenizer,
                    generator=generator,
                    negative_prompt=(job.negative_prompt_ids, job.negative_prompt_attention_mask),
                    max_position_embeddings=self.loaded.max_position_embeddings,
                    warnings=job.warnings,
                )

        on_model_thread = batcher.forward if batcher is not None else None
        return GenerateMethodSteps(run, on_model_thread, caller_deadline(), heartbeat)

    def _others_waiting(self) -> float:
        """Other requests whose forwards a request's verify block delays (the controller's load term):
        those sharing the batched scheduler's packed forwards, or taking turns on the model thread."""
        return max(self.load().running - 1, 0)

    def _others_drafting(self, proposer: str) -> float:
        """Other running requests with `proposer`: for a remote draft, those its draft service serves in turn."""
        with self._lock:
            return max(sum(1 for name in self._proposers.values() if name == proposer) - 1, 0)

    def _step(self, steps, watched: bool):
        with self._lock:
            self._lane_steps += 1
        if watched:  # on the model thread: one step at a time, timed for `problem`
            self._step_started = time.monotonic()
        try:
            return next(steps)
        except StopIteration as stop:
            return _DONE, stop.value
        except Exception as exc:
            if watched and is_device_error(exc):
                log.critical("device error in a model step: the target service stops serving", exc_info=exc)
                self.device_error = f"the device failed in a forward ({type(exc).__name__}: {exc}); restart the service"
                raise Unavailable(f"the target service cannot generate: {self.device_error}") from exc
            raise
        finally:
            if watched:
                self._step_started = None

    async def run(self, job: GenerationJob) -> AsyncIterator[StepEvent | GenerationResult]:
        """Yield the job's step events, then its `GenerationResult`."""
        problem = self.problem()
        if problem:  # fail fast: nothing would run it
            raise Unavailable(f"the target service cannot generate: {problem}")
        opened: list[Drafter] = []
        with self._lock:
            self._drafters[id(job)] = opened
        try:
            async for item in self._route(job):
                yield item
        finally:
            with self._lock:
                self._drafters.pop(id(job), None)
                self._proposers.pop(id(job), None)
            for drafter in opened:  # the loop closes them too when it ends; closing twice is harmless
                try:
                    drafter.close()
                except Exception:  # noqa: BLE001 - cleanup must not hide the request's outcome
                    log.exception("closing a drafter of request %s failed", job.request_id or "-")

    async def _route(self, job: GenerationJob) -> AsyncIterator[StepEvent | GenerationResult]:
        """Run `job` in the batched scheduler, its sequential lane, or one request per step."""
        batcher = self._serving
        if batcher is not None:
            lane, plan = batcher.lane_reason(job)  # invalid requests raise here
            if not lane and job.generate_method is not None:
                lane = f"generate method {job.generate_method.plugin.name!r} (it runs whole on the model thread)"
            if not lane:
                with self._lock:
                    self.active += 1
                try:
                    async for item in batcher.run(job, plan):
                        yield item
                finally:
                    with self._lock:
                        self.active -= 1
                return
            log.debug("request %s runs in the sequential lane: %s", job.request_id or "-", lane)
            limit = batcher.options.max_lane_requests
            with self._lock:
                if self.lane_active >= limit:
                    raise ResourceExhausted(
                        f"the target service's sequential lane (requests the batched scheduler cannot "
                        f"serve; this one: {lane}) is full: {self.lane_active} running "
                        f"(--max-lane-requests {limit}); retry later",
                        retry_after_s=1.0,
                    )
                self.lane_active += 1
            # The lane request's own thread, single-threaded for torch (its forwards run on the
            # scheduler thread with the process's thread count; see `specwire.model_thread`).
            own = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="specwire-lane", initializer=torch.set_num_threads, initargs=(1,)
            )
            try:
                async for item in self._run_one_per_step(job, own, model=self._lane_model, watched=False, plan=plan):
                    yield item
            finally:
                own.shutdown(wait=False)  # the thread ends once the generator's close (queued) ran
                with self._lock:
                    self.lane_active -= 1
            return
        async for item in self._run_one_per_step(job, self.executor):
            yield item

    async def _run_one_per_step(
        self,
        job: GenerationJob,
        executor: Executor,
        model: Any = None,
        watched: bool = True,
        plan: GenerationPlan | None = None,
    ) -> AsyncIterator[StepEvent | GenerationResult]:
        """The one-request-per-step path: every step of `job` a call on `executor`.

        `watched` steps run on the model thread and count for `problem` (stuck, device error).
        """
        loop = asyncio.get_running_loop()
        # run_in_executor does not carry contextvars: the worker runs each call inside the request's
        # context, so the draft stream's client span is a child of the request's span (tracing).
        context = contextvars.copy_context()
        # Validation, length resolution and processor construction run here (errors raise here),
        # off the event loop: building stop-string tables for a large vocabulary takes a moment.
        steps = await loop.run_in_executor(
            executor, context.run, _in_inference_mode, lambda: self._start(job, model=model, plan=plan)
        )
        with self._lock:
            self.active += 1
        try:
            while True:
                item = await loop.run_in_executor(executor, context.run, _in_inference_mode, self._step, steps, watched)
                if isinstance(item, tuple) and item and item[0] is _DONE:
                    yield item[1]
                    return
                yield item
        finally:
            with self._lock:
                self.active -= 1
            # A generate method's one step runs it whole: it stops at its next check(), not at a step's end.
            if isinstance(steps, GenerateMethodSteps):
                steps.cancel()
            # Closing runs the generator's cleanup on its thread, after any step in flight. A request
            # abandoned while the server shuts down is finalised after its executor stopped: nothing
            # runs there any more, so it is closed here.
            try:
                executor.submit(_close_quietly, steps, job.request_id)
            except RuntimeError:  # "cannot schedule new futures after shutdown"
                _close_quietly(steps, job.request_id)

    def queue_full(self) -> float | None:
        """A retry hint in seconds when the batched scheduler's queue is full, else None (a cheap probe:
        the service refuses a request with it before preparing the request)."""
        batcher = self._serving
        return batcher.queue_full() if batcher is not None else None


def _in_inference_mode(fn, *args):
    with torch.inference_mode():
        return fn(*args)


def _close_quietly(steps, request_id: str) -> None:
    try:
        steps.close()
    except Exception:  # noqa: BLE001 - cleanup of an abandoned request must not kill the worker
        log.exception("closing request %s failed", request_id)


class _ForwardsOn:
    """A model whose calls run on the batched scheduler's thread (`BatchScheduler.forward`).

    The sequential lane's loops (and the guidance processor's own forward) call it like the model;
    every other attribute (config, device, parameters, `forward` for signature checks) is the model's.
    """

    def __init__(self, model: Any, scheduler: BatchScheduler):
        self._model = model
        self._scheduler = scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._scheduler.forward(self._model, *args, **kwargs)

    def compiled_forward(self, options: dict[str, Any]) -> Callable[..., Any]:
        """The model's compiled call (`specwire.generation.compilation`), also run on the scheduler thread."""
        compiled = compiled_call(self._model, options)
        return functools.partial(self._scheduler.forward, compiled)


class _CallsOn:
    """A model whose calls run on `executor` (the engine's model thread), in inference mode; every other
    attribute is the model's."""

    def __init__(self, model: Any, executor: Executor):
        self._model = model
        self._executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._executor.submit(_in_inference_mode, functools.partial(self._model, *args, **kwargs)).result()


class _AnnouncedDrafter:
    """A drafter whose waits (`propose`) run inside `drafting()`: the scheduler does not wait for them."""

    def __init__(self, drafter: Drafter, drafting: Callable[[], contextlib.AbstractContextManager]):
        self.drafter = drafter
        self.drafting = drafting

    def __getattr__(self, name: str) -> Any:  # a drafter's optional parts (`RemoteDrafter.prefill`, `prefilled`)
        return getattr(self.drafter, name)

    def propose(self, num_tokens: int) -> Proposal:
        with self.drafting():
            return self.drafter.propose(num_tokens)

    def feedback(self, *args: Any) -> None:
        self.drafter.feedback(*args)

    def close(self) -> None:
        self.drafter.close()


def _opener(
    open_drafter: Callable[..., Drafter],
    drafting: Callable[[], contextlib.AbstractContextManager] | None,
    opened: list[Drafter] | None,
) -> Callable[..., Drafter]:
    """`open_drafter` whose drafters are recorded in `opened`, and whose opening and `propose` calls
    announce themselves as draft waits (`drafting()`) when given."""

    def open_recorded(*args: Any) -> Drafter:
        with drafting() if drafting is not None else contextlib.nullcontext():
            drafter = open_drafter(*args)
        if opened is not None:
            opened.append(drafter)
        return _AnnouncedDrafter(drafter, drafting) if drafting is not None else drafter

    return open_recorded
