"""`python -m bench --quick --workloads speculation_matrix` on a tiny random model (the draft is the target's
own weights, so blocks are accepted and drafted ahead): every row of the matrix ran on each prompt or says
why not, every speculative output equals plain greedy on the same target, the pinned remote targets
drafted ahead with hits, and the report carries the matrix and issue #23's targets. Timings are never
asserted."""

from __future__ import annotations

from bench.speculation_matrix import PROMPTS, SPECULATIVE
from tests.bench.test_bench_quick import run_quick


def test_quick_speculation_matrix(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    _, results = run_quick(
        out, "--model", str(tiny_model_dir), "--draft-model", str(tiny_model_dir), "--workloads", "speculation_matrix"
    )
    matrix = results["workloads"]["speculation_matrix"]
    assert matrix["status"] in ("ok", "partial"), matrix.get("reason")
    assert set(matrix["prompts"]) == set(PROMPTS)
    baselines = ["plain_greedy", "pinned_plain_greedy", "colocated_plain_greedy"]
    for key, prompt in matrix["prompts"].items():
        for label in [*baselines, *(row[0] for row in SPECULATIVE)]:
            assert label in prompt["series"] or label in prompt["unavailable"], (key, label)
        for label in ("transformers_greedy", "transformers_prompt_lookup", "transformers_assisted"):
            assert prompt["series"][label]["tokens_per_second"]["median"] > 0
        hits = prompt["speculation"]["remote_overlapped_off"]["draft_ahead_hits"]["median"]
        assert hits > 0, key  # the target's own weights: whole blocks accepted, the bonus guessed
        assert prompt["speculation"]["remote_serial_off"]["draft_ahead_hits"]["median"] == 0
        assert prompt["ratios"]["remote overlapped / remote serial, controller off (pinned)"] is not None
        assert prompt["ratios"]["co-located, controller on / plain greedy (same target)"] is not None
        chosen = prompt["controller"]["colocated_on"]  # what the controller chose, for the plot
        assert sum(rounds for _, rounds in chosen["draft_lengths"]) > 0, chosen
    checks = matrix["checks"]
    assert checks and not [c for c in checks if c["passed"] is False], [c for c in checks if c["passed"] is False]
    assert sum(1 for c in checks if c["passed"]) >= len(PROMPTS) * 6
    first = matrix["first_requests"]  # each target's first speculative request, apart from the repeats
    assert first and set(first) <= {row[0] for row in SPECULATIVE} and all(v > 0 for v in first.values())
    concurrency = matrix["concurrency"]
    assert concurrency["clients"] == 2 and all(v is not None for v in concurrency["ratios"].values())
    # Each speculative wave ran beside a plain wave on its target: one pair a repeat, the ratio their median.
    # On every prompt, for every case.
    waves = concurrency["aggregate_tokens_per_second"]
    assert concurrency["prompts"] == list(PROMPTS) and len(concurrency["pair_ratios"]) == 3 * len(PROMPTS)
    repeats = waves["colocated_on, chat"]["n"]
    for key in PROMPTS:
        assert (
            waves[f"plain_greedy, {key}"]["n"] == 2 * repeats
            and waves[f"colocated_plain_greedy, {key}"]["n"] == repeats
        )
        colocated = concurrency["pair_ratios"][f"co-located draft / plain greedy (same target), {key}"]["values"]
        on, plain = waves[f"colocated_on, {key}"]["values"], waves[f"colocated_plain_greedy, {key}"]["values"]
        assert colocated == [a / b for a, b in zip(on, plain, strict=True)]
    chosen = concurrency["controller"]["colocated_on, low"]  # every speculative request's choices, per case
    assert chosen["requests"] == 2 * repeats and chosen["rounds_with_drafts"] + chosen["tokens_without_draft"] > 0
    assert "What the controller chose in the speculative waves" in (out / "results.md").read_text()
    for name, pairs in concurrency["pair_ratios"].items():
        assert pairs["n"] == repeats and concurrency["ratios"][name] == pairs["median"]
    names = {t["name"] for t in results["targets"]}
    assert "controller: slowest speculative row vs plain greedy" in names
    assert "remote overlapped vs remote serial, same pinning (chat)" in names
    equal = next(t for t in results["targets"] if t["name"] == "every speculative output equals plain greedy (matrix)")
    assert equal["met"] is True
    markdown = (out / "results.md").read_text()
    assert "### 11. Speculation matrix" in markdown and "draft remote overlapped (pinned)" in markdown
    assert "First request on each fresh target" in markdown
    assert "Each row ran once, the rows alternating" in markdown  # quick mode: its one repeat
    assert "| remote draft / plain greedy, code | " in markdown and "(pairs " in markdown
    assert "speculation_matrix.png" in results["plots"]
    assert "controller_draft_length.png" in results["plots"]
    assert (out / "controller_draft_length.png").read_bytes()[:4] == b"\x89PNG"
