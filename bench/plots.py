"""The benchmark's PNG plots, drawn with matplotlib from the results (one figure per workload family)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.stats import lookup

PLOTS = {
    "throughput.png": "Tokens/s and time to first token, specwire vs transformers",
    "concurrency.png": "Aggregate tokens/s and latency versus concurrent clients",
    "draft_length.png": "Acceptance and speed versus draft length",
    "memory.png": "Peak resident memory per service",
    "speculation_matrix.png": "Speculation matrix: speed relative to plain greedy on the same services",
    "controller_draft_length.png": "Draft length the adaptive controller chose per round, per prompt",
}


def _errorbar(summary: dict | None) -> tuple[float, list[float]]:
    if not summary:
        return 0.0, [0.0, 0.0]
    return summary["median"], [summary["median"] - summary["min"], summary["max"] - summary["median"]]


def plot(results: dict, folder: Path) -> list[str]:
    """Draw every figure whose workload ran into `folder`; the file names written, in `PLOTS` order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = results["workloads"]
    subtitle = (
        f"{results['meta']['model']}, {results['meta']['max_new_tokens']} new tokens, "
        f"median of {results['meta']['repeats']} (bars: min-max)"
    )
    written = []
    for name, draw in _FIGURES.items():
        fig = draw(plt, w, subtitle)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


def _throughput_figure(plt: Any, w: dict, subtitle: str) -> Any:
    """Tokens/s per decoding mode and side, and greedy time to first token; None when nothing ran."""
    groups = [
        ("greedy", "greedy", "specwire", "transformers"),
        ("sampling", "sampling", "specwire", "transformers"),
        ("beam", "beam-4", "specwire", "transformers"),
        ("prompt_lookup", "prompt lookup", "specwire_prompt_lookup", "transformers_prompt_lookup"),
        ("prompt_lookup", "greedy (code)", "specwire_greedy", "transformers_greedy"),
        ("draft_model", "draft model", "specwire_draft_model", "transformers_assisted"),
    ]
    groups = [g for g in groups if lookup(w, g[0], "series")]
    if not groups:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    for offset, side, color in ((-0.2, 2, "tab:blue"), (0.2, 3, "tab:orange")):
        values = [_errorbar(lookup(w, g[0], "series", g[side], "tokens_per_second")) for g in groups]
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
        _errorbar(lookup(w, "greedy", "series", label, "ttft_seconds"))
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
    return fig


def _concurrency_figure(plt: Any, w: dict, subtitle: str) -> Any:
    """Aggregate tokens/s and p50/p99 latency versus concurrent clients; None when not run."""
    if not lookup(w, "concurrency", "levels"):
        return None
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
    seq = lookup(c, "transformers_sequential", "tokens_per_second", "median")
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
    return fig


def _draft_length_figure(plt: Any, w: dict, subtitle: str) -> Any:
    """Acceptance and tokens/s versus draft length, with the greedy baselines; None when not run."""
    if not lookup(w, "draft_length", "points"):
        return None
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
        acc = [(k, lookup(e, "acceptance_rate", "median")) for k, e in pts]
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
    return fig


def _memory_figure(plt: Any, w: dict, subtitle: str) -> Any:
    """Peak resident size per service against the target's budget; None when not run."""
    if not lookup(w, "memory", "services"):
        return None
    mem = w["memory"]
    names = list(mem["services"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, [mem["services"][n]["peak_rss_mb"] or 0 for n in names], color="tab:blue")
    ax.axhline(mem["target_budget_mb"], color="tab:red", linestyle="--", label="target-service budget")
    ax.set_ylabel("peak resident size (MB)")
    ax.legend()
    ax.set_title("Peak memory per service (VmHWM)")
    return fig


# One function per file of `PLOTS`, in the same order.
# (label, name, baseline label): the matrix rows, each relative to plain greedy on its own services.
_MATRIX_BARS = [
    ("prompt_lookup_on", "prompt lookup", "plain_greedy"),
    ("colocated_on", "co-located", "colocated_plain_greedy"),
    ("remote_overlapped_on", "remote overlapped", "pinned_plain_greedy"),
    ("remote_serial_on", "remote serial", "pinned_plain_greedy"),
    ("transformers_prompt_lookup", "transformers PL", "transformers_greedy"),
    ("transformers_assisted", "transformers assisted", "transformers_greedy"),
]


def _matrix_figure(plt: Any, w: dict, subtitle: str) -> Any:
    """Per prompt, each row's tokens/s over plain greedy on the same side, controller on and off."""
    prompts = lookup(w, "speculation_matrix", "prompts")
    if not prompts:
        return None
    fig, axes = plt.subplots(1, len(prompts), figsize=(5 * len(prompts), 4.5), sharey=True, squeeze=False)
    for ax, (key, p) in zip(axes[0], prompts.items(), strict=True):
        series = p["series"]

        def speed(label: str, baseline: str, series: dict = series) -> float:
            value = lookup(series, label, "tokens_per_second", "median")
            base = lookup(series, baseline, "tokens_per_second", "median")
            return value / base if value and base else 0.0

        ours = [i for i, bar in enumerate(_MATRIX_BARS) if bar[0].endswith("_on")]
        theirs = [i for i, bar in enumerate(_MATRIX_BARS) if not bar[0].endswith("_on")]
        for offset, suffix, color, name in (
            (-0.2, "_on", "tab:blue", "specwire, controller on"),
            (0.2, "_off", "tab:gray", "specwire, controller off (transformers' defaults named)"),
        ):
            heights = [speed(_MATRIX_BARS[i][0].replace("_on", suffix), _MATRIX_BARS[i][2]) for i in ours]
            ax.bar([i + offset for i in ours], heights, 0.4, color=color, label=name)
        heights = [speed(_MATRIX_BARS[i][0], _MATRIX_BARS[i][2]) for i in theirs]
        ax.bar(theirs, heights, 0.4, color="tab:orange", label="transformers (in-process)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(_MATRIX_BARS)), [b[1] for b in _MATRIX_BARS], rotation=30, ha="right")
        ax.set_title(f"{key} prompt")
    axes[0][0].set_ylabel("tokens/s / plain greedy (same side)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(subtitle, fontsize=9)
    return fig


def _controller_figure(plt: Any, w: dict, subtitle: str) -> Any:
    """Per prompt of the speculation matrix, the draft length the controller chose over one request."""
    from bench.controller_plot import TITLE, draw_draft_lengths

    prompts = lookup(w, "speculation_matrix", "prompts")
    if not prompts or not any(p.get("controller") for p in prompts.values()):
        return None
    fig, axes = plt.subplots(len(prompts), 1, figsize=(10, 3 * len(prompts)), squeeze=False)
    for ax, (key, p) in zip(axes[:, 0], prompts.items(), strict=True):
        rows = p.get("controller") or {}
        label = {name: name.removesuffix("_on").replace("_", " ") for name in rows}
        draw_draft_lengths(
            ax,
            {label[name]: row["draft_lengths"] or [] for name, row in rows.items()},
            {label[name]: row["tokens_without_draft"] for name, row in rows.items()},
        )
        ax.set_title(f"{key} prompt", fontsize=9)
    fig.suptitle(f"{TITLE}\n{subtitle}", fontsize=10)
    return fig


_FIGURES = {
    "throughput.png": _throughput_figure,
    "concurrency.png": _concurrency_figure,
    "draft_length.png": _draft_length_figure,
    "memory.png": _memory_figure,
    "speculation_matrix.png": _matrix_figure,
    "controller_draft_length.png": _controller_figure,
}
