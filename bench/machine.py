"""What the numbers were measured on: machine, versions, commit and date."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def describe(module: str = "bench") -> dict:
    """Machine, software versions, git commit and the UTC date, for the results' header; `module` is the
    `python -m` module the command ran."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "machine": {
            "cpu_model": _cpu_model(),
            "logical_cores": os.cpu_count(),
            "usable_cores": usable,
            "torch_threads": torch.get_num_threads(),
            "ram_gib": _ram_gib(),
            "os": platform.platform(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "grpcio": _version("grpcio"),
            "specwire": _version("specwire"),
        },
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join([Path(sys.executable).name, "-m", module, *sys.argv[1:]]),
    }
