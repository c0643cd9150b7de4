"""Real gRPC servers for tests: in-process on a background event loop, or as subprocesses."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from specwire.client.health import wait_healthy


class ThreadedServer:
    """Runs a `specwire.serving.GrpcServer` on its own event loop in a daemon thread."""

    def __init__(self, build: Callable[[], object]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.run(self._build(build))
        self.port = self.run(self.server.start())
        self.address = f"127.0.0.1:{self.port}"

    @staticmethod
    async def _build(build):
        # Build inside the loop: grpc.aio objects bind to the loop they are created on.
        return build()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 1.0) -> None:
        self.run(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextmanager
def threaded_server(build: Callable[[], object]):
    server = ThreadedServer(build)
    try:
        yield server
    finally:
        server.stop()


# Ports `free_port` hands out: each pytest-xdist worker its own range, below the kernel's ephemeral ports (32768 and
# up on Linux) and the fixed ports the README's blocks bind (tests/docs/test_readme.py). A subprocess service binds
# its port only once it has loaded its model, seconds after the test picked it: picked by `bind(0)`, the other worker
# could take the same port meanwhile, and a health check then reached the other worker's server (the likely cause of
# a tensor-parallel test that found no follower under a rank 0 that answered its health check).
PORTS_PER_WORKER = 1000
FIRST_PORT = 20000
_next_port = itertools.count()


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll `condition` until it holds: servers finish cancellations and releases on their own threads."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def free_port() -> int:
    """A port nothing is bound to now, from this worker's range, each handed out once before the range wraps."""
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    first = FIRST_PORT + index * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = first + next(_next_port) % PORTS_PER_WORKER
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {first}..{first + PORTS_PER_WORKER - 1}")


@contextmanager
def subprocess_server(args: list[str], port: int, service: str = "", timeout: float = 180.0, env=None):
    """Run a console-script server (`python -m pkg ...`) until the block ends, then SIGTERM it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_healthy(f"127.0.0.1:{port}", service=service, timeout=timeout, process=process)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class InjectedFaults:
    """A server interceptor in front of a real service: counts the calls of each method and makes the
    first `fail_first` calls of each fail with `code` (and `metadata`), or delays them by `delay_s`.

    Faults are injected around the real servicer, which answers every call that is let through: the
    tests see what gRPC and the clients do with a refused or slow call, not a stand-in service.
    """

    def __init__(self, code=None, metadata=(), fail_first: int = 1, delay_s: float = 0.0):
        import collections

        self.code = code
        self.metadata = tuple(metadata)
        self.fail_first = fail_first
        self.delay_s = delay_s
        self.calls: collections.Counter[str] = collections.Counter()

    def count(self, method: str) -> int:
        """Calls seen of `Service/Method` (e.g. "ConfigService/GetConfig"), however they ended."""
        return sum(n for name, n in self.calls.items() if name.endswith(method))

    def interceptor(self):
        import grpc

        faults = self

        class Interceptor(grpc.aio.ServerInterceptor):
            async def intercept_service(self, continuation, details):
                method = details.method
                if method.startswith("/grpc.reflection"):
                    return await continuation(details)
                faults.calls[method] += 1
                if faults.delay_s:
                    await asyncio.sleep(faults.delay_s)
                if faults.code is not None and faults.calls[method] <= faults.fail_first:

                    async def refuse(request, context):
                        await context.abort(faults.code, "injected by the test", trailing_metadata=faults.metadata)

                    return grpc.unary_unary_rpc_method_handler(refuse)
                return await continuation(details)

        return Interceptor()

    def install(self, server):
        """`server` (a `GrpcServer` not started yet) with these faults in front of its services."""
        server.interceptors.insert(0, self.interceptor())
        return server
