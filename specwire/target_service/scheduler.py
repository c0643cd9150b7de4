"""Batched scheduling: one model forward per step for every running request.

Design. Each request keeps its own decoding loop, unchanged (`iter_generate` / `iter_speculative`:
processors resolved once, its own `torch.Generator`, beam search, speculative acceptance), running
in its own thread. Only the model forward is shared: the loop's model-side state is a
`SlotRows` (`specwire.generation.slot_cache`) whose `prefill`/`decode`/`verify` post a `SlotWork`
to this scheduler and block until its logits are back. The scheduler thread gathers the pending
work of every running request, runs ONE packed forward over all of it (decode rows give 1 token,
verify rows their own block length, rows with no draft just 1, new requests' prefills share the same
forward up to the token budget, chunked when longer) and hands each request its logits.

Logits processing is shared the same way. After a forward, each request hands its logits to its
processors through its rows (`SlotRows.process`); when its processor list is batchable (repetition
penalty, temperature, top-k, top-p, min-p: `specwire.generation.processors.batched`) it posts a
`_ProcessWork` instead, and the scheduler runs every posted one as one `BatchedChains.apply`, with
each row's parameters as `[rows]` tensors (rebuilt only when the batch's requests change). It runs
as soon as every request of the last forward that shares processing has posted, or after the gather
window. Other processor lists run in the request's own thread. Sampling stays in the request's
thread, with its own `torch.Generator`: the batched processing gives every row bitwise its own
list's scores, so a seeded request gives the same tokens whatever its neighbours; only float noise
of a wider matrix product differs from running alone (see the slot cache's docstring).

KV cache. A `SlotKVCache` with `max_batch_rows` slots of `slot_tokens` positions each, allocated at
start-up (the memory budget, `kv_cache_mb`, caps the slot count). A request takes one slot per row
when admitted and gives them back when it ends; nobody else's cache moves.

Admission and fairness.
- A request is admitted when its rows fit in the free slots, in arrival order (strict FIFO: a large
  request at the head of the queue is not overtaken by small ones, so it cannot starve). Up to
  `max_queued` requests wait; beyond that the request fails with RESOURCE_EXHAUSTED and a
  `retry-after-s` hint (an estimate of when the first running request ends).
- Every running request with pending work is in every forward, so a long request advances one step
  per forward however many short ones come and go. Prefills get the rest of `max_tokens_per_step`
  (at least `min_prefill_tokens`) and are chunked, in admission order, so a long prompt does not stall
  the running requests.
- Stragglers: the forward starts when every running request has posted its work, or after a
  gather window (a fraction of the last forward's time), so a request still preparing its next step
  joins the next forward instead of holding up the others. A request waiting on its draft service
  says so (`drafting`, around `Drafter.propose`): the forwards do not wait for it at all, so a slow or
  hung draft service slows only its own requests.
- Cancellation and deadlines: the RPC's coroutine ending marks its request cancelled; before the
  next forward the scheduler frees its slots and wakes its thread, which stops (within one step).

The forward. Through `LeanDecoder` (`specwire.generation.lean_decoder`: the model's own ops without
transformers' module machinery, ~13% less time per SmolLM2 decode step on 2 CPU cores) when the model
has the Llama layout and a start-up probe finds its logits bitwise equal to `model(...)`'s; else
through `model(...)` (`SchedulerOptions.lean_forward=False`, `--packed-forward transformers`).

Threads. Every forward runs on the scheduler thread (see `specwire.model_thread` for why): the packed
forwards, and the forwards of the sequential lane (`forward`), which run between two packed forwards.
Nothing else runs there: no request's loop, no draft wait.

The sequential lane. Requests the slot cache cannot serve run the per-request path of `Engine`
(one request per forward, with a `DynamicCache`): `use_cache=False`, classifier-free guidance (its
processor runs its own forward), prompts with padding that is not left padding, more rows than
slots, longer than a slot, or a model `slot_support` refuses (checked once at start-up with a probe
against `RowBatch`). Each lane request's loop runs in a thread of its own (its processors, its
draft waits, its stopping checks); only its model calls are posted here, as `forward`s. Why not
a forward thread per lane request: a second thread running forwards with the process's torch thread
count makes every forward slower (two OpenMP pools, `specwire.model_thread`), and one with a single
thread would compete for the same cores anyway; posting keeps one forward at a time, and a lane
forward is work the device has to do either way.

Liveness (`problem`). The scheduler reports a dead thread, a device error (sticky: after a CUDA
error the device context is unusable, every request then fails UNAVAILABLE) and a stuck forward loop
(work posted and no forward, processing or lane call done for `stuck_after` seconds); the target's
watchdog turns it into NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from specwire.errors import ResourceExhausted, Unavailable
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.planning import prepare_generation
from specwire.generation.processors.batched import BatchedChains, RowChain
from specwire.generation.rows import RowBatch
from specwire.model_thread import claim_torch_threads, is_device_error
from specwire.runtime.lean_decoder import LeanDecoder
from specwire.runtime.slot_cache import (
    SlotKVCache,
    SlotRows,
    SlotWork,
    execute,
    install_slot_attention,
    slot_support,
)

log = logging.getLogger("specwire.target_service.scheduler")

SCHEDULERS = ("sequential", "batched")


@dataclasses.dataclass
class SchedulerOptions:
    """
    Limits of the batched scheduler.

    Args:
        max_batch_rows (`int`, defaults to 16):
            Rows (KV slots) running at once; a request takes `batch * max(num_beams, num_return_sequences)`.
        max_tokens_per_step (`int`, defaults to 256):
            Tokens per forward; prefills are chunked to fit (decode and verify rows are never cut).
        max_queued (`int`, defaults to 64):
            Requests waiting for slots before RESOURCE_EXHAUSTED.
        slot_tokens (`int`, *optional*):
            Positions per slot (prompt + new tokens); defaults to `min(max_position_embeddings, 2048)`.
            Longer requests run in the sequential lane.
        kv_cache_mb (`float`, defaults to 2048):
            Memory budget of the slot cache; the slot count is reduced to fit.
        gather_fraction (`float`, defaults to 0.5):
            How long (as a fraction of the last forward's time) a forward waits for running requests
            still preparing their next step.
        min_prefill_tokens (`int`, defaults to 32):
            Prefill tokens every forward runs when some are waiting, even past the token budget.
        max_lane_requests (`int`, defaults to 4):
            Requests running in the sequential lane at once (their `DynamicCache`s live outside
            `kv_cache_mb`); beyond that a lane request fails with RESOURCE_EXHAUSTED and a retry hint.
        lean_forward (`bool`, defaults to `True`):
            Run packed forwards through `LeanDecoder` (same ops and logits as the model's own forward,
            without its module machinery) when the model has the Llama layout and the start-up probe
            finds its logits bitwise equal to the model's; else through `model(...)`.
    """

    max_batch_rows: int = 16
    max_tokens_per_step: int = 256
    max_queued: int = 64
    slot_tokens: int | None = None
    kv_cache_mb: float = 2048.0
    gather_fraction: float = 0.5
    min_prefill_tokens: int = 32
    max_lane_requests: int = 4
    lean_forward: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch_rows", "max_tokens_per_step", "min_prefill_tokens", "max_lane_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.slot_tokens is not None and self.slot_tokens < 2:
            raise ValueError(f"slot_tokens must be >= 2, got {self.slot_tokens}")


class RequestCancelled(Exception):
    """Raised inside a request's thread when its RPC went away (cancelled, deadline exceeded)."""


class _ProcessWork:
    """A request's batchable logits processing, `(RowChain, input_ids, scores)` items, run with others'."""

    def __init__(self, items: list[tuple[RowChain, torch.Tensor, torch.Tensor]]):
        self.items = items
        self.outputs: list[torch.Tensor] | None = None


class _Request:
    """One request in the batched path."""

    def __init__(self, job: Any, rows: int, max_new_tokens: int, loop: asyncio.AbstractEventLoop, seq: int):
        self.job = job
        self.rows = rows
        self.max_new_tokens = max_new_tokens
        self.loop = loop
        self.seq = seq
        self.events: asyncio.Queue = asyncio.Queue()
        self.slots: list[int] = []
        self.work: SlotWork | _ProcessWork | None = None
        self.chains: dict[int, tuple[Any, RowChain | None]] = {}  # id(processors) -> (processors, chain)
        self.shares_processing = False  # has posted a `_ProcessWork`
        self.failure: BaseException | None = None
        self.in_cycle = False  # has posted work before: the gather window waits for it
        self.drafting = False  # waiting on its drafter: the gather window does not wait for it
        self.ready_since = 0.0
        self.steps = 0
        self.cancelled = False
        self.cancelled_at_forward: int | None = None
        self.freed_at_forward: int | None = None
        self.finished = False
        self.context: contextvars.Context | None = None

    def post(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the server's loop is gone (shutdown): nobody is listening
            pass


def close_logits(want: torch.Tensor, have: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether two forwards' logits agree up to the rounding of the model's dtype.

    The packed and the `RowBatch` forward multiply in different shapes, so the sums are rounded in a
    different order: a float32 (or float64) model agrees to 1e-3, a bfloat16 or float16 one to a
    couple of units in the last place of its largest logit (SmolLM2 in bfloat16: 0.125 on logits up
    to 28, one ulp).
    """
    if torch.finfo(dtype).bits >= 32:
        return torch.allclose(want, have, rtol=1e-3, atol=1e-3)
    ulps = 2 * torch.finfo(dtype).eps
    return torch.allclose(want, have, rtol=ulps, atol=ulps * float(want.abs().max()))


class BatchScheduler:
    """
    Runs the model steps of many requests as shared packed forwards (see the module docstring).

    Args:
        model (`PreTrainedModel`): the served model.
        start (`Callable`): `start(job, rows_factory) -> step generator` (the engine's loop factory).
        options (`SchedulerOptions`, *optional*): limits.
        max_position_embeddings (`int`, *optional*): the model's context length.
    """

    def __init__(
        self,
        model: Any,
        start: Callable[..., Any],
        options: SchedulerOptions | None = None,
        max_position_embeddings: int | None = None,
    ):
        self.model = model
        self.start = start
        self.options = options or SchedulerOptions()
        self.max_position_embeddings = max_position_embeddings
        self.cond = threading.Condition()
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.forwards = 0  # packed forwards run (observability and tests)
        self.tokens_run = 0
        self.rows_peak = 0
        self.shared_forwards = 0  # forwards that ran the work of two requests or more
        self.forward_seconds = 0.0  # time in forwards, and between them (requests' own work, gathering)
        self.gather_seconds = 0.0
        self.requests_peak = 0  # most requests in one forward
        self.process_batches = 0  # batched logits-processing runs, and those with two requests or more
        self.shared_process_batches = 0
        self.chains = BatchedChains()
        self._last_batch: set[int] = set()  # `seq` of the requests in the last forward
        # (forward count when cancelled, when its slots were freed) of the last cancelled requests.
        self.cancellations: deque[tuple[int, int]] = deque(maxlen=64)
        self._seq = 0
        self._forward_ema = 0.0
        self._last_forward_end = time.perf_counter()
        self._closed = False
        # Sequential-lane forwards: (future, fn, args, posted at).
        self._calls: deque[tuple[Future, Callable[..., Any], tuple, float]] = deque()
        self.lane_forwards = 0
        # Liveness: why the scheduler can no longer serve (sticky), and when it last made progress.
        self.failure_reason = ""
        self._progress_at = time.perf_counter()
        self.cache: SlotKVCache | None = None
        self.decoder: LeanDecoder | None = None  # see `SchedulerOptions.lean_forward`
        self.unsupported = slot_support(model)
        self.threads = torch.get_num_threads()
        if not self.unsupported:
            # The cache probe runs forwards, so it runs on the scheduler thread too (see `_loop`).
            built = threading.Event()
            self.thread = threading.Thread(target=self._loop, args=(built,), name="specwire-scheduler", daemon=True)
            self.thread.start()
            built.wait()
        if self.cache is None:
            log.warning("batched scheduler disabled, serving every request sequentially: %s", self.unsupported)

    # -- set-up -------------------------------------------------------------------------------------

    def _build_cache(self) -> None:
        options = self.options
        context = self.max_position_embeddings or 2048
        slot_tokens = options.slot_tokens or min(context, 2048)
        per_slot = SlotKVCache.bytes_per_slot(self.model, slot_tokens)
        slots = min(options.max_batch_rows, int(options.kv_cache_mb * 2**20 // per_slot))
        if slots < 1:
            self.unsupported = f"kv_cache_mb={options.kv_cache_mb} holds no slot of {slot_tokens} tokens"
            return
        with torch.inference_mode():
            install_slot_attention(self.model)
            problem = self._probe()
            if problem:
                self.unsupported = problem
                return
            if options.lean_forward:
                self.decoder = self._lean_decoder()
            self.cache = SlotKVCache(self.model, slots, slot_tokens)
        log.info(
            "batched scheduler: %d slots x %d tokens (%.0f MiB), %s forward",
            slots,
            slot_tokens,
            slots * per_slot / 2**20,
            "lean" if self.decoder is not None else "transformers",
        )

    def _lean_decoder(self) -> LeanDecoder | None:
        """A `LeanDecoder` when this model supports one and it reproduces the model's logits bitwise."""
        problem = LeanDecoder.unsupported(self.model)
        if not problem:
            decoder = LeanDecoder(self.model)
            try:
                same = all(
                    torch.equal(want, got)
                    for want, got in zip(self._packed_outputs(None), self._packed_outputs(decoder), strict=True)
                )
                problem = "" if same else "its logits differ from the model's own forward"
            except Exception as exc:  # noqa: BLE001 - any failure means: use the model's forward
                problem = f"it failed: {type(exc).__name__}: {exc}"
        if problem:
            log.info("lean forward not used: %s", problem)
            return None
        return decoder

    def _probe(self) -> str:
        """Packed forwards must give what `RowBatch` gives on this model (else: serve sequentially)."""
        reference = RowBatch(self.model, attention_mask=None, prompt_length=4, rows=2)
        ids = self._probe_ids()
        try:
            wanted = [reference.prefill(ids), reference.verify(ids[:, :2])]
            got = self._packed_outputs(None)
        except Exception as exc:  # noqa: BLE001 - any failure means: not supported
            return f"packed forward failed: {type(exc).__name__}: {exc}"
        for want, have in zip(wanted, got, strict=True):
            if want.shape != have.shape or not close_logits(want, have, self.model.dtype):
                return "packed forwards do not reproduce this model's logits"
        return ""

    def _probe_ids(self) -> torch.Tensor:
        vocab = int(self.model.config.get_text_config().vocab_size)
        return ((torch.arange(8).view(2, 4) * 7 + 3) % vocab).to(self.model.device)

    def _packed_outputs(self, decoder: LeanDecoder | None) -> list[torch.Tensor]:
        """The probe's logits through packed forwards: a 2-row prefill, then a 2-token verify."""
        cache = SlotKVCache(self.model, 3, 16)
        rows = SlotRows(
            lambda work: execute(self.model, cache, [work], decoder=decoder),
            cache.release,
            [1, 2],
            attention_mask=None,
            prompt_length=4,
            rows=2,
            device=cache.device,
        )
        ids = self._probe_ids()
        return [rows.prefill(ids), rows.verify(ids[:, :2])]

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
        )
        config = plan.config
        rows = plan.input_ids.shape[0] * plan.expand
        if not config.use_cache:
            return "use_cache=False", plan
        if config.guidance_scale is not None and config.guidance_scale != 1:
            return "classifier-free guidance", plan
        if rows > self.cache.num_slots:
            return f"{rows} rows > {self.cache.num_slots} slots", plan
        if plan.max_length > self.cache.slot_tokens:
            return f"max_length {plan.max_length} > {self.cache.slot_tokens} slot tokens", plan
        mask = plan.attention_mask
        # Only left padding can be skipped: a 0 after a 1 changes what the reference computes.
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            return "padding that is not left padding", plan
        # A row that is all padding (pad ids with no mask sent) has no token for a slot to start from;
        # transformers still generates from it, and so does the lane.
        if not bool(mask.any(dim=1).all()):
            return "a prompt row with no unmasked token", plan
        return "", plan

    async def run(self, job: Any, plan: Any) -> AsyncIterator[StepEvent | GenerationResult]:
        """Admit `job`, yield its step events, then its `GenerationResult`."""
        loop = asyncio.get_running_loop()
        rows = plan.input_ids.shape[0] * plan.expand
        with self.cond:
            if self.failure_reason:
                raise Unavailable(f"the target service cannot generate: {self.failure_reason}")
            self._seq += 1
            request = _Request(job, rows, plan.max_length - plan.input_len, loop, self._seq)
            # The request's thread runs in the RPC's context (tracing spans, telemetry).
            request.context = contextvars.copy_context()
            if self.waiting or not self._try_start(request):
                if len(self.waiting) >= self.options.max_queued:
                    raise ResourceExhausted(
                        f"the target service is at capacity: {len(self.running)} requests running, "
                        f"{len(self.waiting)} queued (--max-queued {self.options.max_queued}); retry later",
                        retry_after_s=self._retry_hint(),
                    )
                self.waiting.append(request)
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

    def _retry_hint(self) -> float:
        """Seconds until the first running request should end (a hint, not a promise)."""
        step = self._forward_ema or 0.05
        remaining = min((r.max_new_tokens - r.steps for r in self.running), default=1)
        return float(min(max(step * max(remaining, 1), 0.05), 60.0))

    def cancel(self, request: _Request) -> None:
        """The request's RPC ended: drop it from the queue or free its slots before the next forward."""
        with self.cond:
            if request.finished:
                return
            if request in self.waiting:
                self.waiting.remove(request)
                request.finished = True
                return
            request.cancelled = True
            request.cancelled_at_forward = self.forwards
            self.cond.notify_all()

    # -- admission (under self.cond) ----------------------------------------------------------------

    def _try_start(self, request: _Request) -> bool:
        slots = self.cache.allocate(request.rows)
        if slots is None:
            return False
        request.slots = slots
        self.running.append(request)
        self.rows_peak = max(self.rows_peak, sum(len(r.slots) for r in self.running))
        thread = threading.Thread(
            target=self._drive, args=(request,), daemon=True, name=f"specwire-request-{request.seq}"
        )
        thread.start()
        return True

    def _admit_waiting(self) -> None:
        while self.waiting and self._try_start(self.waiting[0]):
            self.waiting.popleft()

    def _free(self, request: _Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.cache.release(request.slots)
        request.slots = []
        request.finished = True
        request.freed_at_forward = self.forwards
        if request.cancelled_at_forward is not None:
            self.cancellations.append((request.cancelled_at_forward, request.freed_at_forward))
        self.cond.notify_all()

    # -- a request's thread ---------------------------------------------------------------------------

    def _drive(self, request: _Request) -> None:
        request.context.run(self._drive_in_context, request)

    def _drive_in_context(self, request: _Request) -> None:
        # The loop's own work is small per-row tensor ops: one thread, no OpenMP pool of its own
        # (see `specwire.model_thread`).
        torch.set_num_threads(1)
        steps = None
        try:
            with torch.inference_mode():
                steps = self.start(
                    request.job,
                    lambda *args, **kwargs: self._rows(request, *args, **kwargs),
                    drafting=lambda: self._drafting(request),
                )
                while True:
                    try:
                        item = next(steps)
                    except StopIteration as stop:
                        request.post("result", stop.value)
                        return
                    request.post("event", item)
        except RequestCancelled:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported to the caller's coroutine
            request.post("error", exc)
        finally:
            if steps is not None:
                try:
                    steps.close()
                except Exception:  # noqa: BLE001 - cleanup must not kill the thread
                    log.exception("closing request %s failed", request.job.request_id)
            with self.cond:
                if not request.finished:
                    self._free(request)

    def _rows(
        self, request: _Request, model: Any, *, attention_mask: Any, prompt_length: int, rows: int, **_: Any
    ) -> SlotRows:
        if rows != len(request.slots):
            raise RuntimeError(f"request planned for {len(request.slots)} rows asked for {rows}")
        return SlotRows(
            lambda work: self._submit(request, work),
            lambda slots: self._release(request, slots),
            request.slots,
            attention_mask=attention_mask,
            prompt_length=prompt_length,
            rows=rows,
            device=self.cache.device,
            process=lambda items: self._process(request, items),
        )

    def _process(self, request: _Request, items: list[tuple[Any, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Logits processing of `request`: batchable chains with other requests' (one `_ProcessWork`), the rest here."""
        chains = []
        for processors, _, _ in items:
            known = request.chains.get(id(processors))
            if known is None:
                known = request.chains[id(processors)] = (processors, RowChain.of(processors))
            chains.append(known[1])
        outputs: list[torch.Tensor | None] = [
            None if chain is not None else processors(input_ids, scores)
            for chain, (processors, input_ids, scores) in zip(chains, items, strict=True)
        ]
        shared = [i for i, chain in enumerate(chains) if chain is not None]
        if shared:
            work = _ProcessWork([(chains[i], items[i][1], items[i][2]) for i in shared])
            request.shares_processing = True
            self._submit(request, work)
            for i, output in zip(shared, work.outputs, strict=True):
                outputs[i] = output
        return outputs

    @contextlib.contextmanager
    def _drafting(self, request: _Request) -> Iterator[None]:
        """Around a draft wait of `request`: forwards run without waiting for it (no head-of-line blocking)."""
        with self.cond:
            request.drafting = True
            self.cond.notify_all()  # a forward waiting for this request's work can start now
        try:
            yield
        finally:
            with self.cond:
                request.drafting = False

    def _release(self, request: _Request, slots: list[int]) -> None:
        with self.cond:
            if request.finished:
                return
            for slot in slots:
                request.slots.remove(slot)
            self.cache.release(slots)
            self.cond.notify_all()

    def _submit(self, request: _Request, work: SlotWork | _ProcessWork) -> None:
        """Post `work` and block until the scheduler ran it (or the request is cancelled)."""
        with self.cond:
            if request.cancelled:
                raise RequestCancelled()
            if self.failure_reason:
                raise Unavailable(f"the target service cannot generate: {self.failure_reason}")
            request.work = work
            request.in_cycle = True
            request.ready_since = time.perf_counter()
            self.cond.notify_all()
            while request.work is work and not request.cancelled and request.failure is None:
                self.cond.wait()
            if request.failure is not None:
                raise request.failure
            if request.work is work:  # cancelled before it ran
                raise RequestCancelled()

    # -- the scheduler thread ------------------------------------------------------------------------------

    def _reap(self) -> None:
        for request in [r for r in self.running if r.cancelled]:
            request.work = None
            self._free(request)

    def _gather(self) -> list[_Request] | None:
        """Wait (holding self.cond) until a forward should run; its requests, or None when closed."""
        while True:
            if self._closed:
                return None
            self._reap()
            self._admit_waiting()
            if self._calls:  # sequential-lane forwards go first; the packed forward follows right after
                return []
            ready = [r for r in self.running if r.work is not None]
            if any(isinstance(r.work, _ProcessWork) for r in ready) and not any(
                r.work is None and not r.drafting and r.shares_processing and r.seq in self._last_batch
                for r in self.running
            ):
                # Every request of the last forward that shares processing has posted it: run it now.
                return ready
            if ready:
                # A request waiting on its drafter is not waited for: it joins a later forward.
                busy = any(r.work is None and r.in_cycle and not r.drafting for r in self.running)
                if not busy:
                    return ready
                window = max(0.002, self.options.gather_fraction * self._forward_ema)
                since = max(self._last_forward_end, min(r.ready_since for r in ready))
                left = since + window - time.perf_counter()
                if left <= 0:
                    return ready
                self.cond.wait(left)
            else:
                self.cond.wait()

    def _loop(self, built: threading.Event) -> None:
        # Every forward of the model runs on this thread: packed forwards, the probe and the
        # sequential lane's forwards (`forward`); see `specwire.model_thread`.
        claim_torch_threads(self.threads)
        try:
            self._build_cache()
        finally:
            built.set()
        if self.cache is None:
            return
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread dies: say so, fail everyone waiting on it
            log.critical("the batched scheduler's thread died", exc_info=exc)
            self._fail_all(f"the scheduler thread died: {type(exc).__name__}: {exc}")
            return
        with self.cond:
            calls = list(self._calls)
            self._calls.clear()
        for future, *_ in calls:
            future.cancel()

    def _serve(self) -> None:
        while True:
            with self.cond:
                ready = self._gather()
                if ready is None:
                    return
                calls = list(self._calls)
                self._calls.clear()
                processing = [r for r in ready if isinstance(r.work, _ProcessWork)]
                if not calls and not processing:
                    steps = [r for r in ready if r.work.keep_all]
                    prefills = sorted((r for r in ready if not r.work.keep_all), key=lambda r: r.seq)
                    step_tokens = sum(r.work.remaining for r in steps)
                    budget = step_tokens + max(
                        self.options.max_tokens_per_step - step_tokens, self.options.min_prefill_tokens
                    )
                    batch = steps + prefills
                    works = [r.work for r in batch]
            if calls:
                self._run_calls(calls)
                continue
            if processing:
                self._run_processing(processing)
                continue
            started = time.perf_counter()
            self.gather_seconds += started - self._last_forward_end
            failure = None
            try:
                with torch.inference_mode():
                    ran = execute(self.model, self.cache, works, budget, self.decoder)
            except Exception as exc:  # noqa: BLE001 - fails the requests in this forward, not the server
                log.exception("batched forward failed")
                failure, ran = exc, 0
                if is_device_error(exc):
                    failure = self._device_failed(exc)
            ended = time.perf_counter()
            with self.cond:
                elapsed = ended - started
                self.forward_seconds += elapsed
                self._forward_ema = elapsed if not self._forward_ema else 0.8 * self._forward_ema + 0.2 * elapsed
                self._last_forward_end = self._progress_at = ended
                self.forwards += 1
                self.tokens_run += ran
                self.requests_peak = max(self.requests_peak, len(batch))
                self._last_batch = {r.seq for r in batch}
                if len(batch) > 1:
                    self.shared_forwards += 1
                for request, work in zip(batch, works, strict=True):
                    if failure is not None:
                        request.failure = failure
                        request.work = None
                    elif work.finished and request.work is work:
                        request.work = None
                        request.steps += 1
                self.cond.notify_all()

    def _run_calls(self, calls: list[tuple[Future, Callable[..., Any], tuple, float]]) -> None:
        """Run the posted sequential-lane forwards (on the scheduler thread, between packed forwards)."""
        for future, fn, args, _ in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - delivered to the lane request
                if is_device_error(exc):
                    exc = self._device_failed(exc)
                future.set_exception(exc)
            except BaseException as exc:  # the thread dies (see `_loop`): its caller must not wait forever
                future.set_exception(Unavailable(f"the target service cannot generate: {type(exc).__name__}"))
                raise
        with self.cond:
            self.lane_forwards += len(calls)
            self._progress_at = time.perf_counter()

    def _device_failed(self, exc: BaseException) -> Unavailable:
        """A forward raised a device error: the scheduler stops serving (sticky), every request fails."""
        log.critical("device error in a forward: the target service stops serving", exc_info=exc)
        reason = f"the device failed in a forward ({type(exc).__name__}: {exc}); restart the service"
        self._fail_all(reason)
        return Unavailable(f"the target service cannot generate: {reason}")

    def _fail_all(self, reason: str) -> None:
        """Stop serving for `reason`: running and queued requests fail UNAVAILABLE, new ones are refused."""
        error = Unavailable(f"the target service cannot generate: {reason}")
        with self.cond:
            self.failure_reason = self.failure_reason or reason
            for request in self.running:
                request.failure = error
                request.work = None  # not run again: its thread raises `error`
            while self.waiting:
                request = self.waiting.popleft()
                request.finished = True
                request.post("error", error)
            calls = list(self._calls)
            self._calls.clear()
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
            if not self.thread.is_alive() and not self._closed:
                return "the scheduler thread is dead"
            pending = [r.ready_since for r in self.running if r.work is not None]
            pending += [posted for *_, posted in self._calls]
            if not pending:
                return ""
            stalled = time.perf_counter() - max(self._progress_at, min(pending))
        finally:
            self.cond.release()
        if stalled > stuck_after:
            return (
                f"the forward loop is stuck: work has waited {stalled:.1f}s with no forward done "
                f"(--stuck-after {stuck_after:g})"
            )
        return ""

    def _run_processing(self, requests: list[_Request]) -> None:
        """One `BatchedChains.apply` over the posted processing of `requests` (on the scheduler thread)."""
        works = [r.work for r in requests]
        items = [item for work in works for item in work.items]
        failure = None
        try:
            with torch.inference_mode():
                outputs = self.chains.apply(items)
        except Exception as exc:  # noqa: BLE001 - fails these requests, not the server
            log.exception("batched logits processing failed")
            failure = exc
        with self.cond:
            self._progress_at = time.perf_counter()
            self.process_batches += 1
            if len(requests) > 1:
                self.shared_process_batches += 1
            for request, work in zip(requests, works, strict=True):
                if failure is not None:
                    request.failure = failure
                else:
                    work.outputs, outputs = outputs[: len(work.items)], outputs[len(work.items) :]
                if request.work is work:
                    request.work = None
            self.cond.notify_all()

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` (a sequential-lane request's model call) on the scheduler thread,
        between packed forwards, and return its result; the caller's thread waits for it."""
        future: Future = Future()
        with self.cond:
            if self.failure_reason:
                raise Unavailable(f"the target service cannot generate: {self.failure_reason}")
            if self._closed or self.cache is None:
                raise Unavailable("the batched scheduler is not running")
            self._calls.append((future, _in_inference_mode, (fn, args, kwargs), time.perf_counter()))
            self.cond.notify_all()
        return future.result()

    def close(self) -> None:
        with self.cond:
            self._closed = True
            for request in self.running:
                request.cancelled = True
            self.cond.notify_all()
        thread = getattr(self, "thread", None)
        if thread is not None:
            thread.join(10)

    @property
    def free_slots(self) -> int:
        with self.cond:
            return len(self.cache.free) if self.cache is not None else 0

    def queue_full(self) -> float | None:
        """A retry hint in seconds when the wait queue is full (a new request would be refused), else None."""
        with self.cond:
            if self.cache is None or len(self.waiting) < self.options.max_queued:
                return None
            if not self.waiting and self.cache.free:
                return None  # a request that fits the free slots starts without queueing
            return self._retry_hint()


def _in_inference_mode(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    # Grad mode is per thread: the lane request's thread runs in inference mode, so its forwards do too.
    with torch.inference_mode():
        return fn(*args, **kwargs)
