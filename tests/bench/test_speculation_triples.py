"""`python -m bench.speculation_triples` on a tiny model: the triples run streamed, and the figures add up (no
timings asserted)."""

from __future__ import annotations

import json

from bench.speculation_triples import main, segments


def test_triples_report_rates_segments_and_equal_outputs(tiny_model_dir, tmp_path, capsys):
    out, logs = tmp_path / "triples.json", tmp_path / "logs"
    argv = ["--model", str(tiny_model_dir), "--draft-model", str(tiny_model_dir), "--triples", "2", "--settle", "1"]
    assert main([*argv, "--max-new-tokens", "12", "--log-dir", str(logs), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["git_commit"] and result["prompt"] == "chat" and result["settle"] == 1
    assert set(result["tokens_per_second"]) == {"plain", "controller", "schedule"}
    assert len(result["controller_over_plain"]) == len(result["controller_over_schedule"]) == 2
    # Marks 10 and the last token: the time to them grows along the answer, and plain runs at 1.0x of itself.
    for mode, at in result["time_to_token"].items():
        assert list(at) == ["10", "12"] and 0 < at["10"] <= at["12"], mode
    assert result["speed_over_plain_by_segment"]["plain"] == {"1-10": 1.0, "10-12": 1.0}
    assert len(result["controller"]["tokens_without_draft"]) == 2
    assert result["outputs_equal"] is True  # a tiny model's outputs, greedy: speculation is lossless
    assert (logs / "target.log").read_text()
    printed = capsys.readouterr().out
    assert "triple 2/2 schedule" in printed and "controller over schedule" in printed and "equal" in printed


def test_segments_divide_plain_time_by_the_modes_between_marks():
    times = {"plain": {10: [1.0, 1.2], 20: [2.0, 2.2]}, "fast": {10: [1.1, 1.1], 20: [1.6, 1.6]}}
    spans = segments(times, [10, 20])
    assert spans["fast"]["1-10"] == 1.1 / 1.1 and spans["fast"]["10-20"] == (2.1 - 1.1) / (1.6 - 1.1)
    # Both marks in one round (a block kept whole spans them): no speed to give.
    assert segments({"plain": times["plain"], "burst": {10: [1.0], 20: [1.0]}}, [10, 20])["burst"]["10-20"] is None
