"""A service that cannot load its model exits at once with what was tried and the fix, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("module", "model_args", "says"),
    [
        ("specwire.target_service", ["--model", "no/such-model-here"], "cannot load model 'no/such-model-here'"),
        (
            "specwire.draft_service",
            ["--model", "default-int8", "--dtype", "bfloat16"],
            "int8 layers compute in float32",
        ),
    ],
)
def test_unloadable_model_exits_with_the_reason_and_the_fix(module, model_args, says):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module, "--port", "0", *model_args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    service = module.rpartition(".")[2].replace("_", "-")
    assert done.returncode == 1
    assert f"{service}: " in done.stderr and says in done.stderr and "fix:" in done.stderr
    assert "Traceback" not in done.stderr
