"""A batched request's own thread: its decoding loop, unchanged, with its model work posted to the scheduler.

Each request keeps its own loop (`iter_generate` / `iter_speculative`: processors resolved once, its
own `torch.Generator`, beam search, speculative acceptance) in a thread of its own. Its model-side
state is a `SlotRows` whose `prefill`/`decode`/`verify` post a `SlotWork` and block until the
scheduler thread ran it in a packed forward. Batchable logits processing (repetition penalty,
temperature, top-k, top-p, min-p: `specwire.generation.processors.batched`) is posted the same way,
as a `ProcessWork`; other processor lists run here. Sampling stays here too, with the request's own
generator: the batched processing gives every row bitwise its own list's scores, so a seeded request
gives the same tokens whatever its neighbours.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from specwire.errors import Unavailable
from specwire.generation.processors.batched import RowChain
from specwire.runtime.slot_cache import SlotKVCache, SlotRows, SlotWork
from specwire.target_service.scheduler.request import ProcessWork, Request, RequestCancelled, RequestState
from specwire.target_service.scheduler.slot_admission import SlotAdmission

if TYPE_CHECKING:
    from specwire.target_service.scheduler.batch_scheduler import BatchScheduler

log = logging.getLogger("specwire.target_service.scheduler")


class RequestThread:
    """
    Runs one admitted request's loop (see the module docstring).

    Args:
        scheduler (`BatchScheduler`): the scheduler that admitted it (its lock, slots and loop factory).
        request (`Request`): the request.
    """

    def __init__(self, scheduler: BatchScheduler, request: Request):
        self.scheduler = scheduler
        self.request = request
        self.cond = scheduler.cond

    def start(self) -> None:
        thread = threading.Thread(target=self._run, daemon=True, name=f"specwire-request-{self.request.seq}")
        with self.cond:
            self.scheduler.request_threads.add(thread)
        thread.start()

    def _run(self) -> None:
        # The request's thread runs in the RPC's context (tracing spans, telemetry).
        cast(contextvars.Context, self.request.context).run(self._drive)  # set before the thread starts

    def _drive(self) -> None:
        request = self.request
        # The loop's own work is small per-row tensor ops: one thread, no OpenMP pool of its own
        # (see `specwire.model_thread`).
        torch.set_num_threads(1)
        steps = None
        try:
            with torch.inference_mode():
                steps = self.scheduler.start(request.job, self._rows, drafting=self._drafting, plan=request.plan)
                while True:
                    try:
                        item = next(steps)
                    except StopIteration as stop:
                        request.send("result", stop.value)
                        return
                    request.send("event", item)
        except RequestCancelled:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported to the caller's coroutine
            request.send("error", exc)
        finally:
            if steps is not None:
                try:
                    steps.close()
                except Exception:  # noqa: BLE001 - cleanup must not kill the thread
                    log.exception("closing request %s failed", request.job.request_id)
            with self.cond:
                if request.state is not RequestState.FINISHED:
                    # Requests exist only where the batched path serves: admission is set.
                    cast(SlotAdmission, self.scheduler.admission).free(request)
                self.scheduler.request_threads.discard(threading.current_thread())

    def _rows(self, model: Any, *, attention_mask: Any, prompt_length: int, rows: int, **_: Any) -> SlotRows:
        """The loop's `rows_factory`: rows over the request's slots, their work posted to the scheduler."""
        request = self.request
        if rows != len(request.slots):
            raise RuntimeError(f"request planned for {len(request.slots)} rows asked for {rows}")
        return SlotRows(
            self._submit,
            request.slots,
            attention_mask=attention_mask,
            prompt_length=prompt_length,
            rows=rows,
            device=cast(SlotKVCache, self.scheduler.cache).device,
            process=self._process,
        )

    def _process(self, items: list[tuple[Any, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Logits processing: batchable chains with other requests' (one `ProcessWork`), the rest here."""
        request = self.request
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
            work = ProcessWork([(cast(RowChain, chains[i]), items[i][1], items[i][2]) for i in shared])
            request.shares_processing = True
            self._submit(work)
            for i, output in zip(shared, cast(list[torch.Tensor], work.outputs), strict=True):  # filled when done
                outputs[i] = output
        return cast(list[torch.Tensor], outputs)  # every None was a shared row's, now filled

    @contextlib.contextmanager
    def _drafting(self) -> Iterator[None]:
        """Around a draft wait: forwards run without waiting for this request (no head-of-line blocking)."""
        with self.cond:
            before = self.request.start_drafting()
            self.cond.notify_all()  # a forward waiting for this request's work can start now
        try:
            yield
        finally:
            with self.cond:
                self.request.stop_drafting(before)

    def _submit(self, work: SlotWork | ProcessWork) -> None:
        """Post `work` and block until the scheduler thread ran it (or the request ended)."""
        request = self.request
        with self.cond:
            if request.ended:
                raise RequestCancelled()
            if self.scheduler.failure_reason:
                raise Unavailable(f"the target service cannot generate: {self.scheduler.failure_reason}")
            request.post_work(work)
            self.cond.notify_all()
            while request.state is RequestState.POSTED and request.failure is None:
                self.cond.wait()
            if request.failure is not None:
                raise request.failure
            if request.ended:  # cancelled before (or while) it ran
                raise RequestCancelled()
