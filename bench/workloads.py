"""The benchmark workloads. Each takes a `Context` and returns a JSON-ready dict.

Within every repeat the specwire and transformers runs alternate (and the order flips on odd repeats,
so slow drift of a shared machine hits both sides alike). Every figure is summarized over the repeats
as median, min and max (`bench.stats.summarize`). Every speculative run is checked token for token
against plain greedy decoding on the same side, and the check is recorded.

Workloads that need the target's speculative loop report "speculation not available: <reason>"
for the specwire side while the target answers with `speculation.fallback_reason` (or proposer none),
and still measure the transformers side.

This module holds the per-request workloads (plain decoding modes, speculation, the draft-length sweep)
and the registry; `bench.service_workloads` the ones that measure the services (concurrency, draft round
trip, memory); `bench.workload_context` the `Context` and the helpers they share.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

from bench.progress import log
from bench.service_workloads import concurrency, memory, roundtrip
from bench.speculation_matrix import speculation_matrix
from bench.structured_workload import structured
from bench.workload_context import (
    PROMPT_LOOKUP_TOKENS,
    SEED,
    Context,
    ReferenceSpeculativeRuns,
    SpeculativeRuns,
    alternate,
    check_entry,
    run_series,
    same_tokens,
    workload_result,
)

# ---------------------------------------------------------------------------------------------------------
# 1-3: plain decoding modes


def greedy(ctx: Context) -> dict:
    """1. Greedy on the chat prompt: tokens/s (unary) and time to first token (streaming)."""
    prompt = ctx.prompt("chat")
    args = {"do_sample": False, "max_new_tokens": ctx.max_new_tokens}
    runs, unavailable = alternate(
        ctx,
        {
            "specwire": lambda: ctx.plain_greedy("specwire", "chat"),
            "transformers": lambda: ctx.plain_greedy("transformers", "chat"),
            "specwire_stream": lambda: ctx.specwire.stream(prompt, **args)[0],
            "transformers_streamer": lambda: ctx.reference.generate(prompt, ttft=True, **args),
        },
        "greedy",
    )
    same, detail = same_tokens(runs["specwire"][0].sequence, runs["transformers"][0].sequence)
    return workload_result(
        "Greedy, chat prompt",
        args,
        len(prompt),
        runs,
        unavailable,
        [check_entry("specwire greedy equals transformers greedy", same, detail)],
    )


def sampling(ctx: Context) -> dict:
    """2. Multinomial sampling, top_p 0.9, temperature 0.7, seeded."""
    prompt = ctx.prompt("chat")
    args = {"do_sample": True, "top_p": 0.9, "temperature": 0.7, "max_new_tokens": ctx.max_new_tokens}
    runs, unavailable = alternate(
        ctx,
        {
            "specwire": lambda: ctx.specwire.generate(prompt, seed=SEED, **args)[0],
            "transformers": lambda: ctx.reference.generate(prompt, seed=SEED, **args),
        },
        "sampling",
    )
    same, detail = same_tokens(runs["specwire"][0].sequence, runs["transformers"][0].sequence)
    return workload_result(
        "Sampling (top_p 0.9, temperature 0.7, seed 1234)",
        {**args, "seed": SEED},
        len(prompt),
        runs,
        unavailable,
        [check_entry("specwire seeded sample equals transformers after torch.manual_seed", same, detail)],
    )


def beam(ctx: Context) -> dict:
    """3. Beam search with 4 beams."""
    prompt = ctx.prompt("chat")
    args = {"do_sample": False, "num_beams": 4, "max_new_tokens": ctx.max_new_tokens}
    runs, unavailable = alternate(
        ctx,
        {
            "specwire": lambda: ctx.specwire.generate(prompt, **args)[0],
            "transformers": lambda: ctx.reference.generate(prompt, **args),
        },
        "beam-4",
    )
    same, detail = same_tokens(runs["specwire"][0].sequence, runs["transformers"][0].sequence)
    return workload_result(
        "Beam search, 4 beams",
        args,
        len(prompt),
        runs,
        unavailable,
        [check_entry("specwire beam-4 equals transformers beam-4", same, detail)],
    )


# ---------------------------------------------------------------------------------------------------------
# 4-5: speculation


def prompt_lookup(ctx: Context) -> dict:
    """4. Prompt lookup on the code-edit prompt vs transformers' prompt lookup and vs plain greedy."""
    prompt = ctx.prompt("code")
    greedy_args = {"do_sample": False, "max_new_tokens": ctx.max_new_tokens}
    lookup_args = {**greedy_args, "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    ctx.greedy_sequence("specwire", "code")
    ctx.greedy_sequence("transformers", "code")
    ours = SpeculativeRuns(ctx, "code", "specwire prompt lookup", **lookup_args)
    theirs = ReferenceSpeculativeRuns(ctx, "code", "transformers prompt lookup", **lookup_args)
    runs, unavailable = alternate(
        ctx,
        {
            "specwire_prompt_lookup": ours,
            "transformers_prompt_lookup": theirs,
            "specwire_greedy": lambda: ctx.plain_greedy("specwire", "code"),
            "transformers_greedy": lambda: ctx.plain_greedy("transformers", "code"),
        },
        "prompt-lookup",
    )
    return workload_result(
        "Prompt lookup, code-edit prompt",
        lookup_args,
        len(prompt),
        runs,
        unavailable,
        [ours.check(), theirs.check()],
        speculation={"specwire_prompt_lookup": ours.summary()},
    )


def draft_model(ctx: Context) -> dict:
    """5. Draft-model speculation with the int8 draft vs transformers' assisted generation, same draft."""
    prompt = ctx.prompt("chat")
    args = {"do_sample": False, "max_new_tokens": ctx.max_new_tokens}
    assistant = ctx.reference.draft(ctx.draft_name)
    ctx.greedy_sequence("specwire", "chat")
    ctx.greedy_sequence("transformers", "chat")
    ours = SpeculativeRuns(ctx, "chat", "specwire draft model", proposer="draft_model", **args)
    theirs = ReferenceSpeculativeRuns(ctx, "chat", "transformers assisted generation", assistant=assistant, **args)
    runs, unavailable = alternate(
        ctx,
        {
            "specwire_draft_model": ours,
            "transformers_assisted": theirs,
            "specwire_greedy": lambda: ctx.plain_greedy("specwire", "chat"),
            "transformers_greedy": lambda: ctx.plain_greedy("transformers", "chat"),
        },
        "draft-model",
    )
    notes = [f"transformers' draft: {ctx.reference.draft_note}"]
    if ctx.stack.draft_model_error:
        notes.append(f"the draft service could not load {ctx.draft_name!r}: {ctx.stack.draft_model_error}")
    return workload_result(
        f"Draft-model speculation ({ctx.draft_name})",
        args,
        len(prompt),
        runs,
        unavailable,
        [ours.check(), theirs.check()],
        speculation={"specwire_draft_model": ours.summary()},
        notes=notes,
    )


# ---------------------------------------------------------------------------------------------------------
# 8: draft length sweep


def draft_length(ctx: Context) -> dict:
    """8. Acceptance and speed versus draft length: prompt lookup (code prompt), draft model (chat prompt)."""
    ctx.greedy_sequence("specwire", "code")
    ctx.greedy_sequence("transformers", "code")
    base = {"do_sample": False, "max_new_tokens": ctx.max_new_tokens}
    with_model = ctx.sweep_draft_model
    assistant = ctx.reference.draft(ctx.draft_name) if with_model else None
    if with_model:
        ctx.greedy_sequence("specwire", "chat")
        ctx.greedy_sequence("transformers", "chat")
    points = []
    checks = []
    unavailable_all: dict[str, str] = {}
    for k in ctx.draft_lengths:
        runners: dict[str, Any] = {}
        spec: dict[str, SpeculativeRuns] = {}
        ref: dict[str, ReferenceSpeculativeRuns] = {}
        if "specwire_prompt_lookup" not in unavailable_all:
            spec["specwire_prompt_lookup"] = SpeculativeRuns(
                ctx, "code", f"specwire prompt lookup k={k}", prompt_lookup_num_tokens=k, **base
            )
        ref["transformers_prompt_lookup"] = ReferenceSpeculativeRuns(
            ctx, "code", f"transformers prompt lookup k={k}", prompt_lookup_num_tokens=k, **base
        )
        if with_model:
            fixed = {
                "num_assistant_tokens": k,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
            if "specwire_draft_model" not in unavailable_all:
                spec["specwire_draft_model"] = SpeculativeRuns(
                    ctx, "chat", f"specwire draft model k={k}", proposer="draft_model", **fixed, **base
                )
            ref["transformers_assisted"] = ReferenceSpeculativeRuns(
                ctx, "chat", f"transformers assisted k={k}", assistant=assistant, **fixed, **base
            )
        runners.update(spec)
        runners.update(ref)
        runs, unavailable = alternate(ctx, runners, f"draft-length k={k}")
        unavailable_all.update(unavailable)
        point: dict[str, Any] = {"draft_length": k}
        for label, label_runs in runs.items():
            if not label_runs:
                continue
            entry = run_series(label_runs)
            if label in spec:
                summary = spec[label].summary()
                entry["acceptance_rate"] = summary["acceptance_rate"] if summary else None
                entry["accepted_by_position"] = summary["accepted_by_position"] if summary else None
            point[label] = entry
        points.append(point)
        checks += [r.check() for r in spec.values() if r.matches] + [r.check() for r in ref.values()]
    baselines = {}
    for side in ("specwire", "transformers"):
        for key in ("code", "chat") if with_model else ("code",):
            # Plain greedy on the same prompt: reuse the earlier workloads' runs, top up to the repeats.
            while len(ctx.greedy_runs.get((side, key), [])) < ctx.repeats:
                ctx.plain_greedy(side, key)
            baselines[f"{side}_greedy_{key}"] = run_series(ctx.greedy_runs[(side, key)])
    result = workload_result(
        "Acceptance and speed versus draft length",
        {**base, "draft_lengths": ctx.draft_lengths},
        len(ctx.prompt("code")),
        {},
        unavailable_all,
        checks,
        points=points,
        baselines=baselines,
    )
    result["status"] = "partial" if unavailable_all else "ok"
    return result


WORKLOADS: dict[str, Callable[[Context], dict]] = {
    "greedy": greedy,
    "sampling": sampling,
    "beam": beam,
    "prompt_lookup": prompt_lookup,
    "draft_model": draft_model,
    "concurrency": concurrency,
    "draft_length": draft_length,
    "structured": structured,
    "speculation_matrix": speculation_matrix,  # its own services: the co-located, serial and pinned targets
    "roundtrip": roundtrip,  # after the speculative workloads: it also summarizes their per-round stats
    "memory": memory,  # last: peak memory over the whole run
}
QUICK_WORKLOADS = ["greedy", "prompt_lookup", "concurrency", "draft_length", "roundtrip", "memory"]


def run_workload(name: str, ctx: Context) -> dict:
    """Run one workload; a failure is recorded in the results instead of ending the benchmark."""
    log(f"workload {name}")
    started = time.perf_counter()
    try:
        result = WORKLOADS[name](ctx)
    except Exception as error:  # noqa: BLE001 - one broken workload must not lose the others' numbers
        log(f"workload {name} failed: {error!r}")
        result = {
            "title": name,
            "status": "error",
            "reason": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(limit=6),
            "checks": [],
        }
    result["elapsed_seconds"] = time.perf_counter() - started
    log(f"workload {name} done in {result['elapsed_seconds']:.1f}s ({result['status']})")
    return result


__all__ = ["QUICK_WORKLOADS", "WORKLOADS", "run_workload"]
