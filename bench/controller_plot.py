"""A plot of the draft length the adaptive speculation controller chose over one request, round by round.

The input is a response's `speculation` statistics: `draft_lengths`, the length asked each round
run-length encoded as `(length, rounds)` (the client's `SpeculationStats`, or the same pairs read back
from a results JSON). Rounds without a draft (the controller's time off) sit on 0, probes show as the
short spikes after them. Several requests (e.g. one per prompt) go on one figure, one line each.

    from bench.controller_plot import plot_draft_lengths
    plot_draft_lengths({"chat": output.speculation.draft_lengths}, Path("controller.png"), "SmolLM2, draft model")

Drawn with matplotlib like `bench.plots` (Agg backend; PNG or SVG after the file's suffix). The
speculation matrix's run draws one panel per prompt with `draw_draft_lengths`
(`controller_draft_length.png`, `bench.plots`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["draw_draft_lengths", "expand_runs", "plot_draft_lengths"]

FILE_NAME = "controller_draft_length.png"
TITLE = "Draft length the controller chose per round"


def expand_runs(runs: Iterable[Sequence[int]]) -> list[int]:
    """`[(length, rounds), ...]` -> the length of every round, in order.

    Args:
        runs (`Iterable[Sequence[int]]`): run-length encoded draft lengths (tuples or 2-item lists,
            as JSON gives them back).
    """
    lengths: list[int] = []
    for run in runs:
        length, rounds = int(run[0]), int(run[1])
        if length < 0 or rounds < 0:
            raise ValueError(f"a run is (length >= 0, rounds >= 0), got {tuple(run)!r}")
        lengths += [length] * rounds
    return lengths


def draw_draft_lengths(
    ax: Any, requests: Mapping[str, Iterable[Sequence[int]]], tokens_without_draft: Any = None
) -> None:
    """Draw each request's draft length per round as a step line on the matplotlib axes `ax`.

    Args:
        ax: the axes to draw on.
        requests (`Mapping[str, Iterable[Sequence[int]]]`): label -> that request's `draft_lengths` runs.
        tokens_without_draft (`Mapping[str, int]`, *optional*): label -> tokens decoded during time
            off, added to the legend.
    """
    drawn = 0
    for label, runs in requests.items():
        lengths = expand_runs(runs)
        if not lengths:
            continue
        name = label
        if tokens_without_draft and label in tokens_without_draft:
            name += f" ({tokens_without_draft[label]} tokens without drafting)"
        # Round i's length holds until round i + 1: a post-style step line.
        ax.step(range(1, len(lengths) + 1), lengths, where="post", label=name, linewidth=1.5)
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no speculative rounds", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8)
    ax.set_xlabel("round")
    ax.set_ylabel("draft length (tokens)")
    ax.set_ylim(bottom=-0.5)
    ax.grid(alpha=0.3)


def plot_draft_lengths(
    requests: Mapping[str, Iterable[Sequence[int]]], path: Path, subtitle: str = "", tokens_without_draft: Any = None
) -> Path:
    """Draw each request's draft length per round as a step line and save it to `path`.

    Args:
        requests (`Mapping[str, Iterable[Sequence[int]]]`): label -> that request's `draft_lengths` runs.
        path (`Path`): the file to write (`.png` or `.svg`).
        subtitle (`str`, *optional*): the model, prompt, proposer..., under the title.
        tokens_without_draft (`Mapping[str, int]`, *optional*): label -> tokens decoded during time
            off, added to the legend.

    Returns:
        `Path`: `path`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.5))
    draw_draft_lengths(ax, requests, tokens_without_draft)
    ax.set_title(TITLE + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
