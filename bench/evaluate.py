"""The issue's targets, compared with the measurements (`results["targets"]`).

A target whose inputs were not measured (a workload skipped, speculation not available) is reported as
not measured, never as met.
"""

from __future__ import annotations

from bench.speculation_matrix import RATIOS, WAVE_PAIRS, on_prompt
from bench.stats import lookup, ratio


def _series_tps(workload: dict | None, label: str) -> dict | None:
    return lookup(workload, "series", label, "tokens_per_second")


def _target(name: str, goal: str, measured: float | None, met: bool | None, detail: str) -> dict:
    return {"name": name, "goal": goal, "measured": measured, "met": met, "detail": detail}


def evaluate_targets(results: dict) -> list[dict]:
    w = results["workloads"]
    targets = []

    def ratio_target(name, goal_ratio, workload, ours, theirs, what):
        value = ratio(_series_tps(w.get(workload), ours), _series_tps(w.get(workload), theirs))
        why = lookup(w.get(workload), "reason") or ("workload not run" if workload not in w else "not measured")
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

    levels = lookup(w.get("concurrency"), "levels", default={})
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
                lookup(w.get("concurrency"), "reason", default="workload not run"),
            )
        )

    p50 = lookup(w.get("roundtrip"), "direct", "prompt_lookup_10", "p50_ms", "median")
    targets.append(
        _target(
            "draft round trip p50 (loopback)",
            "<= 1.0 ms",
            p50,
            None if p50 is None else p50 <= 1.0,
            "direct Draft-stream measurement, prompt lookup 10 tokens per round"
            if p50 is not None
            else lookup(w.get("roundtrip"), "reason", default="workload not run"),
        )
    )

    st = w.get("structured")
    overhead = lookup(st, "mask_overhead")
    targets.append(
        _target(
            "structured output: mask cost per token vs a free decode step",
            "<= 0.1x",
            overhead,
            None if overhead is None else overhead <= 0.1,
            "the target's mask processor replayed on the JSON outputs / (1 / free tokens/s)"
            if overhead is not None
            else lookup(st, "reason", default="workload not run"),
        )
    )
    ratio_target(
        "structured output: constrained + prompt lookup vs constrained, tokens/s",
        1.0,
        "structured",
        "constrained_copy_prompt_lookup",
        "constrained_copy",
        "schema-copying prompt, medians (goal: faster)",
    )

    targets += matrix_targets(w.get("speculation_matrix"))

    mem = w.get("memory")
    peak = lookup(mem, "services", "target", "peak_rss_mb")
    budget = lookup(mem, "target_budget_mb")
    device = lookup(results, "meta", "device", default="cpu")
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


def matrix_targets(matrix: dict | None) -> list[dict]:
    """Issue #23's targets, from the speculation matrix (`bench.speculation_matrix`)."""
    why = lookup(matrix, "reason") or ("workload not run" if matrix is None else "not measured")
    prompts = lookup(matrix, "prompts", default={}) or {}
    targets = []

    def at_least(name: str, goal: float, value: float | None, detail: str) -> None:
        met = None if value is None else value >= goal
        targets.append(_target(name, f">= {goal:.2f}x", value, met, detail if value is not None else why))

    # With the controller, no speculative row is more than 5% slower than plain greedy on the same services.
    slowest, where, drafted = None, "", None
    for key, p in prompts.items():
        for name, value in p["ratios"].items():
            if (
                "controller on / " in name
                and "greedy" in name
                and value is not None
                and (slowest is None or value < slowest)
            ):
                slowest, where, drafted = value, f"{name}, {key} prompt", _row_drafted(p, name)
    for name, value in (lookup(matrix, "concurrency", "ratios", default={}) or {}).items():
        if value is not None and (slowest is None or value < slowest):
            clients = lookup(matrix, "concurrency", "clients")
            slowest, where, drafted = value, f"{name}, {clients} clients", _waves_drafted(matrix, name)
    detail = f"the slowest: {where}"
    if drafted is False:
        detail += " (none of its requests drafted a block)"
    at_least("controller: slowest speculative row vs plain greedy", 0.95, slowest, detail + _identical_work(matrix))
    for key in ("chat", "code", "low"):
        at_least(
            f"co-located draft vs transformers assisted ({key})",
            1.0,
            lookup(prompts, key, "ratios", "co-located, controller on / transformers assisted"),
            "same draft, medians",
        )
        at_least(
            f"remote overlapped vs remote serial, same pinning ({key})",
            1.15,
            lookup(prompts, key, "ratios", "remote overlapped / remote serial, controller on (pinned)"),
            lookup(matrix, "pinning", default=""),
        )
    at_least(
        "prompt lookup vs transformers' prompt lookup (code edit, matrix)",
        1.3,
        lookup(prompts, "code", "ratios", "prompt lookup, controller on / transformers prompt lookup"),
        "medians",
    )
    checks = lookup(matrix, "checks", default=[]) or []
    ran = [c for c in checks if c["passed"] is not None]
    equal = all(c["passed"] for c in ran) if ran else None
    targets.append(
        _target(
            "every speculative output equals plain greedy (matrix)",
            "all",
            None,
            equal,
            f"{sum(1 for c in ran if c['passed'])}/{len(ran)} rows equal token for token" if ran else why,
        )
    )
    return targets


def _row_drafted(prompt: dict, name: str) -> bool | None:
    """Whether any request of a single-client ratio's speculative row drafted a block (None: not recorded)."""
    label = next((label for ratio_name, label, _ in RATIOS if ratio_name == name), None)
    rounds = lookup(prompt, "speculation", label, "rounds", "values") if label else None
    return None if rounds is None else any(rounds)


def _waves_drafted(matrix: dict | None, name: str) -> bool | None:
    """Whether any request of a concurrent case (its ratio `name`, `on_prompt` named) drafted a block or probed
    (None: not recorded)."""
    prompts = lookup(matrix, "concurrency", "prompts", default=[]) or []
    case = next(
        (
            on_prompt(label, key)
            for label, pair in WAVE_PAIRS.items()
            for key in prompts
            if on_prompt(pair.ratio, key) == name
        ),
        None,
    )
    chosen = lookup(matrix, "concurrency", "controller", case) if case else None
    return None if chosen is None else bool(chosen["rounds_with_drafts"] or chosen["probes"])


def _identical_work(matrix: dict | None) -> str:
    """What identical work read on two targets in the run: plain greedy on the co-located draft's target over plain
    greedy on the main one (single client, and the concurrent waves), the yardstick of a ratio of plain decoding to
    plain decoding (the controller not drafting)."""
    single = [
        ratio(
            lookup(p, "series", "colocated_plain_greedy", "tokens_per_second"),
            lookup(p, "series", "plain_greedy", "tokens_per_second"),
        )
        for p in (lookup(matrix, "prompts", default={}) or {}).values()
    ]
    waves = lookup(matrix, "concurrency", "aggregate_tokens_per_second", default={}) or {}
    loaded = [
        ratio(waves.get(on_prompt("colocated_plain_greedy", key)), waves.get(on_prompt("plain_greedy", key)))
        for key in lookup(matrix, "concurrency", "prompts", default=[]) or []
    ]
    clients = lookup(matrix, "concurrency", "clients")
    measured = (("single client", [v for v in single if v]), (f"with {clients} clients", [v for v in loaded if v]))
    spans = [f"{min(values):.2f}x-{max(values):.2f}x {what}" for what, values in measured if values]
    if not spans:
        return ""
    return f"; identical work on two targets (plain greedy, co-located target over main) read {' and '.join(spans)}"
