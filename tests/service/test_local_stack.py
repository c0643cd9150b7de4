"""`specwire serve` as a user runs it: ports it cannot share, children that die with it, where state goes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from specwire.client.cli import main
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.ports import port_free
from tests.servers import free_port, threaded_server


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def test_a_service_refuses_a_port_in_use_with_one_line_naming_the_holder(tmp_path):
    with threaded_server(lambda: build_config_server(str(tmp_path / "a.db"))) as first:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "specwire.config_service",
                "--port",
                str(first.port),
                "--db",
                str(tmp_path / "b.db"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"127.0.0.1:{first.port} is already in use by pid {os.getpid()}" in result.stderr


def test_a_port_whose_last_connection_lingers_in_time_wait_is_free_one_listened_on_is_not():
    """The local stack's check before it starts anything (`specwire demo` run twice in a row)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's servers do
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not port_free("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its end of the connection lingers in TIME-WAIT
            client.recv(1)
    lingering = [line for line in Path("/proc/net/tcp").read_text().splitlines()[1:] if f":{port:04X} " in line]
    assert any(line.split()[3] == "06" for line in lingering)  # TIME_WAIT
    assert port_free("127.0.0.1", port)


def _serve(tiny_model_dir, home: Path, ports: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "specwire.client.cli", "serve", "--model", str(tiny_model_dir), "--draft-model", "none"]
        + ["--config-port", ports[0], "--target-port", ports[1], "--draft-port", ports[2]],
        env={**os.environ, "SPECWIRE_HOME": str(home), "PYTHONUNBUFFERED": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )


def _until_healthy(process: subprocess.Popen) -> list[str]:
    lines = []
    for line in process.stderr:
        lines.append(line)
        if "press Ctrl-C" in line or "error:" in line:
            break
    return lines


def test_serve_keeps_state_in_specwire_home_refuses_a_second_copy_and_takes_its_children_down(tiny_model_dir, tmp_path):
    ports = [str(free_port()) for _ in range(3)]
    serve = _serve(tiny_model_dir, tmp_path / "home", ports)
    try:
        said = "".join(_until_healthy(serve))
        assert "all services healthy" in said, said
        assert f"registry: {tmp_path / 'home' / 'registry.db'}" in said
        assert (tmp_path / "home" / "logs" / "target-service.log").is_file()
        children = _children(serve.pid)
        assert len(children) == 3
        addresses = [f"--{n}-address=127.0.0.1:{p}" for n, p in zip(("config", "target", "draft"), ports, strict=True)]
        assert main(["health", *addresses]) == 0

        # A second serve on the same ports: refused, naming who holds the port; the first is unharmed.
        second = _serve(tiny_model_dir, tmp_path / "home2", ports)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 1 and "already in use by pid" in err and "Traceback" not in err
        assert "stopped" in err
        assert all(_alive(pid) for pid in children)

        serve.send_signal(signal.SIGKILL)  # no chance to clean up: the children must go by themselves
        serve.wait(10)
        assert _wait(lambda: not any(_alive(pid) for pid in children)), [p for p in children if _alive(p)]
        assert main(["health", *addresses]) == 1
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
