"""The caller's deadline, seen by everything a request does on the server's side.

`specwire.serving.handles_errors` sets it from the RPC's context when a call starts; it is a
`contextvars.ContextVar`, so the request's coroutines, the threads that run its decoding loop
(they run in a copy of the RPC's context) and the calls it makes to other services see it.
Outgoing calls then bound their own timeouts by it: the config lookup and every draft round use
`min(their own cap, the caller's remaining time)`, so no work outlives the request that wanted it.
No gRPC import here: `specwire.generation` code may read it too.
"""

from __future__ import annotations

import contextvars
import time

# `time.monotonic()` at which the caller's deadline expires; None when the caller set none.
CALLER_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("specwire_caller_deadline", default=None)


def set_caller_deadline(time_remaining: float | None) -> contextvars.Token:
    """Record that the current call must end within `time_remaining` seconds (None: no deadline)."""
    return CALLER_DEADLINE.set(None if time_remaining is None else time.monotonic() + time_remaining)


def caller_deadline() -> float | None:
    """The current call's deadline on the `time.monotonic()` clock, or None."""
    return CALLER_DEADLINE.get()


def remaining(cap: float | None = None, deadline: float | None = None) -> float | None:
    """Seconds left: `min(cap, the caller's remaining time)`, never below 0; None when neither is set.

    Args:
        cap (`float`, *optional*): the operation's own limit (e.g. `--draft-timeout`).
        deadline (`float`, *optional*): a deadline captured earlier with `caller_deadline()`; defaults
            to the current context's.
    """
    deadline = caller_deadline() if deadline is None else deadline
    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    if cap is None:
        return left
    return cap if left is None else min(cap, left)
