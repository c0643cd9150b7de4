"""Who is calling: set by the server's authorization for the duration of each call, read by handlers
that record authorship (the config registry).

Read it in the RPC's coroutine, before handing work to a thread pool: `run_in_executor` does not carry
context variables into the pool's threads.
"""

from __future__ import annotations

from contextvars import ContextVar

ANONYMOUS = "anonymous"

CALLER: ContextVar[str] = ContextVar("specwire_caller", default=ANONYMOUS)


def current_caller() -> str:
    """The identity of the call being handled: `"<role>:<who>"` (for example `"admin:token"` or
    `"admin:spiffe://cluster/ns/ops/sa/deployer"`), or `"anonymous"` where no credentials are configured."""
    return CALLER.get()
