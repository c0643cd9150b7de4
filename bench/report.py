"""Results on disk: `results.json` (everything), `results.md` (tables) and PNG plots (`bench.plots`).

The targets are evaluated by `bench.evaluate.evaluate_targets` before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.evaluate import evaluate_targets
from bench.plots import PLOTS, plot
from bench.stats import lookup, ratio

NOISE_NOTE = (
    "Measured on a shared machine (other engineers' tests may run at the same time): figures are "
    "noisy. Each figure is the median over the repeats, with (min-max)."
)


def _fmt(summary: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    if not summary:
        return "n/a"
    return (
        f"{summary['median'] * scale:.{digits}f} ({summary['min'] * scale:.{digits}f}-"
        f"{summary['max'] * scale:.{digits}f})"
    )


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def _ratio_cell(a: dict | None, b: dict | None) -> str:
    value = ratio(a, b)
    return "n/a" if value is None else f"{value:.2f}x"


def _met(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[met]


def _main_table(w: dict) -> list[str]:
    lines = [
        "| workload | metric | specwire | transformers | specwire / transformers |",
        "|---|---|---|---|---|",
    ]

    def row(name, metric, ours, theirs, scale=1.0, digits=1, higher_better=True):
        r = _ratio_cell(ours, theirs) if higher_better else _ratio_cell(theirs, ours)
        lines.append(f"| {name} | {metric} | {_fmt(ours, scale, digits)} | {_fmt(theirs, scale, digits)} | {r} |")

    if "greedy" in w and w["greedy"].get("series"):
        s = w["greedy"]["series"]
        row(
            "1. greedy, chat",
            "tokens/s",
            lookup(s, "specwire", "tokens_per_second"),
            lookup(s, "transformers", "tokens_per_second"),
        )
        row(
            "1. greedy, chat",
            "time to first token (ms; ratio = transformers / specwire)",
            lookup(s, "specwire_stream", "ttft_seconds"),
            lookup(s, "transformers_streamer", "ttft_seconds"),
            1000,
            0,
            higher_better=False,
        )
        row(
            "1. greedy, chat",
            "tokens/s while streaming",
            lookup(s, "specwire_stream", "tokens_per_second"),
            lookup(s, "transformers_streamer", "tokens_per_second"),
        )
    for key, name in (("sampling", "2. sampling top_p 0.9 T 0.7"), ("beam", "3. beam search, 4 beams")):
        if key in w and w[key].get("series"):
            s = w[key]["series"]
            row(
                name,
                "tokens/s",
                lookup(s, "specwire", "tokens_per_second"),
                lookup(s, "transformers", "tokens_per_second"),
            )
    for key, name, spec, ref in (
        (
            "prompt_lookup",
            "4. prompt lookup, code edit",
            "specwire_prompt_lookup",
            "transformers_prompt_lookup",
        ),
        ("draft_model", "5. draft model (int8)", "specwire_draft_model", "transformers_assisted"),
    ):
        if key not in w or not w[key].get("series"):
            continue
        s = w[key]["series"]
        ours = lookup(s, spec, "tokens_per_second")
        row(name, "tokens/s, speculative", ours, lookup(s, ref, "tokens_per_second"))
        row(
            name,
            "tokens/s, plain greedy (same prompt)",
            lookup(s, "specwire_greedy", "tokens_per_second"),
            lookup(s, "transformers_greedy", "tokens_per_second"),
        )
        lines.append(
            f"| {name} | speed-up over own greedy | "
            f"{_ratio_cell(ours, lookup(s, 'specwire_greedy', 'tokens_per_second'))} | "
            f"{_ratio_cell(lookup(s, ref, 'tokens_per_second'), lookup(s, 'transformers_greedy', 'tokens_per_second'))}"  # noqa: E501
            f" | |"
        )
        acceptance = lookup(w[key], "speculation", spec, "acceptance_rate")
        if acceptance:
            lines.append(f"| {name} | acceptance rate | {_fmt(acceptance, 1, 2)} | n/a | |")
        if w[key].get("unavailable"):
            lines.append(
                f"| {name} | specwire | speculation not available: {next(iter(w[key]['unavailable'].values()))} | | |"
            )
    return lines


def _concurrency_table(c: dict) -> list[str]:
    lines = [
        "| clients | aggregate tokens/s | vs 1 client | latency p50 (s) | latency p99 (s) |",
        "|---|---|---|---|---|",
    ]
    one = lookup(c, "levels", "1", "aggregate_tokens_per_second")
    for level in sorted(c["levels"].values(), key=lambda level: level["clients"]):
        lines.append(
            f"| {level['clients']} | {_fmt(level['aggregate_tokens_per_second'])} | "
            f"{_ratio_cell(level['aggregate_tokens_per_second'], one)} | "
            f"{_num(level['latency_p50_seconds'])} | {_num(level['latency_p99_seconds'])} |"
        )
    seq = c["transformers_sequential"]
    seconds = _num(lookup(seq, "seconds", "median"))
    lines.append(f"| transformers, sequential | {_fmt(seq['tokens_per_second'])} | | {seconds} | |")
    return lines


def _sweep_table(d: dict) -> list[str]:
    labels = [
        ("specwire_prompt_lookup", "specwire PL"),
        ("transformers_prompt_lookup", "transformers PL"),
        ("specwire_draft_model", "specwire draft"),
        ("transformers_assisted", "transformers assisted"),
    ]
    present = [(key, name) for key, name in labels if any(key in p for p in d["points"])]
    if not present:
        return ["(no runs)"]
    header = (
        "| draft length | "
        + " | ".join(f"{name} tok/s" for _, name in present)
        + " | "
        + " | ".join(f"{name} acceptance" for key, name in present if key.startswith("specwire"))
        + " |"
    )
    n_cols = len(present) + sum(1 for key, _ in present if key.startswith("specwire"))
    lines = [header.replace("|  |", "|"), "|---" * (n_cols + 1) + "|"]
    for p in d["points"]:
        cells = [_fmt(lookup(p, key, "tokens_per_second")) for key, _ in present]
        cells += [_fmt(lookup(p, key, "acceptance_rate"), 1, 2) for key, _ in present if key.startswith("specwire")]
        lines.append(f"| {p['draft_length']} | " + " | ".join(cells) + " |")
    for key, series in d.get("baselines", {}).items():
        lines.append(f"| greedy baseline: {key} | {_fmt(series['tokens_per_second'])} |" + " |" * (n_cols - 1))
    return lines


MATRIX_ROWS = [
    ("plain_greedy", "plain greedy"),
    ("pinned_plain_greedy", "plain greedy, pinned target"),
    ("colocated_plain_greedy", "plain greedy, co-located target"),
    ("prompt_lookup_on", "prompt lookup, controller on"),
    ("prompt_lookup_off", "prompt lookup, controller off"),
    ("colocated_on", "draft co-located, controller on"),
    ("colocated_off", "draft co-located, controller off"),
    ("remote_overlapped_on", "draft remote overlapped (pinned), controller on"),
    ("remote_overlapped_off", "draft remote overlapped (pinned), controller off"),
    ("remote_serial_on", "draft remote serial (pinned), controller on"),
    ("remote_serial_off", "draft remote serial (pinned), controller off"),
    ("transformers_greedy", "transformers greedy"),
    ("transformers_prompt_lookup", "transformers prompt lookup"),
    ("transformers_assisted", "transformers assisted (same draft)"),
]


def _matrix_tables(m: dict) -> list[str]:
    prompts = m["prompts"]
    keys = list(prompts)
    runs = lookup(prompts[keys[0]], "series", "plain_greedy", "tokens_per_second", "n") if keys else None
    times = "once" if runs == 1 else f"{runs} times"
    lines = [
        f"{m.get('pinning', '')}."
        + (f" Each row ran {times}, the rows alternating (medians, min-max)." if runs else ""),
        "",
        "| row | " + " | ".join(f"{k} tok/s" for k in keys) + " | acceptance | drafted ahead: hits / misses |",
    ]
    lines.append("|---" * (len(keys) + 3) + "|")
    for label, name in MATRIX_ROWS:
        cells = [_fmt(lookup(prompts[k], "series", label, "tokens_per_second")) for k in keys]
        spec = [lookup(prompts[k], "speculation", label) for k in keys]
        acceptance = " / ".join(_num(lookup(s, "acceptance_rate", "median")) for s in spec) if any(spec) else ""
        ahead = ""
        if label.startswith("remote_overlapped"):
            ahead = " / ".join(
                _num(lookup(s, "draft_ahead_hits", "median"), 0)
                + ":"
                + _num(lookup(s, "draft_ahead_misses", "median"), 0)
                for s in spec
            )
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {acceptance} | {ahead} |")
    lines += ["", "| ratio (medians) | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name in next(iter(prompts.values()))["ratios"]:
        lines.append(f"| {name} | " + " | ".join(_num(prompts[k]["ratios"].get(name), 2, "x") for k in keys) + " |")
    first = m.get("first_requests")
    if first:
        names = dict(MATRIX_ROWS)
        lines += [
            "",
            "First request on each fresh target (chat, before the timed runs, not in the medians): "
            + ", ".join(f"{names.get(label, label)} {value:.1f} tok/s" for label, value in first.items())
            + ".",
        ]
    c = m.get("concurrency")
    if c:
        prompts = ", ".join(c.get("prompts", ["chat"]))  # results before `prompts` waved on chat only
        lines += ["", f"{c['clients']} concurrent clients, speculation on (prompts: {prompts}):", ""]
        lines += ["| case | aggregate tokens/s |", "|---|---|"]
        lines += [f"| {label} | {_fmt(summary)} |" for label, summary in c["aggregate_tokens_per_second"].items()]
        pairs = c.get("pair_ratios") or {}
        lines += [
            f"| {name} | {_num(value, 2, 'x')}"
            + (f" (pairs {pairs[name]['min']:.2f}x-{pairs[name]['max']:.2f}x)" if pairs.get(name) else "")
            + " |"
            for name, value in c["ratios"].items()
        ]
        chosen = c.get("controller") or {}
        if chosen:
            lines += [
                "",
                "What the controller chose in the speculative waves: "
                + "; ".join(
                    f"{name}: {x['rounds_with_drafts']} rounds with drafts, {x['tokens_without_draft']} tokens "
                    f"without, {x['probes']} probes or look-backs over {x['requests']} requests"
                    for name, x in chosen.items()
                )
                + ".",
            ]
    return lines


def markdown(results: dict, plots: list[str]) -> str:
    meta, w = results["meta"], results["workloads"]
    m, v = meta["machine"], meta["versions"]
    out = [f"# specwire benchmark, {meta['date']}", ""]
    out.append(
        f"- machine: {m['cpu_model']}, {m['usable_cores']} usable cores ({m['logical_cores']} logical), "
        f"{m['ram_gib']} GiB RAM, torch threads {m['torch_threads']}"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU")
    )
    out.append(
        f"- software: Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
        f"grpcio {v['grpcio']}, specwire {v['specwire']}; {m['os']}"
    )
    dirty = " (with uncommitted changes)" if meta.get("git_dirty") else ""
    out.append(f"- commit: `{meta['git_commit']}`{dirty}; command: `{meta['command']}`")
    device = meta.get("device", "cpu")
    out.append(
        f"- device: {device}, dtype {meta.get('dtype', 'float32')}; draft on {meta.get('draft_device', 'cpu')} "
        f"in {meta.get('draft_dtype', 'float32')}"
        + ("; the targets below are defined for a 2-core CPU and shown for reference" if device != "cpu" else "")
    )
    out.append(
        f"- model: `{meta['model']}` ({meta.get('model_id', '')}); draft: `{meta['draft_model']}`; "
        f"{meta['max_new_tokens']} new tokens; {meta['repeats']} repeat(s)"
        + ("; **quick mode**" if meta["quick"] else "")
    )
    if meta.get("target_args"):
        out.append(f"- target-service options: `{' '.join(meta['target_args'])}`")
    if meta.get("draft_service_note"):
        out.append(f"- draft service: {meta['draft_service_note']}")
    out.append(
        f"- {NOISE_NOTE} Load average (1, 5, 15 min) at the start: {meta.get('load_average_at_start')}, "
        f"at the end: {meta.get('load_average_at_end')}; run time {meta.get('elapsed_seconds')} s."
    )
    out += ["", "## Targets", "", "| target | goal | measured | result | how |", "|---|---|---|---|---|"]
    for t in results["targets"]:
        unit = " ms" if "ms" in t["goal"] else (" MB" if "MB" in t["goal"] else "x")
        out.append(f"| {t['name']} | {t['goal']} | {_num(t['measured'], 2, unit)} | {_met(t['met'])} | {t['detail']} |")
    out += ["", "## Results", "", *_main_table(w)]
    if "concurrency" in w and w["concurrency"].get("levels"):
        out += [
            "",
            "### 6. Concurrent clients (greedy, chat prompt)",
            "",
            *_concurrency_table(w["concurrency"]),
        ]
    if "roundtrip" in w and w["roundtrip"].get("direct"):
        rt = w["roundtrip"]
        out += [
            "",
            "### 7. Draft round trip per speculative round",
            "",
            "| measurement | p50 (ms) | p99 (ms) |",
            "|---|---|---|",
        ]
        for name, d in rt["direct"].items():
            out.append(
                f"| direct Draft stream, {name} ({d['rounds_per_repeat']} rounds x repeats) | "
                f"{_fmt(d['p50_ms'], 1, 3)} | {_fmt(d['p99_ms'], 1, 3)} |"
            )
        if rt.get("via_target"):
            vt = rt["via_target"]
            out.append(
                f"| draft time per round seen by the target ({vt['requests']} requests) | "
                f"{_num(vt['draft_ms_per_round_p50'], 3)} | {_num(vt['draft_ms_per_round_p99'], 3)} |"
            )
        elif rt.get("reason"):
            out.append(f"| seen by the target | {rt['reason']} | |")
    if "draft_length" in w and w["draft_length"].get("points"):
        out += ["", "### 8. Acceptance and speed versus draft length", "", *_sweep_table(w["draft_length"])]
    if "memory" in w and w["memory"].get("services"):
        mem = w["memory"]
        out += [
            "",
            "### 9. Memory (peak resident size, VmHWM)",
            "",
            "| service | options | peak RSS (MB) | RSS at the end (MB) |",
            "|---|---|---|---|",
        ]
        for name, s in mem["services"].items():
            out.append(f"| {name} | `{s['args']}` | {_num(s['peak_rss_mb'], 0)} | {_num(s['rss_mb'], 0)} |")
        out.append(
            f"| budget for the target | 1.5 x {mem['model_float32_mb']:.0f} MB float32 + 300 MB | "
            f"{mem['target_budget_mb']:.0f} | |"
        )
        if mem.get("device_peak_mb"):
            out += ["", f"| peak device memory on {mem['device']} | MB |", "|---|---|"]
            out += [f"| {side} | {_num(mb, 0)} |" for side, mb in mem["device_peak_mb"].items()]
    if "structured" in w and w["structured"].get("series"):
        from bench.structured_workload import readme_table

        out += ["", "### 10. Structured output (JSON schemas, greedy)", "", *readme_table(w["structured"])]
    if "speculation_matrix" in w and w["speculation_matrix"].get("prompts"):
        out += ["", "### 11. Speculation matrix (issue #23)", "", *_matrix_tables(w["speculation_matrix"])]
    out += ["", "## Checks", ""]
    if meta.get("dtype", "float32") != "float32":
        out += [
            f"In {meta['dtype']} a verify forward over several tokens rounds differently from one-token "
            "steps, so speculative output may leave plain greedy where a logit is near a tie, on either "
            "side; compare specwire's checks with transformers' own.",
            "",
        ]
    for name, workload in w.items():
        for check in workload.get("checks", []):
            mark = {True: "PASS", False: "FAIL", None: "not run"}[check["passed"]]
            out.append(f"- {mark}: {check['name']} ({name}: {check['detail']})")
    problems = [(name, wl) for name, wl in w.items() if wl.get("status") != "ok" or wl.get("reason")]
    if problems:
        out += ["", "## Not measured or partial", ""]
        for name, wl in problems:
            out.append(f"- {name} ({wl['status']}): {wl.get('reason')}")
    notes = [f"{name}: {note}" for name, wl in w.items() for note in wl.get("notes", [])]
    if notes:
        out += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    if plots:
        out += ["", "## Plots", ""] + [f"![{PLOTS[p]}]({p})" for p in plots]
    return "\n".join(out) + "\n"


def write(results: dict, folder: Path) -> dict[str, Path]:
    """Write results.json, results.md and the plots into `folder`; return the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    results["targets"] = evaluate_targets(results)
    plots = plot(results, folder)
    results["plots"] = plots
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (folder / "results.md").write_text(markdown(results, plots))
    return {
        "json": folder / "results.json",
        "markdown": folder / "results.md",
        **{p: folder / p for p in plots},
    }
