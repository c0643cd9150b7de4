"""The wire contract: buf lint passes and the committed generated code matches the .proto sources."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_protos  # noqa: E402


def test_generated_code_is_fresh(tmp_path):
    fresh = gen_protos.generate(tmp_path)
    assert fresh, "no generated files"
    stale = [
        str(path.relative_to(tmp_path))
        for path in fresh
        if (ROOT / path.relative_to(tmp_path)).read_text() != path.read_text()
    ]
    assert not stale, f"committed generated code is stale, run `python scripts/gen_protos.py`: {stale}"


def test_buf_lint_standard_passes():
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    if not Path(buf).exists():
        pytest.fail("buf is not installed: install the dev extra (buf-bin)")
    result = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
