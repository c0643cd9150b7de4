"""`python -m bench.soak` end to end on tiny random models, and the soak's definitions (outcomes, flatness).

The short run checks the report's shape and that every request is accounted for; whether the
targets are met is the soak's own verdict (its exit code), never asserted from timings here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.soak.evaluate import flatness, misses
from bench.soak.faults import CONFIG_RESTART, DRAFT_KILL, schedule
from bench.soak.kinds import EXPECTED, USES_REGISTRY, classify

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SERVICES = {"target", "draft", "config"}


def test_short_soak_writes_a_report_that_accounts_for_every_request(tiny_model_dir, tiny_draft_dir, tmp_path):
    out = tmp_path / "soak"
    command = [
        sys.executable,
        "-m",
        "bench.soak",
        "--minutes",
        "0.5",
        "--clients",
        "3",
        "--interval",
        "1",
        "--max-new-tokens",
        "8",
        "--model",
        str(tiny_model_dir),
        "--draft-model",
        str(tiny_draft_dir),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-4000:]
    results = json.loads((out / "soak.json").read_text())

    # Exit code and the one-line reasons agree with the targets in the report.
    missed = misses(results["targets"])
    assert (done.returncode == 1) == bool(missed or results["client_crashes"]), done.stderr[-2000:]
    for line in missed:
        assert line in done.stderr
    assert "t=" in done.stderr and " | target " in done.stderr  # a progress line per interval

    meta = results["meta"]
    assert meta["clients"] == 3 and meta["minutes"] == 0.5 and meta["warmup_s"] == 6.0
    assert {"date", "git_commit", "machine", "versions", "model_id", "vocab_size", "max_position_embeddings"} <= set(
        meta
    )

    # Resource samples of every service: RSS, threads and open fds, while idle and under load.
    load = [s for s in results["samples"] if s["phase"] == "load"]
    assert {s["service"] for s in load} == SERVICES
    for service in SERVICES:
        live = [s for s in load if s["service"] == service and s["rss_kib"] is not None]
        assert len(live) >= 5, service
        assert all(s["rss_kib"] > 0 and s["threads"] > 0 and s["fds"] > 0 for s in live)
    assert {s["service"] for s in results["idle"]["before"]} == SERVICES
    assert {s["service"] for s in results["idle"]["after"]} == SERVICES
    assert set(results["resources"]) == SERVICES
    assert all(results["resources"][s]["threads"] for s in SERVICES)

    # Both faults were injected (the draft service killed, the registry restarted) and each one is recorded.
    assert [f["name"] for f in results["faults"]] == [DRAFT_KILL, CONFIG_RESTART]
    for fault in results["faults"]:
        assert fault["old_pid"] != fault["new_pid"] or fault["up_s"] is None

    # Every request is counted once, by kind, status code and outcome, and per interval.
    requests = results["requests"]
    assert requests["total"] > 0
    assert sum(requests["by_outcome"].values()) == requests["total"]
    assert sum(sum(codes.values()) for codes in requests["by_kind"].values()) == requests["total"]
    assert sum(sum(i["by_outcome"].values()) for i in results["intervals"]) == requests["total"]
    assert set(requests["by_outcome"]) <= {"finished", "expected_status", "unexpected"}
    # A status outside a kind's documented set is always listed as unexpected.
    listed = requests["unexpected_by_kind"]
    for kind, codes in requests["by_kind"].items():
        for code in codes:
            documented = code in EXPECTED[kind] or code == "RESOURCE_EXHAUSTED"
            documented = documented or (code == "UNAVAILABLE" and kind in USES_REGISTRY)
            assert documented or f"{kind} -> {code}" in listed, (kind, code)
    assert sum(listed.values()) == requests["by_outcome"].get("unexpected", 0)
    assert requests["by_code"].get("INTERNAL", 0) == sum(requests["internal_messages"].values())
    # The hostile kinds ran alongside the real work (the mix is seeded: these come up in 30 s).
    assert {"greedy", "stream_cancelled", "bad_config_value"} <= set(requests["by_kind"])
    assert "over_limit_output" in results["mix"]["left_out"]  # too small a model for it

    names = {t["name"] for t in results["targets"]}
    assert {"no INTERNAL", "every request accounted for", "target RSS flat", "target threads flat"} <= names
    assert {"draft threads flat", "config RSS flat", "faults recovered", "healthy at the end"} <= names
    markdown = (out / "soak.md").read_text()
    for heading in ("## Targets", "## Requests", "## Services over time", "## Faults"):
        assert heading in markdown
    assert "](soak.png)" in markdown
    assert (out / "soak.png").read_bytes()[:8] == PNG_MAGIC


def test_outcomes_follow_the_expected_table():
    assert classify("greedy", "OK", False) == "finished"
    assert classify("greedy", "INTERNAL", False) == "unexpected"
    assert classify("greedy", "DEADLINE_EXCEEDED", False) == "unexpected"
    assert classify("bad_token_id", "INVALID_ARGUMENT", False) == "expected_status"
    assert classify("bad_token_id", "OK", False) == "unexpected"  # bad input accepted is a failure
    assert classify("over_limit_prompt", "OK", False) == "unexpected"
    assert classify("unknown_config_ref", "NOT_FOUND", False) == "expected_status"
    assert classify("greedy", "RESOURCE_EXHAUSTED", False) == "expected_status"  # documented load shedding
    # UNAVAILABLE is documented only for registry references, and only around a registry restart.
    assert classify("config_ref", "UNAVAILABLE", True) == "expected_status"
    assert classify("config_ref", "UNAVAILABLE", False) == "unexpected"
    assert classify("draft_model", "UNAVAILABLE", True) == "unexpected"  # the target must fall back
    assert classify("stream_cancelled", "CANCELLED", False) == "expected_status"


def _series(values: list[float], step: float = 10.0) -> list[dict]:
    return [{"t": i * step, "pid": 1, "threads": v} for i, v in enumerate(values)]


def test_flatness_is_judged_on_levels_after_warm_up():
    warm = [10, 20, 30, 40]  # growth during warm-up is not judged
    flat = flatness(_series(warm + [50] * 30), "threads", warmup_s=40)
    assert flat["judged"] and flat["flat"] and flat["change"] == 0.0
    spike = flatness(_series(warm + [50] * 15 + [90] + [50] * 14), "threads", warmup_s=40)
    assert spike["flat"] and spike["peak_change"] == 0.8  # one transient is reported, not judged
    leak = flatness(_series(warm + [50 + i for i in range(30)]), "threads", warmup_s=40)
    assert not leak["flat"] and leak["change"] > 0.05 and leak["slope_pct_per_hour"] > 0
    short = flatness(_series(warm + [50] * 3), "threads", warmup_s=40)
    assert not short["judged"] and short["flat"] is None
    # A restarted incarnation's warm-up counts from when it became healthy (its loading is not growth).
    loading = _series([1, 2, 5, 10, 20, 30, 40] + [50] * 30)
    assert not flatness(loading, "threads", warmup_s=40)["flat"]
    restarted = flatness(loading, "threads", warmup_s=40, healthy_from=70)
    assert restarted["flat"] and restarted["start_level"] == 50


def test_faults_scale_with_the_run_length():
    assert [name for _, name in schedule(30.0, 0.5)] == [DRAFT_KILL, CONFIG_RESTART]
    plan = schedule(1800.0, 30)
    assert [name for _, name in plan] == [DRAFT_KILL, CONFIG_RESTART] * 2
    times = [at for at, _ in plan]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 1800.0
    assert len(schedule(3600.0, 60)) == 8
