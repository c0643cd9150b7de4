"""Who holds a TCP port: for a one-line "port in use" message instead of a bind traceback.

gRPC enables SO_REUSEPORT by default, so two servers on one port both start and split the traffic
between them; `specwire.serving.GrpcServer` turns it off, and a refused bind names the process that
holds the port when Linux's /proc says so (best effort: other users' processes and other systems
give no name).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


class PortInUse(OSError):
    """A server could not bind its address because something else listens there."""


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def port_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now. With SO_REUSEADDR, as gRPC binds: a port whose last connections
    linger in TIME-WAIT (a minute after a service on it stopped) is free, one something listens on is not. Probed
    without it, `specwire demo` run twice within a minute refused to start the second time."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str | None:
    """`pid N (command line)` of a process listening on `port`, or None when it cannot be told."""
    inodes = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                continue
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        return f"pid {pid} ({command.strip()[:120]})"
    return None


def port_in_use(host: str, port: int) -> PortInUse:
    """The error for a refused bind of `host:port`, naming the holder when it can."""
    holder = port_holder(port)
    who = f"by {holder}" if holder else "by another process"
    return PortInUse(f"{host}:{port} is already in use {who}: stop it, or pick another port with --port")
