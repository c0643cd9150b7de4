"""`python -m bench.speculation_waves` on a tiny model: the pairs run, and the figures add up (no timings)."""

from __future__ import annotations

import json

from bench.speculation_waves import main


def test_pairs_of_waves_report_ratios_and_what_the_controller_chose(tiny_model_dir, tmp_path, capsys):
    out, logs = tmp_path / "waves.json", tmp_path / "logs"
    argv = ["--model", str(tiny_model_dir), "--draft-model", str(tiny_model_dir), "--clients", "2", "--pairs", "2"]
    argv += ["--prompt", "low"]
    debug = ["--log-dir", str(logs), "--target-arg=--log-level", "--target-arg=DEBUG"]
    assert main([*argv, "--max-new-tokens", "8", *debug, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["git_commit"] and result["meta"]["machine"]["usable_cores"] >= 1
    assert result["prompt"] == "low"
    assert len(result["pairs"]) == 2 and all(p["plain"] > 0 and p["speculative"] > 0 for p in result["pairs"])
    low, high = result["ratio_range"]
    assert low <= result["ratio_median"] <= high
    chose = result["controller"]
    assert chose["requests"] == 4  # 2 clients x 2 pairs, every speculative request's stats
    # Each request's 8 tokens: the first from the prefill, the rest in drafting rounds or decoded without.
    assert chose["rounds_with_drafts"] > 0 or 0 < chose["tokens_without_draft"] <= 4 * 7
    assert " DEBUG " in (logs / "target.log").read_text()  # the target ran with the arguments given
    printed = capsys.readouterr().out
    assert "pair 2/2" in printed and "median of pair ratios" in printed and ", low, 2 clients" in printed
