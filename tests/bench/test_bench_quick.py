"""`python -m bench --quick` end to end on a tiny random model: services, both sides, every workload, results.

Only the shape of the results is checked here (files, keys, correctness checks); timings are measured by
the benchmark and never asserted in tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL_WORKLOADS = [
    "greedy",
    "sampling",
    "beam",
    "prompt_lookup",
    "draft_model",
    "concurrency",
    "draft_length",
    "roundtrip",
    "memory",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_quick(out: Path, *options: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m bench --quick` with 16 new tokens into `out`: the finished process and its results."""
    command = [sys.executable, "-m", "bench", "--quick", "--max-new-tokens", "16", "--out", str(out), *options]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return done, json.loads((out / "results.json").read_text())


def test_quick_mode_writes_json_markdown_and_plots(tiny_model_dir, tiny_draft_dir, tmp_path):
    out = tmp_path / "results"
    done, results = run_quick(
        out,
        "--model",
        str(tiny_model_dir),
        "--draft-model",
        str(tiny_draft_dir),
        "--workloads",
        ",".join(ALL_WORKLOADS),
    )
    assert "[bench" in done.stderr  # progress goes to stderr

    meta = results["meta"]
    for key in (
        "date",
        "git_commit",
        "machine",
        "versions",
        "model",
        "draft_model",
        "repeats",
        "max_new_tokens",
    ):
        assert key in meta, key
    assert meta["quick"] is True and meta["max_new_tokens"] == 16 and meta["repeats"] == 1
    assert (meta["device"], meta["dtype"], meta["draft_device"]) == ("cpu", "float32", "cpu")
    assert {"cpu_model", "logical_cores", "ram_gib"} <= set(meta["machine"])
    assert {"python", "torch", "transformers", "specwire"} <= set(meta["versions"])

    workloads = results["workloads"]
    assert list(workloads) == ALL_WORKLOADS
    for name, workload in workloads.items():
        assert workload["status"] in ("ok", "partial", "unavailable"), (name, workload.get("reason"))
    # Both sides ran the plain decoding modes, with medians, minima and maxima.
    for name in ("greedy", "sampling", "beam"):
        for side in ("specwire", "transformers"):
            summary = workloads[name]["series"][side]["tokens_per_second"]
            assert {"median", "min", "max", "n"} <= set(summary) and summary["n"] == 1
    assert workloads["greedy"]["series"]["specwire_stream"]["ttft_seconds"]["median"] > 0
    # transformers' speculative sides always run; specwire's either ran or says why not.
    assert "transformers_prompt_lookup" in workloads["prompt_lookup"]["series"]
    assert "transformers_assisted" in workloads["draft_model"]["series"]
    for name, label in (("prompt_lookup", "specwire_prompt_lookup"), ("draft_model", "specwire_draft_model")):
        assert label in workloads[name]["series"] or workloads[name]["unavailable"][label]
    assert [p["draft_length"] for p in workloads["draft_length"]["points"]] == [2, 8]
    assert set(workloads["concurrency"]["levels"]) == {"1", "2"}
    assert workloads["roundtrip"]["direct"]["empty_round"]["p50_ms"]["median"] > 0
    memory = workloads["memory"]
    assert memory["services"]["target"]["peak_rss_mb"] > 0 and memory["device_peak_mb"] is None
    assert "--device cpu --dtype float32" in memory["services"]["target"]["args"]
    assert "--device cpu --dtype float32" in memory["services"]["draft"]["args"]

    # Every speculative run of ours that ran matched plain greedy (lossless speculation).
    checks = [c for w in workloads.values() for c in w["checks"]]
    assert any(c["name"] == "specwire greedy equals transformers greedy" for c in checks)
    assert not [
        c for c in checks if c["name"].startswith("specwire") and "prompt lookup" in c["name"] and c["passed"] is False
    ]
    assert not [c for c in checks if c["name"].startswith("specwire draft model") and c["passed"] is False]

    assert {t["name"] for t in results["targets"]} >= {
        "greedy tokens/s vs transformers",
        "draft round trip p50 (loopback)",
        "target service peak resident memory",
    }
    markdown = (out / "results.md").read_text()
    for heading in ("## Targets", "## Results", "## Checks", "### 9. Memory"):
        assert heading in markdown
    assert results["plots"], "no plots written"
    for plot in results["plots"]:
        assert (out / plot).read_bytes()[:8] == PNG_MAGIC
        assert f"]({plot})" in markdown


def test_dtype_reaches_both_sides(tiny_model_dir, tmp_path):
    """--dtype bfloat16: the target serves bfloat16 and transformers runs bfloat16, with the same greedy tokens."""
    out = tmp_path / "results"
    done, results = run_quick(
        out, "--model", str(tiny_model_dir), "--dtype", "bfloat16", "--workloads", "greedy,memory"
    )
    assert results["meta"]["dtype"] == "bfloat16"
    assert "--dtype bfloat16" in results["workloads"]["memory"]["services"]["target"]["args"]
    assert "on cpu as bfloat16" in done.stderr  # the transformers side
    checks = {c["name"]: c for c in results["workloads"]["greedy"]["checks"]}
    assert checks["specwire greedy equals transformers greedy"]["passed"] is True
    assert "In bfloat16 a verify forward over several tokens rounds differently" in (out / "results.md").read_text()
