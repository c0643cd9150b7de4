"""Our code passes ruff (pyflakes, bugbear, pyupgrade, import order, line length), is formatted as
`ruff format` writes it, and type-checks with mypy ([tool.mypy] in pyproject.toml); generated code is
excluded from all three."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.fail(f"{name} is not installed: install the dev extra")
    return path


def test_ruff_check_is_clean():
    result = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_applied():
    result = subprocess.run(
        [_tool("ruff"), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr


def test_mypy_is_clean():
    # The same interpreter as the tests, so mypy sees the installed torch, transformers, grpc, ...
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    if "No module named mypy" in result.stderr:
        pytest.fail("mypy is not installed: install the dev extra")
    assert result.returncode == 0, result.stdout + result.stderr
