"""What every benchmark workload shares: the `Context` (sides, stack, settings, cached prompts and greedy
baselines) and the helpers that alternate runs, summarize them, check speculative output against plain
greedy and shape a workload's result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.progress import log
from bench.prompts import PROMPTS
from bench.reference import Reference, Run
from bench.services import ServiceStack
from bench.stats import summarize
from bench.target import Specwire, speculation_unavailable

SEED = 1234
PROMPT_LOOKUP_TOKENS = 10


class SpeculationUnavailable(Exception):
    """The target ran plain decoding although speculation was asked for."""


@dataclass
class Context:
    """Everything the workloads share."""

    reference: Reference
    specwire: Specwire
    stack: ServiceStack
    repeats: int
    max_new_tokens: int
    quick: bool
    draft_name: str
    concurrency_levels: list[int]
    draft_lengths: list[int]
    roundtrip_rounds: int
    sweep_draft_model: bool = True  # the draft-length sweep also runs the draft model (not in quick mode)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    greedy: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (side, prompt) -> sequence
    greedy_runs: dict[tuple[str, str], list[Run]] = field(default_factory=dict)  # timed plain greedy runs
    speculation_rounds: list[dict] = field(default_factory=list)  # per speculative request: draft s / round

    def prompt(self, key: str) -> list[int]:
        if key not in self.prompts:
            ids = self.reference.encode(PROMPTS[key])
            # A small test model's context may not hold the prompt and the new tokens (the target refuses
            # what exceeds --max-model-len): keep the prompt's end. SmolLM2 (8192 positions) keeps it whole.
            context = self.reference.loaded.max_position_embeddings
            if context:
                ids = ids[-max(context - self.max_new_tokens - 1, 1) :]
            self.prompts[key] = ids
        return self.prompts[key]

    def plain_greedy(self, side: str, key: str) -> Run:
        """One timed plain greedy run on one side (kept for the greedy baselines of later workloads)."""
        args = {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        if side == "specwire":
            run, _ = self.specwire.generate(self.prompt(key), **args)
        else:
            run = self.reference.generate(self.prompt(key), **args)
        self.greedy_runs.setdefault((side, key), []).append(run)
        self.greedy.setdefault((side, key), run.sequence)
        return run

    def greedy_sequence(self, side: str, key: str) -> list[int]:
        """Plain greedy output on one side for a prompt (run once, then cached)."""
        if (side, key) not in self.greedy:
            self.plain_greedy(side, key)
        return self.greedy[(side, key)]


def alternate(
    ctx: Context, runners: dict[str, Callable[[], Run]], what: str, repeats: int | None = None
) -> tuple[dict[str, list[Run]], dict[str, str]]:
    """Run every runner once per repeat, alternating; a runner raising `SpeculationUnavailable` is dropped."""
    runs: dict[str, list[Run]] = {label: [] for label in runners}
    unavailable: dict[str, str] = {}
    labels = list(runners)
    for repeat in range(repeats or ctx.repeats):
        order = labels if repeat % 2 == 0 else labels[::-1]
        for label in order:
            if label in unavailable:
                continue
            try:
                run = runners[label]()
            except SpeculationUnavailable as why:
                unavailable[label] = str(why)
                log(f"  {what} {label}: speculation not available: {why}")
                continue
            runs[label].append(run)
            extra = f", ttft {run.ttft * 1000:.0f} ms" if run.ttft is not None else ""
            log(
                f"  {what} [{repeat + 1}/{repeats or ctx.repeats}] {label}: {run.new_tokens} tokens in "
                f"{run.seconds:.2f}s = {run.tokens_per_second:.1f} tok/s{extra}"
            )
    return runs, unavailable


def run_series(runs: list[Run]) -> dict:
    return {
        "tokens_per_second": summarize([r.tokens_per_second for r in runs]),
        "seconds": summarize([r.seconds for r in runs]),
        "new_tokens": summarize([r.new_tokens for r in runs]),
        "ttft_seconds": summarize([r.ttft for r in runs]) if any(r.ttft is not None for r in runs) else None,
    }


def check_entry(name: str, passed: bool | None, detail: str = "") -> dict:
    return {"name": name, "passed": passed, "detail": detail}


def same_tokens(a: list[int], b: list[int]) -> tuple[bool, str]:
    if a == b:
        return True, f"{len(a)} tokens identical"
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return False, f"first difference at position {first} (lengths {len(a)} and {len(b)})"


class SpeculativeRuns:
    """Runs a speculative request on the target, records its stats and checks it against plain greedy."""

    def __init__(self, ctx: Context, prompt_key: str, label: str, **kwargs):
        self.ctx, self.prompt_key, self.label, self.kwargs = ctx, prompt_key, label, kwargs
        self.stats: list[dict] = []
        self.matches: list[bool] = []
        self.detail = ""

    def __call__(self) -> Run:
        run, output = self.ctx.specwire.generate(self.ctx.prompt(self.prompt_key), **self.kwargs)
        reason = speculation_unavailable(output)
        if reason:
            raise SpeculationUnavailable(reason)
        stats = dict(output.speculation.__dict__)
        self.stats.append(stats)
        if stats["rounds"]:
            self.ctx.speculation_rounds.append(
                {
                    "label": self.label,
                    "draft_seconds_per_round": stats["draft_seconds"] / stats["rounds"],
                    "verify_seconds_per_round": stats["verify_seconds"] / stats["rounds"],
                }
            )
        same, self.detail = same_tokens(run.sequence, self.ctx.greedy_sequence("specwire", self.prompt_key))
        self.matches.append(same)
        return run

    def summary(self) -> dict | None:
        if not self.stats:
            return None
        return {
            "proposer": self.stats[-1]["proposer"],
            "acceptance_rate": summarize([s["acceptance_rate"] for s in self.stats]),
            "rounds": summarize([s["rounds"] for s in self.stats]),
            "drafted_tokens": summarize([s["drafted_tokens"] for s in self.stats]),
            "accepted_tokens": summarize([s["accepted_tokens"] for s in self.stats]),
            "accepted_by_position": self.stats[-1]["accepted_by_position"],
            "draft_seconds": summarize([s["draft_seconds"] for s in self.stats]),
            "verify_seconds": summarize([s["verify_seconds"] for s in self.stats]),
        }

    def check(self) -> dict:
        if not self.matches:
            return check_entry(
                f"{self.label} equals specwire plain greedy", None, "not run (speculation not available)"
            )
        return check_entry(
            f"{self.label} equals specwire plain greedy",
            all(self.matches),
            f"{sum(self.matches)}/{len(self.matches)} runs; last: {self.detail}",
        )


class ReferenceSpeculativeRuns:
    """transformers' prompt lookup / assisted generation, checked against transformers' plain greedy."""

    def __init__(self, ctx: Context, prompt_key: str, label: str, assistant: Any = None, **kwargs):
        self.ctx, self.prompt_key, self.label, self.assistant, self.kwargs = (
            ctx,
            prompt_key,
            label,
            assistant,
            kwargs,
        )
        self.matches: list[bool] = []
        self.detail = ""

    def __call__(self) -> Run:
        run = self.ctx.reference.generate(self.ctx.prompt(self.prompt_key), assistant=self.assistant, **self.kwargs)
        same, self.detail = same_tokens(run.sequence, self.ctx.greedy_sequence("transformers", self.prompt_key))
        self.matches.append(same)
        return run

    def check(self) -> dict:
        return check_entry(
            f"{self.label} equals transformers plain greedy",
            all(self.matches) if self.matches else None,
            f"{sum(self.matches)}/{len(self.matches)} runs; last: {self.detail}",
        )


def workload_result(
    title: str,
    config: dict,
    prompt_tokens: int,
    runs: dict[str, list[Run]],
    unavailable: dict[str, str],
    checks: list[dict],
    **extra,
) -> dict:
    status = "ok"
    if unavailable:
        status = "partial" if any(runs.values()) else "unavailable"
    return {
        "title": title,
        "status": status,
        "reason": "; ".join(f"{label}: speculation not available: {why}" for label, why in unavailable.items()) or None,
        "config": config,
        "prompt_tokens": prompt_tokens,
        "series": {label: run_series(r) for label, r in runs.items() if r},
        "unavailable": unavailable,
        "checks": checks,
        **extra,
    }
