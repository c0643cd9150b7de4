"""Real gRPC servers for tests: in-process on a background event loop, or as subprocesses."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
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


# The fixed ports the README's blocks bind (`specwire serve`'s defaults, a second registry and target): the suite runs
# on two workers (pyproject's addopts), and a port picked here must not be one tests/docs/test_readme.py is about to
# bind in the other.
README_PORTS = frozenset({50051, 50052, 50053, 50061, 50062, 9464})


def free_port() -> int:
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in README_PORTS:
            return port


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
