"""Samples of a service process: resident memory, threads and open file descriptors, from /proc."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specwire.security.channels import secure_channel


def read_process(pid: int) -> dict | None:
    """`rss_kib` (VmRSS), `threads` (Threads), `fds` (entries of /proc/PID/fd) and `thread_names`.

    None if the process is gone.
    """
    values: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == "VmRSS":
                values["rss_kib"] = int(rest.split()[0])
            elif key == "Threads":
                values["threads"] = int(rest.split()[0])
            elif key == "State" and rest.split()[0] == "Z":
                return None  # exited, not yet reaped
        values["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        values["thread_names"] = thread_names(pid)
    except (OSError, ValueError, IndexError):
        return None
    return values if {"rss_kib", "threads"} <= set(values) else None


def thread_names(pid: int) -> dict[str, int]:
    """How many of the process's threads carry each kernel name (/proc/PID/task/*/comm).

    gRPC core names its threads (`grpc_global_tim`, `event_engine`, ...), Python 3.11 threads and
    torch's OpenMP workers keep the process's name: when the thread count moves, this says whose.
    """
    names: dict[str, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


class HealthProbe:
    """`grpc.health.v1` Check of one address, over one channel kept for the whole run."""

    def __init__(self, address: str):
        self.channel = secure_channel(address)
        self.stub = health_pb2_grpc.HealthStub(self.channel)

    def check(self, timeout: float = 1.0) -> str:
        """SERVING, NOT_SERVING, ... or the status code name when the check itself failed."""
        try:
            status = self.stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status
        except grpc.RpcError as error:
            return error.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    def close(self) -> None:
        self.channel.close()
