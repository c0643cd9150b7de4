"""Real gRPC servers for tests: in-process on a background event loop, or as subprocesses."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


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


def wait_healthy(
    address: str, service: str = "", timeout: float = 120.0, process: subprocess.Popen | None = None
):
    """Poll grpc.health.v1 until SERVING (fails early if `process` exits)."""
    from specwire.security import secure_channel

    deadline = time.monotonic() + timeout
    with secure_channel(address) as channel:  # TLS when the test environment asks for it
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode} before becoming healthy")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy after {timeout}s")


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
        wait_healthy(f"127.0.0.1:{port}", service, timeout, process)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
