"""A request of the batched path: its state, the work it posted, and its events for the RPC's coroutine.

Every state change happens under the scheduler's lock (`BatchScheduler.cond`):

    QUEUED --admitted--> STARTING --posts work--> POSTED --work ran--> PREPARING --posts work--> POSTED ...
                 STARTING or PREPARING --waits on its drafter--> DRAFTING --back--> STARTING or PREPARING
    any running state --RPC ended--> CANCELLED --slots freed--> FINISHED
    QUEUED --RPC ended, or the scheduler failed--> FINISHED;  a running state --thread ended--> FINISHED

The gather policy (`specwire.target_service.scheduler.gather_policy`) waits only for PREPARING
requests: a STARTING one has no step in the rhythm of the forwards yet, and a DRAFTING one may wait on
a slow or hung draft service, which must slow only its own request.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import time
from typing import Any

import torch

from specwire.generation.processors.batched import RowChain
from specwire.runtime.slot_cache import SlotWork


class RequestCancelled(Exception):
    """Raised inside a request's thread when its RPC went away (cancelled, deadline exceeded)."""


class RequestState(enum.Enum):
    """Where a request of the batched path is (see the module docstring)."""

    QUEUED = "queued"  # waiting for free slots, in arrival order
    STARTING = "starting"  # admitted (its slots taken, its thread started), no work posted yet
    POSTED = "posted"  # its work waits for the scheduler thread; its thread blocks until it ran
    PREPARING = "preparing"  # its thread prepares the next step (sampling, stopping checks, ...)
    DRAFTING = "drafting"  # its thread waits on its drafter
    CANCELLED = "cancelled"  # its RPC ended: the scheduler frees its slots before the next forward
    FINISHED = "finished"  # its slots are back (or it left the queue): nothing refers to it any more


# A request's thread may stop waiting for its drafter in one of these (and goes back to it).
_CAN_DRAFT = (RequestState.STARTING, RequestState.PREPARING)


class ProcessWork:
    """A request's batchable logits processing, `(RowChain, input_ids, scores)` items, run with others'."""

    def __init__(self, items: list[tuple[RowChain, torch.Tensor, torch.Tensor]]):
        self.items = items
        self.outputs: list[torch.Tensor] | None = None


class Request:
    """
    One request in the batched path.

    Args:
        job (`GenerationJob`): what to generate.
        plan (`GenerationPlan`): its plan, made once when it was routed; its loop runs from it. Its
            `rows` are the KV slots it takes, its `max_new_tokens` its step budget (retry hint).
        loop (`asyncio.AbstractEventLoop`): the RPC's event loop, where its events go.
        seq (`int`): arrival number (admission order, and which requests the last forward ran).
    """

    def __init__(self, job: Any, plan: Any, loop: asyncio.AbstractEventLoop, seq: int):
        self.job = job
        self.plan = plan
        self.loop = loop
        self.seq = seq
        self.state = RequestState.QUEUED
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()  # (kind, value), see `send`
        self.slots: list[int] = []
        # The posted work. It stays set on a cancelled request until the scheduler thread reaps it, so
        # the liveness check still counts it as waiting.
        self.work: SlotWork | ProcessWork | None = None
        self.ready_since = 0.0  # when `work` was posted
        self.failure: BaseException | None = None  # its forward or processing failed: its thread raises it
        self.chains: dict[int, tuple[Any, RowChain | None]] = {}  # id(processors) -> (processors, chain)
        # Its processors are batchable (it has posted a `ProcessWork`): a batched processing run waits
        # for it when it was in the last forward. A fact about the request, not a state.
        self.shares_processing = False
        self.steps = 0
        self.cancelled_at_forward: int | None = None
        self.freed_at_forward: int | None = None
        self.context: contextvars.Context | None = None

    @property
    def ended(self) -> bool:
        """Its RPC is gone (CANCELLED) or its slots are back (FINISHED): its thread must stop."""
        return self.state in (RequestState.CANCELLED, RequestState.FINISHED)

    def post_work(self, work: SlotWork | ProcessWork) -> None:
        """STARTING or PREPARING -> POSTED: `work` waits for the scheduler thread."""
        self.work = work
        self.state = RequestState.POSTED
        self.ready_since = time.perf_counter()

    def take_work(self) -> None:
        """The scheduler thread is done with the posted work (it ran, or failed): POSTED -> PREPARING."""
        self.work = None
        if self.state is RequestState.POSTED:
            self.state = RequestState.PREPARING

    def start_drafting(self) -> RequestState:
        """Enter DRAFTING (unless ended); the state to go back to after the wait."""
        before = self.state
        if before in _CAN_DRAFT:
            self.state = RequestState.DRAFTING
        return before

    def stop_drafting(self, before: RequestState) -> None:
        if self.state is RequestState.DRAFTING:
            self.state = before

    def send(self, kind: str, value: Any) -> None:
        """Hand `("event" | "result" | "error", value)` to the RPC's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the server's loop is gone (shutdown): nobody is listening
            pass
