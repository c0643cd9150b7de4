"""`python -m bench.scale --quick` end to end on a tiny model: two pinned replicas, the load-balanced clients.

Only the shape of the results is checked (tokens, the split of the requests, the files); timings are
measured by the benchmark and never asserted in tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_measures_one_and_two_replicas(tiny_model_dir, tmp_path):
    out = tmp_path / "scale.json"
    # 2 requests per client: each client's round_robin channel alternates, so the split is exact.
    command = [sys.executable, "-m", "bench.scale", "--quick", "--requests", "2", "--model", str(tiny_model_dir)]
    command += ["--json", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["quick"] is True and results["clients"] == 8 and results["max_new_tokens"] == 16
    first, second = results["replica_cores"]
    assert first and second and not set(first) & set(second)  # each replica on its own cores
    for phase in ("1 replica", "2 replicas"):
        figures = results["phases"][phase]
        assert figures["tokens"] == 8 * 2 * 16  # every request generated exactly max_new_tokens
        assert figures["tokens_per_s"] > 0 and len(figures["round_tokens_per_s"]) == 1
    assert results["requests_per_replica_2_replicas"] == [8, 8]
    assert results["ratio_2_to_1"] > 0
    markdown = out.with_suffix(".md").read_text()
    assert "Ratio 2 : 1" in markdown and "| 2 replicas |" in markdown


def test_tp_quick_mode_compares_tp2_with_tp1(tiny_model_dir, tmp_path):
    """`python -m bench.scale --tp --quick`: both targets (batched scheduler) answer every request, with equal ids."""
    out = tmp_path / "scale_tp.json"
    command = [sys.executable, "-m", "bench.scale", "--tp", "--quick", "--model", str(tiny_model_dir)]
    command += ["--json", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["quick"] is True and results["max_new_tokens"] == 16 and results["requests_per_round"] == 2
    for name in ("TP=1", "TP=2"):
        figures = results["phases"][name]
        assert figures["tokens"] == 2 * 16  # every request generated exactly max_new_tokens
        assert figures["tokens_per_s"] > 0 and figures["ms_per_step"] > 0
    assert results["ids_equal"] is True
    assert results["max_score_difference"] <= 1e-5  # float-close (the service test checks it is not 0)
    assert results["scheduler"] == "batched"  # the service's default, under TP too
    markdown = out.with_suffix(".md").read_text()
    assert "ms per step" in markdown and "batched scheduler" in markdown
