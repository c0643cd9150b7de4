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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
