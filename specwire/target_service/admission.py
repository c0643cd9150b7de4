"""Request preparation off the event loop, in a bounded pool, refused early when it is full.

Tokenization, prompt id checks and config validation cost CPU in proportion to what the caller
sent. On the event loop they would stall every other RPC of the server (health probes included);
unbounded, a burst of large requests would queue work the service can never finish in time. So they
run in a small thread pool with a cap on preparations in flight (running or waiting for a worker);
a request beyond the cap gets RESOURCE_EXHAUSTED with a retry hint at once, before any of its work.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from specwire.errors import ResourceExhausted
from specwire.pools import eager_thread_pool

T = TypeVar("T")

DEFAULT_PREPARE_WORKERS = 2
DEFAULT_MAX_PREPARING = 16


class PreparationPool:
    """A thread pool for request preparation with a bounded number of preparations in flight.

    Args:
        workers (`int`, defaults to 2): threads preparing requests (`--prepare-workers`).
        max_in_flight (`int`, defaults to 16): preparations running or waiting for a worker; beyond
            it, `run` raises RESOURCE_EXHAUSTED (`--max-preparing`).
        retry_after_s (`float`, defaults to 0.5): the retry hint sent with that refusal.
    """

    def __init__(
        self,
        workers: int = DEFAULT_PREPARE_WORKERS,
        max_in_flight: int = DEFAULT_MAX_PREPARING,
        retry_after_s: float = 0.5,
    ):
        if workers < 1 or max_in_flight < 1:
            raise ValueError(f"workers and max_in_flight must be >= 1, got {workers} and {max_in_flight}")
        self.workers = workers
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.executor = eager_thread_pool(workers, "specwire-prepare")
        # Counted down when the work ends on its thread, not when the caller stops waiting: a cancelled
        # RPC does not stop a tokenizer call, and its thread is busy until then.
        self._lock = threading.Lock()
        self.in_flight = 0

    def _done(self, _future: Any) -> None:
        with self._lock:
            self.in_flight -= 1

    def admit(self) -> None:
        """Raise RESOURCE_EXHAUSTED when no preparation can start now (the cheap early check)."""
        with self._lock:
            full = self.in_flight >= self.max_in_flight
        if full:
            raise self._refusal()

    def _refusal(self) -> ResourceExhausted:
        return ResourceExhausted(
            f"the target service is preparing {self.max_in_flight} requests already "
            f"(--max-preparing {self.max_in_flight}); retry later",
            retry_after_s=self.retry_after_s,
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker, in the caller's context (tracing); RESOURCE_EXHAUSTED when full."""
        with self._lock:
            if self.in_flight >= self.max_in_flight:
                raise self._refusal()
            self.in_flight += 1
        context = contextvars.copy_context()
        try:
            future = self.executor.submit(context.run, fn, *args)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Drop the preparations not started and wait for the running ones (after the server stopped)."""
        self.executor.shutdown(wait=True, cancel_futures=True)
