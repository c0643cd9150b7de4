"""Results on disk: `results.json` (everything), `results.md` (tables) and PNG plots.

`evaluate_targets` compares the measurements with the issue's targets; a target whose inputs were not
measured (a workload skipped, speculation not available) is reported as not measured, never as met.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.stats import ratio

NOISE_NOTE = (
    "Measured on a shared machine (other engineers' tests may run at the same time): figures are "
    "noisy. Each figure is the median over the repeats, with (min-max)."
)

PLOTS = {
    "throughput.png": "Tokens/s and time to first token, specwire vs transformers",
    "concurrency.png": "Aggregate tokens/s and latency versus concurrent clients",
    "draft_length.png": "Acceptance and speed versus draft length",
    "memory.png": "Peak resident memory per service",
}


def _get(data: Any, *path, default=None):
    for key in path:
        if not isinstance(data, dict) or key not in data or data[key] is None:
            return default
        data = data[key]
    return data


def _series_tps(workload: dict | None, label: str) -> dict | None:
    return _get(workload, "series", label, "tokens_per_second")


def _target(name: str, goal: str, measured: float | None, met: bool | None, detail: str) -> dict:
    return {"name": name, "goal": goal, "measured": measured, "met": met, "detail": detail}


def evaluate_targets(results: dict) -> list[dict]:
    w = results["workloads"]
    targets = []

    def ratio_target(name, goal_ratio, workload, ours, theirs, what):
        value = ratio(_series_tps(w.get(workload), ours), _series_tps(w.get(workload), theirs))
        why = _get(w.get(workload), "reason") or ("workload not run" if workload not in w else "not measured")
        targets.append(
            _target(
                name,
                f">= {goal_ratio:.1f}x",
                value,
                None if value is None else value >= goal_ratio,
                what if value is not None else why,
            )
        )

    ratio_target(
        "greedy tokens/s vs transformers",
        1.1,
        "greedy",
        "specwire",
        "transformers",
        "specwire (gRPC, unary) / transformers.generate(), medians",
    )
    ratio_target(
        "beam-4 tokens/s vs transformers",
        1.0,
        "beam",
        "specwire",
        "transformers",
        "specwire / transformers, medians",
    )
    ratio_target(
        "prompt lookup tokens/s vs transformers' prompt lookup",
        1.2,
        "prompt_lookup",
        "specwire_prompt_lookup",
        "transformers_prompt_lookup",
        "same code-edit prompt, medians",
    )

    levels = _get(w.get("concurrency"), "levels", default={})
    if levels:
        top = max(levels.values(), key=lambda level: level["clients"])
        one = levels.get("1")
        value = ratio(top["aggregate_tokens_per_second"], one["aggregate_tokens_per_second"] if one else None)
        targets.append(
            _target(
                f"{top['clients']} concurrent clients vs 1 client, aggregate tokens/s",
                ">= 3.0x",
                value,
                None if value is None or top["clients"] != 8 else value >= 3.0,
                "medians" if top["clients"] == 8 else f"only up to {top['clients']} clients ran",
            )
        )
    else:
        targets.append(
            _target(
                "8 concurrent clients vs 1 client, aggregate tokens/s",
                ">= 3.0x",
                None,
                None,
                _get(w.get("concurrency"), "reason", default="workload not run"),
            )
        )

    p50 = _get(w.get("roundtrip"), "direct", "prompt_lookup_10", "p50_ms", "median")
    targets.append(
        _target(
            "draft round trip p50 (loopback)",
            "<= 1.0 ms",
            p50,
            None if p50 is None else p50 <= 1.0,
            "direct Draft-stream measurement, prompt lookup 10 tokens per round"
            if p50 is not None
            else _get(w.get("roundtrip"), "reason", default="workload not run"),
        )
    )

    mem = w.get("memory")
    peak = _get(mem, "services", "target", "peak_rss_mb")
    budget = _get(mem, "target_budget_mb")
    device = _get(results, "meta", "device", default="cpu")
    if budget is None:
        detail = "workload not run"
    elif device != "cpu":
        detail = f"a CPU target, not evaluated: the weights are on {device} (device memory in section 9)"
    else:
        detail = f"budget {budget:.0f} MB (float32 weights {mem['model_float32_mb']:.0f} MB)"
    targets.append(
        _target(
            "target service peak resident memory",
            "<= 1.5 x float32 weights + 300 MB",
            peak,
            None if peak is None or budget is None or device != "cpu" else peak <= budget,
            detail,
        )
    )
    return targets


# ---------------------------------------------------------------------------------------------------------
# Markdown


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
            _get(s, "specwire", "tokens_per_second"),
            _get(s, "transformers", "tokens_per_second"),
        )
        row(
            "1. greedy, chat",
            "time to first token (ms; ratio = transformers / specwire)",
            _get(s, "specwire_stream", "ttft_seconds"),
            _get(s, "transformers_streamer", "ttft_seconds"),
            1000,
            0,
            higher_better=False,
        )
        row(
            "1. greedy, chat",
            "tokens/s while streaming",
            _get(s, "specwire_stream", "tokens_per_second"),
            _get(s, "transformers_streamer", "tokens_per_second"),
        )
    for key, name in (("sampling", "2. sampling top_p 0.9 T 0.7"), ("beam", "3. beam search, 4 beams")):
        if key in w and w[key].get("series"):
            s = w[key]["series"]
            row(
                name,
                "tokens/s",
                _get(s, "specwire", "tokens_per_second"),
                _get(s, "transformers", "tokens_per_second"),
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
        ours = _get(s, spec, "tokens_per_second")
        row(name, "tokens/s, speculative", ours, _get(s, ref, "tokens_per_second"))
        row(
            name,
            "tokens/s, plain greedy (same prompt)",
            _get(s, "specwire_greedy", "tokens_per_second"),
            _get(s, "transformers_greedy", "tokens_per_second"),
        )
        lines.append(
            f"| {name} | speed-up over own greedy | "
            f"{_ratio_cell(ours, _get(s, 'specwire_greedy', 'tokens_per_second'))} | "
            f"{_ratio_cell(_get(s, ref, 'tokens_per_second'), _get(s, 'transformers_greedy', 'tokens_per_second'))}"  # noqa: E501
            f" | |"
        )
        acceptance = _get(w[key], "speculation", spec, "acceptance_rate")
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
    one = _get(c, "levels", "1", "aggregate_tokens_per_second")
    for level in sorted(c["levels"].values(), key=lambda level: level["clients"]):
        lines.append(
            f"| {level['clients']} | {_fmt(level['aggregate_tokens_per_second'])} | "
            f"{_ratio_cell(level['aggregate_tokens_per_second'], one)} | "
            f"{_num(level['latency_p50_seconds'])} | {_num(level['latency_p99_seconds'])} |"
        )
    seq = c["transformers_sequential"]
    lines.append(
        f"| transformers, sequential | {_fmt(seq['tokens_per_second'])} | | {_num(_get(seq, 'seconds', 'median'))} | |"
    )
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
        cells = [_fmt(_get(p, key, "tokens_per_second")) for key, _ in present]
        cells += [_fmt(_get(p, key, "acceptance_rate"), 1, 2) for key, _ in present if key.startswith("specwire")]
        lines.append(f"| {p['draft_length']} | " + " | ".join(cells) + " |")
    for key, series in d.get("baselines", {}).items():
        lines.append(f"| greedy baseline: {key} | {_fmt(series['tokens_per_second'])} |" + " |" * (n_cols - 1))
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


# ---------------------------------------------------------------------------------------------------------
# plots


def _errorbar(summary: dict | None) -> tuple[float, list[float]]:
    if not summary:
        return 0.0, [0.0, 0.0]
    return summary["median"], [summary["median"] - summary["min"], summary["max"] - summary["median"]]


def plot(results: dict, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = results["workloads"]
    written = []
    subtitle = (
        f"{results['meta']['model']}, {results['meta']['max_new_tokens']} new tokens, "
        f"median of {results['meta']['repeats']} (bars: min-max)"
    )

    # Throughput and time to first token.
    groups = [
        ("greedy", "greedy", "specwire", "transformers"),
        ("sampling", "sampling", "specwire", "transformers"),
        ("beam", "beam-4", "specwire", "transformers"),
        ("prompt_lookup", "prompt lookup", "specwire_prompt_lookup", "transformers_prompt_lookup"),
        ("prompt_lookup", "greedy (code)", "specwire_greedy", "transformers_greedy"),
        ("draft_model", "draft model", "specwire_draft_model", "transformers_assisted"),
    ]
    groups = [g for g in groups if _get(w, g[0], "series")]
    if groups:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
        for offset, side, color in ((-0.2, 2, "tab:blue"), (0.2, 3, "tab:orange")):
            values = [_errorbar(_get(w, g[0], "series", g[side], "tokens_per_second")) for g in groups]
            axes[0].bar(
                [i + offset for i in range(len(groups))],
                [v[0] for v in values],
                0.4,
                yerr=list(zip(*[v[1] for v in values], strict=True)) if values else None,
                capsize=3,
                color=color,
                label="specwire (gRPC)" if side == 2 else "transformers (in-process)",
            )
        axes[0].set_xticks(range(len(groups)), [g[1] for g in groups])
        axes[0].set_ylabel("tokens/s")
        axes[0].legend()
        axes[0].set_title("Throughput")
        ttft = [
            _errorbar(_get(w, "greedy", "series", label, "ttft_seconds"))
            for label in ("specwire_stream", "transformers_streamer")
        ]
        axes[1].bar(
            [0, 1],
            [t[0] * 1000 for t in ttft],
            yerr=[[t[1][0] * 1000 for t in ttft], [t[1][1] * 1000 for t in ttft]],
            capsize=3,
            color=["tab:blue", "tab:orange"],
        )
        axes[1].set_xticks([0, 1], ["specwire", "transformers"])
        axes[1].set_ylabel("ms")
        axes[1].set_title("Time to first token (greedy)")
        fig.suptitle(subtitle, fontsize=9)
        fig.tight_layout()
        fig.savefig(folder / "throughput.png", dpi=100)
        plt.close(fig)
        written.append("throughput.png")

    if _get(w, "concurrency", "levels"):
        c = w["concurrency"]
        levels = sorted(c["levels"].values(), key=lambda level: level["clients"])
        x = [level["clients"] for level in levels]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        values = [_errorbar(level["aggregate_tokens_per_second"]) for level in levels]
        axes[0].errorbar(
            x,
            [v[0] for v in values],
            yerr=list(zip(*[v[1] for v in values], strict=True)),
            marker="o",
            capsize=3,
            label="specwire aggregate",
        )
        seq = _get(c, "transformers_sequential", "tokens_per_second", "median")
        if seq:
            axes[0].axhline(seq, color="tab:orange", linestyle="--", label="transformers sequential")
        one = levels[0]["aggregate_tokens_per_second"]["median"] if levels[0]["clients"] == 1 else None
        if one:
            axes[0].axhline(3 * one, color="grey", linestyle=":", label="target at 8 clients (3x one client)")
        axes[0].set_xscale("log", base=2)
        axes[0].set_xticks(x, [str(n) for n in x])
        axes[0].set_xlabel("concurrent clients")
        axes[0].set_ylabel("tokens/s")
        axes[0].legend(fontsize=8)
        axes[0].set_title("Aggregate throughput")
        axes[1].plot(x, [level["latency_p50_seconds"] for level in levels], marker="o", label="p50")
        axes[1].plot(x, [level["latency_p99_seconds"] for level in levels], marker="s", label="p99")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xticks(x, [str(n) for n in x])
        axes[1].set_xlabel("concurrent clients")
        axes[1].set_ylabel("request latency (s)")
        axes[1].legend()
        axes[1].set_title("Latency")
        fig.suptitle(subtitle, fontsize=9)
        fig.tight_layout()
        fig.savefig(folder / "concurrency.png", dpi=100)
        plt.close(fig)
        written.append("concurrency.png")

    if _get(w, "draft_length", "points"):
        d = w["draft_length"]
        ks = [p["draft_length"] for p in d["points"]]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        styles = {
            "specwire_prompt_lookup": ("specwire prompt lookup", "tab:blue", "-"),
            "transformers_prompt_lookup": ("transformers prompt lookup", "tab:orange", "-"),
            "specwire_draft_model": ("specwire draft model", "tab:blue", "--"),
            "transformers_assisted": ("transformers assisted", "tab:orange", "--"),
        }
        any_acceptance = False
        for key, (name, color, style) in styles.items():
            pts = [(p["draft_length"], p[key]) for p in d["points"] if key in p]
            if not pts:
                continue
            values = [_errorbar(e["tokens_per_second"]) for _, e in pts]
            axes[1].errorbar(
                [k for k, _ in pts],
                [v[0] for v in values],
                yerr=list(zip(*[v[1] for v in values], strict=True)),
                color=color,
                linestyle=style,
                marker="o",
                capsize=3,
                label=name,
            )
            acc = [(k, _get(e, "acceptance_rate", "median")) for k, e in pts]
            acc = [(k, a) for k, a in acc if a is not None]
            if acc:
                any_acceptance = True
                axes[0].plot(
                    [k for k, _ in acc],
                    [a for _, a in acc],
                    color=color,
                    linestyle=style,
                    marker="o",
                    label=name,
                )
        for key, series in d.get("baselines", {}).items():
            color = "tab:blue" if key.startswith("specwire") else "tab:orange"
            style = ":" if key.endswith("code") else "-."
            axes[1].axhline(
                series["tokens_per_second"]["median"],
                color=color,
                linestyle=style,
                alpha=0.6,
                label=key.replace("_", " "),
            )
        if not any_acceptance:
            axes[0].text(
                0.5,
                0.5,
                "speculation not available in the target yet:\nno acceptance measured",
                ha="center",
                va="center",
                transform=axes[0].transAxes,
            )
        else:
            axes[0].legend(fontsize=8)
        axes[0].set_xlabel("draft length (tokens per round)")
        axes[0].set_ylabel("acceptance rate")
        axes[0].set_ylim(0, 1.05)
        axes[0].set_title("Acceptance")
        axes[1].set_xlabel("draft length (tokens per round)")
        axes[1].set_ylabel("tokens/s")
        axes[1].legend(fontsize=7)
        axes[1].set_title("Speed")
        for ax in axes:
            ax.set_xticks(ks)
        fig.suptitle(subtitle + "; prompt lookup on the code prompt, draft model on the chat prompt", fontsize=9)
        fig.tight_layout()
        fig.savefig(folder / "draft_length.png", dpi=100)
        plt.close(fig)
        written.append("draft_length.png")

    if _get(w, "memory", "services"):
        mem = w["memory"]
        names = list(mem["services"])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(names, [mem["services"][n]["peak_rss_mb"] or 0 for n in names], color="tab:blue")
        ax.axhline(mem["target_budget_mb"], color="tab:red", linestyle="--", label="target-service budget")
        ax.set_ylabel("peak resident size (MB)")
        ax.legend()
        ax.set_title("Peak memory per service (VmHWM)")
        fig.tight_layout()
        fig.savefig(folder / "memory.png", dpi=100)
        plt.close(fig)
        written.append("memory.png")
    return written


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
