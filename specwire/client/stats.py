"""`specwire stats`: speculative acceptance per proposer and config, read from Prometheus endpoints.

    specwire stats --prometheus http://127.0.0.1:9464/metrics [--prometheus URL ...] [--png FILE] [--json]

Reads the target services' `specwire_spec_decode_*_total` counters (summed over the endpoints given and
over models, unless `--model` picks one) and prints, per proposer and config:

    acceptance rate          = accepted tokens / draft tokens
    mean acceptance length   = 1 + accepted tokens / drafts
    acceptance at position i = accepted tokens at position i / drafts

`--png FILE` draws the acceptance by draft position (needs matplotlib: `pip install 'specwire[bench]'`).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from specwire.vocabulary import (
    LABEL_CONFIG,
    LABEL_MODEL,
    LABEL_POSITION,
    LABEL_PROPOSER,
    METRIC_ACCEPTED_PER_POSITION,
    METRIC_ACCEPTED_TOKENS,
    METRIC_DRAFT_TOKENS,
    METRIC_DRAFTS,
)


@dataclass
class Acceptance:
    """Counter totals of one (proposer, config) group."""

    proposer: str
    config: str
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_by_position: dict[int, float] = field(default_factory=dict)  # 0-based position -> accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None

    def position_rates(self) -> list[float]:
        """Acceptance at positions 1, 2, ... (accepted there / drafts)."""
        if not self.drafts or not self.accepted_by_position:
            return []
        last = max(self.accepted_by_position)
        return [self.accepted_by_position.get(p, 0.0) / self.drafts for p in range(last + 1)]

    def to_dict(self) -> dict:
        return {
            "proposer": self.proposer,
            "config": self.config,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_by_position": self.position_rates(),
        }


def metrics_url(url: str) -> str:
    """`host:port` or `http://host:port` -> `http://host:port/metrics`; a URL with a path is kept."""
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    return url if parts.path not in ("", "/") else f"{parts.scheme}://{parts.netloc}/metrics"


def fetch(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(metrics_url(url), timeout=timeout) as response:  # noqa: S310 - user-given URL
        return response.read().decode("utf-8")


def acceptance(texts: list[str], model: str | None = None) -> list[Acceptance]:
    """Group the speculative-decoding counters of Prometheus exposition texts by (proposer, config)."""
    from prometheus_client.parser import text_string_to_metric_families

    groups: dict[tuple[str, str], Acceptance] = {}
    fields = {METRIC_DRAFTS: "drafts", METRIC_DRAFT_TOKENS: "draft_tokens", METRIC_ACCEPTED_TOKENS: "accepted_tokens"}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in fields and sample.name != METRIC_ACCEPTED_PER_POSITION:
                    continue
                labels = sample.labels
                if model is not None and labels.get(LABEL_MODEL) != model:
                    continue
                key = (labels.get(LABEL_PROPOSER, ""), labels.get(LABEL_CONFIG, ""))
                group = groups.setdefault(key, Acceptance(*key))
                if sample.name == METRIC_ACCEPTED_PER_POSITION:
                    position = int(labels.get(LABEL_POSITION, "0"))
                    group.accepted_by_position[position] = group.accepted_by_position.get(position, 0.0) + sample.value
                else:
                    setattr(group, fields[sample.name], getattr(group, fields[sample.name]) + sample.value)
    return [groups[key] for key in sorted(groups)]


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(groups: list[Acceptance]) -> str:
    header = [
        "proposer",
        "config",
        "drafts",
        "draft_tokens",
        "accepted",
        "acceptance_rate",
        "mean_acceptance_length",
    ]
    rows = [
        [
            g.proposer,
            g.config,
            f"{g.drafts:.0f}",
            f"{g.draft_tokens:.0f}",
            f"{g.accepted_tokens:.0f}",
            _num(g.acceptance_rate),
            _num(g.mean_acceptance_length),
        ]
        for g in groups
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    for g in groups:
        rates = g.position_rates()
        if rates:
            shown = " ".join(f"{p + 1}:{r:.2f}" for p, r in enumerate(rates))
            lines.append(f"acceptance by position [{g.proposer} / {g.config}]: {shown}")
    return "\n".join(lines)


def plot(groups: list[Acceptance], path: str | Path) -> Path:
    """A PNG of acceptance by draft position, one line per (proposer, config)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            "specwire stats --png needs matplotlib: from the checkout, `.venv/bin/pip install -e '.[bench]'` "
            "(or `bash scripts/install.sh --dev`)"
        ) from exc
    figure, axes = plt.subplots(figsize=(7, 4))
    for g in groups:
        rates = g.position_rates()
        if rates:
            axes.plot(
                range(1, len(rates) + 1),
                rates,
                marker="o",
                label=f"{g.proposer} / {g.config} (mean length {_num(g.mean_acceptance_length, 2)})",
            )
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_xlabel("draft position")
    axes.set_ylabel("accepted / drafts")
    axes.set_ylim(0, 1.05)
    axes.set_title("Speculative acceptance by draft position")
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(fontsize=8)
    else:
        axes.text(0.5, 0.5, "no speculative drafts recorded", ha="center", va="center", transform=axes.transAxes)
    path = Path(path)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def add_parser(sub) -> None:
    """Register `specwire stats` on the CLI's subparsers."""
    p = sub.add_parser("stats", help="speculative acceptance per proposer and config from Prometheus endpoints")
    p.add_argument(
        "--prometheus",
        action="append",
        required=True,
        metavar="URL",
        help="a target's scrape endpoint, e.g. http://127.0.0.1:9464/metrics (repeat to sum several)",
    )
    p.add_argument("--model", default=None, help="only this model label (default: all models)")
    p.add_argument("--png", default=None, metavar="FILE", help="also draw acceptance by draft position")
    p.add_argument("--json", dest="as_json", action="store_true", help="print the groups as JSON")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per scrape")


def stats_command(args) -> int:
    texts = []
    for url in args.prometheus:
        try:
            texts.append(fetch(url, args.timeout))
        except OSError as exc:
            print(f"error: cannot scrape {metrics_url(url)}: {exc}", file=sys.stderr)
            return 2
    groups = acceptance(texts, args.model)
    if args.as_json:
        print(json.dumps([g.to_dict() for g in groups], indent=2))
    elif groups:
        print(table(groups))
    else:
        print("no speculative decoding recorded yet (no specwire_spec_decode_* counters)")
    if args.png:
        print(f"wrote {plot(groups, args.png)}", file=sys.stderr)
    return 0
