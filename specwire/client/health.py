"""Waiting for a service to report SERVING on `grpc.health.v1` (the CLI, the benchmark and the tests)."""

from __future__ import annotations

import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specwire.security.channels import secure_channel


class NotHealthy(RuntimeError):
    """The service's process exited, or it did not report SERVING in time."""


def wait_healthy(
    address: str, *, service: str = "", timeout: float = 120.0, process: subprocess.Popen | None = None
) -> None:
    """Poll the health service at `address` until `service` ("" = the server) is SERVING.

    Args:
        address (`str`): `host:port`; TLS follows the environment (`specwire.security`); no token is sent.
        service (`str`, defaults to `""`): the health service name to check.
        timeout (`float`, defaults to 120.0): seconds before giving up.
        process (`subprocess.Popen`, *optional*): the server's process: its exit fails the wait at once.

    Raises:
        `NotHealthy`: the process exited, or the service was not SERVING after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    # No token: health checks need none, and one must not travel in plaintext to wait for a server.
    with secure_channel(address, token="") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise NotHealthy(f"exited with code {process.returncode} while starting")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise NotHealthy(f"was not healthy after {timeout:.0f}s")
