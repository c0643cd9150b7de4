"""The benchmark workloads. Each takes a `Context` and returns a JSON-ready dict.

Within every repeat the specwire and transformers runs alternate (and the order flips on odd repeats,
so slow drift of a shared machine hits both sides alike). Every figure is summarized over the repeats
as median, min and max (`bench.stats.summarize`). Every speculative run is checked token for token
against plain greedy decoding on the same side, and the check is recorded.

Workloads that need the target's speculative loop report "speculation not available: <reason>"
for the specwire side while the target answers with `speculation.fallback_reason` (or proposer none),
and still measure the transformers side.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.progress import log
from bench.prompts import CHAT_PROMPT, CODE_EDIT_PROMPT
from bench.reference import Reference, Run
from bench.services import ServiceStack
from bench.stats import percentile, summarize
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
            text = {"chat": CHAT_PROMPT, "code": CODE_EDIT_PROMPT}[key]
            ids = self.reference.encode(text)
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


# ---------------------------------------------------------------------------------------------------------
# helpers


def _alternate(
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


def _series(runs: list[Run]) -> dict:
    return {
        "tokens_per_second": summarize([r.tokens_per_second for r in runs]),
        "seconds": summarize([r.seconds for r in runs]),
        "new_tokens": summarize([r.new_tokens for r in runs]),
        "ttft_seconds": summarize([r.ttft for r in runs]) if any(r.ttft is not None for r in runs) else None,
    }


def _check(name: str, passed: bool | None, detail: str = "") -> dict:
    return {"name": name, "passed": passed, "detail": detail}


def _same(a: list[int], b: list[int]) -> tuple[bool, str]:
    if a == b:
        return True, f"{len(a)} tokens identical"
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return False, f"first difference at position {first} (lengths {len(a)} and {len(b)})"


class _SpeculativeRuns:
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
        same, self.detail = _same(run.sequence, self.ctx.greedy_sequence("specwire", self.prompt_key))
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
            return _check(f"{self.label} equals specwire plain greedy", None, "not run (speculation not available)")
        return _check(
            f"{self.label} equals specwire plain greedy",
            all(self.matches),
            f"{sum(self.matches)}/{len(self.matches)} runs; last: {self.detail}",
        )


class _ReferenceSpeculativeRuns:
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
        same, self.detail = _same(run.sequence, self.ctx.greedy_sequence("transformers", self.prompt_key))
        self.matches.append(same)
        return run

    def check(self) -> dict:
        return _check(
            f"{self.label} equals transformers plain greedy",
            all(self.matches) if self.matches else None,
            f"{sum(self.matches)}/{len(self.matches)} runs; last: {self.detail}",
        )


def _result(
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
        "series": {label: _series(r) for label, r in runs.items() if r},
        "unavailable": unavailable,
        "checks": checks,
        **extra,
    }


# ---------------------------------------------------------------------------------------------------------
# 1-3: plain decoding modes


def greedy(ctx: Context) -> dict:
    """1. Greedy on the chat prompt: tokens/s (unary) and time to first token (streaming)."""
    prompt = ctx.prompt("chat")
    args = {"do_sample": False, "max_new_tokens": ctx.max_new_tokens}
    runs, unavailable = _alternate(
        ctx,
        {
            "specwire": lambda: ctx.plain_greedy("specwire", "chat"),
            "transformers": lambda: ctx.plain_greedy("transformers", "chat"),
            "specwire_stream": lambda: ctx.specwire.stream(prompt, **args)[0],
            "transformers_streamer": lambda: ctx.reference.generate(prompt, ttft=True, **args),
        },
        "greedy",
    )
    same, detail = _same(runs["specwire"][0].sequence, runs["transformers"][0].sequence)
    return _result(
        "Greedy, chat prompt",
        args,
        len(prompt),
        runs,
        unavailable,
        [_check("specwire greedy equals transformers greedy", same, detail)],
    )


def sampling(ctx: Context) -> dict:
    """2. Multinomial sampling, top_p 0.9, temperature 0.7, seeded."""
    prompt = ctx.prompt("chat")
    args = {"do_sample": True, "top_p": 0.9, "temperature": 0.7, "max_new_tokens": ctx.max_new_tokens}
    runs, unavailable = _alternate(
        ctx,
        {
            "specwire": lambda: ctx.specwire.generate(prompt, seed=SEED, **args)[0],
            "transformers": lambda: ctx.reference.generate(prompt, seed=SEED, **args),
        },
        "sampling",
    )
    same, detail = _same(runs["specwire"][0].sequence, runs["transformers"][0].sequence)
    return _result(
        "Sampling (top_p 0.9, temperature 0.7, seed 1234)",
        {**args, "seed": SEED},
        len(prompt),
        runs,
        unavailable,
        [_check("specwire seeded sample equals transformers after torch.manual_seed", same, detail)],
    )


def beam(ctx: Context) -> dict:
    """3. Beam search with 4 beams."""
    prompt = ctx.prompt("chat")
    args = {"do_sample": False, "num_beams": 4, "max_new_tokens": ctx.max_new_tokens}
    runs, unavailable = _alternate(
        ctx,
        {
            "specwire": lambda: ctx.specwire.generate(prompt, **args)[0],
            "transformers": lambda: ctx.reference.generate(prompt, **args),
        },
        "beam-4",
    )
    same, detail = _same(runs["specwire"][0].sequence, runs["transformers"][0].sequence)
    return _result(
        "Beam search, 4 beams",
        args,
        len(prompt),
        runs,
        unavailable,
        [_check("specwire beam-4 equals transformers beam-4", same, detail)],
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
    ours = _SpeculativeRuns(ctx, "code", "specwire prompt lookup", **lookup_args)
    theirs = _ReferenceSpeculativeRuns(ctx, "code", "transformers prompt lookup", **lookup_args)
    runs, unavailable = _alternate(
        ctx,
        {
            "specwire_prompt_lookup": ours,
            "transformers_prompt_lookup": theirs,
            "specwire_greedy": lambda: ctx.plain_greedy("specwire", "code"),
            "transformers_greedy": lambda: ctx.plain_greedy("transformers", "code"),
        },
        "prompt-lookup",
    )
    return _result(
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
    ours = _SpeculativeRuns(ctx, "chat", "specwire draft model", proposer="draft_model", **args)
    theirs = _ReferenceSpeculativeRuns(ctx, "chat", "transformers assisted generation", assistant=assistant, **args)
    runs, unavailable = _alternate(
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
    return _result(
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
# 6: concurrency


def _wave(address: str, prompt: list[int], clients: int, args: dict) -> tuple[float, list[float], int]:
    """`clients` concurrent Generate calls, one channel each; returns wall time, latencies and tokens."""
    from specwire.client import TargetClient

    channels = [TargetClient(address) for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    latencies: list[float] = [0.0] * clients
    tokens: list[int] = [0] * clients
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            channels[i].model_info()  # connect before the clock starts
            barrier.wait()
            started = time.perf_counter()
            output = channels[i].generate(input_ids=[prompt], **args)
            latencies[i] = time.perf_counter() - started
            tokens[i] = output.sequences.shape[1] - len(prompt)
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    for channel in channels:
        channel.close()
    if errors:
        raise errors[0]
    return wall, latencies, sum(tokens)


def concurrency(ctx: Context) -> dict:
    """6. 1, 2, 4, 8 concurrent clients: aggregate tokens/s and p50/p99 latency; transformers sequential."""
    prompt = ctx.prompt("chat")
    args = {"do_sample": False, "max_new_tokens": ctx.max_new_tokens}
    address = ctx.stack.address("target")
    per_level: dict[int, dict[str, list]] = {
        n: {"throughput": [], "latencies": [], "wall": []} for n in ctx.concurrency_levels
    }
    sequential: list[Run] = []
    for repeat in range(ctx.repeats):
        levels = ctx.concurrency_levels if repeat % 2 == 0 else ctx.concurrency_levels[::-1]
        for n in levels:
            wall, latencies, tokens = _wave(address, prompt, n, args)
            per_level[n]["throughput"].append(tokens / wall)
            per_level[n]["latencies"].extend(latencies)
            per_level[n]["wall"].append(wall)
            log(
                f"  concurrency [{repeat + 1}/{ctx.repeats}] {n} client(s): {tokens} tokens in {wall:.2f}s = "
                f"{tokens / wall:.1f} tok/s aggregate, latency max {max(latencies):.2f}s"
            )
        run = ctx.reference.generate(prompt, **args)
        sequential.append(run)
        log(f"  concurrency [{repeat + 1}/{ctx.repeats}] transformers sequential: {run.tokens_per_second:.1f} tok/s")
    levels = {}
    for n, values in per_level.items():
        levels[str(n)] = {
            "clients": n,
            "aggregate_tokens_per_second": summarize(values["throughput"]),
            "latency_p50_seconds": percentile(values["latencies"], 50),
            "latency_p99_seconds": percentile(values["latencies"], 99),
            "latency_samples": len(values["latencies"]),
            "wall_seconds": summarize(values["wall"]),
        }
    return {
        "title": "Concurrent clients (greedy, chat prompt)",
        "status": "ok",
        "reason": None,
        "config": args,
        "prompt_tokens": len(prompt),
        "levels": levels,
        "transformers_sequential": _series(sequential),
        "checks": [],
        "notes": [
            "p50/p99 are over every request of every repeat at that level (with few samples, p99 is "
            "close to the maximum); transformers has no server, so its figure is one request after "
            "another in this process."
        ],
    }


# ---------------------------------------------------------------------------------------------------------
# 7: draft round trip


async def _round_trips(address: str, prompt: list[int], num_tokens: int, rounds: int, warmup: int) -> list[float]:
    """Seconds per feedback -> proposal round on one Draft stream (prompt lookup: no model compute)."""
    import grpc

    from specwire.client.config_client import config_to_wire
    from specwire.common.v1 import common_pb2
    from specwire.draft.v1 import draft_service_pb2 as pb
    from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
    from specwire.security import secure_channel

    queue: asyncio.Queue = asyncio.Queue()

    async def requests():
        while True:
            message = await queue.get()
            if message is None:
                return
            yield message

    times: list[float] = []
    async with secure_channel(address, aio=True) as channel:
        stub = pb_grpc.DraftServiceStub(channel)
        call = stub.Draft(requests())
        start = pb.DraftStart(
            rows=[common_pb2.TokenSequence(ids=prompt)],
            method=pb.DRAFT_METHOD_PROMPT_LOOKUP,
            config=config_to_wire({"prompt_lookup_num_tokens": max(num_tokens, 1), "do_sample": False}),
            num_tokens=num_tokens,
            vocab_size=max(prompt) + 1,
        )
        await queue.put(pb.DraftRequest(start=start))
        await call.read()
        for i in range(warmup + rounds):
            # Feed the prompt's own tokens back, as a copying answer would: lookups keep finding matches.
            appended = [prompt[(len(prompt) // 2 + i) % len(prompt)]]
            feedback = pb.DraftFeedback(
                rows=[pb.RowFeedback(num_accepted=0, appended_ids=appended)], num_tokens=num_tokens
            )
            started = time.perf_counter()
            await queue.put(pb.DraftRequest(feedback=feedback))
            response = await call.read()
            if response is grpc.aio.EOF:
                raise RuntimeError("the draft stream ended early")
            if i >= warmup:
                times.append(time.perf_counter() - started)
        await queue.put(None)
        call.cancel()
    return times


def roundtrip(ctx: Context) -> dict:
    """7. Draft round-trip overhead per speculative round on loopback (p50, p99)."""
    prompt = ctx.prompt("code")
    address = ctx.stack.address("draft")
    variants = {"prompt_lookup_10": PROMPT_LOOKUP_TOKENS, "empty_round": 0}
    measured: dict[str, dict[str, list[float]]] = {v: {"p50": [], "p99": [], "all": []} for v in variants}
    for repeat in range(ctx.repeats):
        for name, num_tokens in variants.items():
            times = asyncio.run(_round_trips(address, prompt, num_tokens, ctx.roundtrip_rounds, warmup=10))
            measured[name]["p50"].append(percentile(times, 50))
            measured[name]["p99"].append(percentile(times, 99))
            measured[name]["all"].extend(times)
            log(
                f"  round trip [{repeat + 1}/{ctx.repeats}] {name}: "
                f"p50 {percentile(times, 50) * 1e3:.3f} ms, "
                f"p99 {percentile(times, 99) * 1e3:.3f} ms over {len(times)} rounds"
            )
    direct = {
        name: {
            "num_tokens": variants[name],
            "rounds_per_repeat": ctx.roundtrip_rounds,
            "p50_ms": summarize([v * 1e3 for v in m["p50"]]),
            "p99_ms": summarize([v * 1e3 for v in m["p99"]]),
        }
        for name, m in measured.items()
    }
    via_target = None
    if ctx.speculation_rounds:
        via_target = {
            "requests": len(ctx.speculation_rounds),
            "draft_ms_per_round_p50": percentile(
                [r["draft_seconds_per_round"] * 1e3 for r in ctx.speculation_rounds], 50
            ),
            "draft_ms_per_round_p99": percentile(
                [r["draft_seconds_per_round"] * 1e3 for r in ctx.speculation_rounds], 99
            ),
            "verify_ms_per_round_p50": percentile(
                [r["verify_seconds_per_round"] * 1e3 for r in ctx.speculation_rounds], 50
            ),
        }
    return {
        "title": "Draft round trip per speculative round (loopback)",
        "status": "ok",
        "reason": None
        if via_target
        else "speculation not available in the target: only the direct measurement of the draft stream ran",
        "direct": direct,
        "via_target": via_target,
        "checks": [],
        "notes": [
            "direct: a benchmark client plays the target on one Draft stream (grpc.aio), timing each "
            "DraftFeedback -> DraftResponse on loopback; prompt lookup costs microseconds, so this is "
            "the transport and servicer overhead of a round. empty_round asks for 0 tokens.",
            "via_target: draft_seconds / rounds from each speculative request's stats (includes draft model compute).",
        ],
    }


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
        spec: dict[str, _SpeculativeRuns] = {}
        ref: dict[str, _ReferenceSpeculativeRuns] = {}
        if "specwire_prompt_lookup" not in unavailable_all:
            spec["specwire_prompt_lookup"] = _SpeculativeRuns(
                ctx, "code", f"specwire prompt lookup k={k}", prompt_lookup_num_tokens=k, **base
            )
        ref["transformers_prompt_lookup"] = _ReferenceSpeculativeRuns(
            ctx, "code", f"transformers prompt lookup k={k}", prompt_lookup_num_tokens=k, **base
        )
        if with_model:
            fixed = {
                "num_assistant_tokens": k,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
            if "specwire_draft_model" not in unavailable_all:
                spec["specwire_draft_model"] = _SpeculativeRuns(
                    ctx, "chat", f"specwire draft model k={k}", proposer="draft_model", **fixed, **base
                )
            ref["transformers_assisted"] = _ReferenceSpeculativeRuns(
                ctx, "chat", f"transformers assisted k={k}", assistant=assistant, **fixed, **base
            )
        runners.update(spec)
        runners.update(ref)
        runs, unavailable = _alternate(ctx, runners, f"draft-length k={k}")
        unavailable_all.update(unavailable)
        point: dict[str, Any] = {"draft_length": k}
        for label, label_runs in runs.items():
            if not label_runs:
                continue
            entry = _series(label_runs)
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
            baselines[f"{side}_greedy_{key}"] = _series(ctx.greedy_runs[(side, key)])
    result = _result(
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


# ---------------------------------------------------------------------------------------------------------
# 9: memory


def memory(ctx: Context) -> dict:
    """9. Peak resident size of each service (VmHWM), against the target's memory budget.

    On a GPU the peak device memory of the target (its `GetModelInfo`) and of transformers in this
    process (`torch.cuda.max_memory_reserved`) are added: the weights live there, not in the RSS.
    """
    usage = ctx.stack.memory()
    float32_mb = ctx.reference.float32_bytes() / 1e6
    services = {}
    for name, values in usage.items():
        services[name] = {
            "peak_rss_mb": values.get("VmHWM", 0) * 1024 / 1e6 if values else None,
            "rss_mb": values.get("VmRSS", 0) * 1024 / 1e6 if values else None,
            "args": " ".join(ctx.stack.services[name].args),
        }
    notes = ["peak = VmHWM from /proc/PID/status at the end of the run (model loading included); MB = 10^6 bytes."]
    device = ctx.reference.device
    device_peak = None
    if device.type == "cuda":
        device_peak = {
            "target": ctx.specwire.client.model_info().peak_device_memory_bytes / 1e6,
            "transformers": torch.cuda.max_memory_reserved(device) / 1e6,
        }
        notes.append(
            f"device peak = bytes torch's caching allocator reserved on {device} (max_memory_reserved), "
            "for the target service and for transformers in the benchmark process; the draft service's "
            "device memory is not reported."
        )
    return {
        "title": "Memory: peak resident size per service",
        "status": "ok",
        "reason": None,
        "device": str(device),
        "model_float32_mb": float32_mb,
        "target_budget_mb": 1.5 * float32_mb + 300,
        "services": services,
        "device_peak_mb": device_peak,
        "checks": [],
        "notes": notes,
    }


WORKLOADS: dict[str, Callable[[Context], dict]] = {
    "greedy": greedy,
    "sampling": sampling,
    "beam": beam,
    "prompt_lookup": prompt_lookup,
    "draft_model": draft_model,
    "concurrency": concurrency,
    "draft_length": draft_length,
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


__all__ = ["Context", "QUICK_WORKLOADS", "WORKLOADS", "run_workload"]
