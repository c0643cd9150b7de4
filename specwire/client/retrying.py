"""Calls retried after the server's retry hint when it refused them for load (`retries=` of the clients).

A server at capacity (a full queue, a full preparation pool, `--max-concurrent-rpcs`) answers
RESOURCE_EXHAUSTED before doing any of the request's work and says when to come back (the
`retry-after-s` trailing metadata, see `specwire.serving.error_status`). Such a call is safe to send
again whatever it does, writes and generation included: it never started. Any other failure, and a
RESOURCE_EXHAUSTED without a hint (a message over the size limit: sending it again fails again), is
raised at once. Retries stay within the call's timeout: a wait that would end past it is not taken.

Transport failures (UNAVAILABLE) of reads are retried by the channel itself
(`specwire.security.channels.READ_RETRY_POLICY`), not here.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from specwire.client.errors import RETRY_AFTER_KEY

T = TypeVar("T")

# Clients refused together would come back together: each waits the hint plus up to 20% more.
JITTER = 0.2


def check_retries(retries: int) -> int:
    """`retries` when it is a count (>= 0), else ValueError with the fix."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0 (0: never retry), got {retries!r}")
    return retries


def retry_hint(error: grpc.RpcError) -> float | None:
    """Seconds the server asked the caller to wait before retrying; None when it asked for no retry."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(float(value), 0.0)
            except ValueError:
                return None
    return None


class RetrySchedule:
    """The waits of one call: at most `retries` of them, each the server's hint, all before `timeout` ends.

    Args:
        retries (`int`): how many times the call may be sent again.
        timeout (`float`, *optional*): the call's deadline in seconds from now, across every attempt;
            None: no deadline.
    """

    def __init__(self, retries: int, timeout: float | None):
        self.retries_left = retries
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def timeout(self) -> float | None:
        """What is left of the call's deadline, for the next attempt."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def wait_after(self, error: grpc.RpcError) -> float | None:
        """Seconds to wait before sending the call again after `error`; None: raise it."""
        hint = retry_hint(error)
        if hint is None or self.retries_left <= 0:
            return None
        wait = hint * (1 + JITTER * random.random())
        if self.deadline is not None and time.monotonic() + wait >= self.deadline:
            return None  # the retry could not finish in time: the caller hears the refusal now
        self.retries_left -= 1
        return wait


def call_with_retries(call: Callable[[float | None], T], retries: int, timeout: float | None) -> T:
    """`call(timeout_left)`, sent again after the server's retry hint up to `retries` times."""
    schedule = RetrySchedule(retries, timeout)
    while True:
        try:
            return call(schedule.timeout())
        except grpc.RpcError as exc:
            wait = schedule.wait_after(exc)
            if wait is None:
                raise
            time.sleep(wait)


async def acall_with_retries(call: Callable[[float | None], Awaitable[T]], retries: int, timeout: float | None) -> T:
    """The asyncio form of `call_with_retries`."""
    schedule = RetrySchedule(retries, timeout)
    while True:
        try:
            return await call(schedule.timeout())
        except grpc.RpcError as exc:
            wait = schedule.wait_after(exc)
            if wait is None:
                raise
            await asyncio.sleep(wait)
