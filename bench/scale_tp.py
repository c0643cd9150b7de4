"""Tensor parallelism on the CPU: TP=2 against TP=1, same model, same requests (`python -m bench.scale --tp`).

  python -m bench.scale --tp                              # a SmolLM2-shaped random model, a few minutes
  python -m bench.scale --tp --quick --model PATH         # smoke run on a small model (CI: a tiny one)
  python -m bench.scale --tp --tp-scheduler sequential    # both targets with the sequential scheduler

Two target services on the same model and scheduler (default batched, the service's default, with
packed forwards through transformers' forward on both: under TP the lean decoder is refused, so TP=1
does not get it either and the difference is the sharding alone): `TP=1` (one process, all
of this process's cores as torch threads) and `TP=2` (`--tensor-parallel 2`: two ranks over gloo,
each with half the cores). One client sends the same greedy requests to each, in alternating rounds,
and this reports tokens/s of each, the wall time per decoding step (one token per step) and the
difference: what sharding costs per step on this machine (the broadcast of the step's inputs to the
follower plus the all-reduces inside every sharded layer, against half the arithmetic per rank). On
a 2-core machine TP=2 cannot be faster; the point is correctness, so it also reports whether every
response's ids were equal and the largest score difference.

The default model (`--model smollm2-shaped`) is SmolLM2-135M's architecture (embedded config and
tokenizer, 30 layers, hidden 576) with 8 attention heads and 4 KV heads instead of 9 and 3, which
2 ranks cannot split, and random weights: the same work per step as the embedded model.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.concurrency_scheduler import PROMPTS, _chat_ids
from bench.services import Service, free_port, wait_healthy

SHAPED = "smollm2-shaped"
FULL = {"requests": 4, "max_new_tokens": 64, "rounds": 2}
QUICK = {"requests": 2, "max_new_tokens": 16, "rounds": 1}


def build_shaped_model(folder: Path) -> Path:
    """SmolLM2-135M's config and tokenizer with 8/4 heads and random weights, saved to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    from specwire.models import load_model, model_config

    config = model_config("default")
    config.num_attention_heads, config.num_key_value_heads = 8, 4  # head_dim 72; 2 ranks split them
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    load_model("default", progress=False).tokenizer.save_pretrained(folder)
    return folder


def start_targets(model: str, logs: Path, scheduler: str = "batched") -> dict[str, Service]:
    """The TP=1 and TP=2 targets with `scheduler`, started together (each idles while the other is measured)."""
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    targets = {}
    for name, extra, threads in (
        ("TP=1", [], cores),
        ("TP=2", ["--tensor-parallel", "2"], max(1, cores // 2)),
    ):
        args = ["--model", model, "--scheduler", scheduler, "--packed-forward", "transformers", *extra]
        service = Service(name, "specwire.target_service", args, free_port(), logs / f"{name}.log")
        service.start({**env, "OMP_NUM_THREADS": str(threads)})
        targets[name] = service
    return targets


def run_requests(address: str, prompts: list[list[int]], requests: int, max_new_tokens: int) -> dict:
    """`requests` greedy requests one after the other: their ids, scores, tokens and wall time."""
    from specwire.client import TargetClient

    outputs = []
    started = time.perf_counter()
    with TargetClient(address) as client:
        for i in range(requests):
            out = client.generate(
                [prompts[i % len(prompts)]],
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
            outputs.append(out)
    wall = time.perf_counter() - started
    tokens = sum(out.sequences.shape[1] - len(prompts[i % len(prompts)]) for i, out in enumerate(outputs))
    return {"outputs": outputs, "tokens": tokens, "wall_s": wall}


def compare(one: list, two: list) -> tuple[bool, float]:
    """Whether every response's ids are equal, and the largest score difference."""
    import torch

    equal = all(a.sequences.tolist() == b.sequences.tolist() for a, b in zip(one, two, strict=True))
    worst = 0.0
    for a, b in zip(one, two, strict=True):
        for x, y in zip(a.scores, b.scores, strict=True):
            if not torch.equal(torch.isinf(x), torch.isinf(y)):  # a masked token on one side only
                return False, float("inf")
            finite = torch.isfinite(y)  # min_new_tokens masks EOS with -inf on both sides
            worst = max(worst, float((x[finite] - y[finite]).abs().max()))
    return equal, worst


def measure(model: str, requests: int, max_new_tokens: int, rounds: int, logs: Path, scheduler: str) -> dict:
    """Alternating rounds on both targets: tokens/s, ms per step, equality."""
    from specwire.models import load_model

    tokenizer = load_model(model, progress=False).tokenizer  # prompt ids only; the targets run the model
    prompts = [_chat_ids(tokenizer, text) for text in PROMPTS]
    targets = start_targets(model, logs, scheduler)
    try:
        for service in targets.values():
            wait_healthy(service, 900)
        for service in targets.values():  # warm-up, not counted
            run_requests(service.address, prompts, 1, max_new_tokens)
        totals = {name: {"tokens": 0, "wall_s": 0.0} for name in targets}
        equal, worst = True, 0.0
        for round_ in range(rounds):
            runs = {name: run_requests(s.address, prompts, requests, max_new_tokens) for name, s in targets.items()}
            same, diff = compare(runs["TP=1"]["outputs"], runs["TP=2"]["outputs"])
            equal, worst = equal and same, max(worst, diff)
            for name, run in runs.items():
                totals[name]["tokens"] += run["tokens"]
                totals[name]["wall_s"] += run["wall_s"]
                print(f"round {round_ + 1} {name}: {run['tokens'] / run['wall_s']:.1f} tokens/s", flush=True)
    finally:
        for service in targets.values():
            service.stop()
    for total in totals.values():
        total["tokens_per_s"] = total["tokens"] / total["wall_s"]
        total["ms_per_step"] = 1000.0 * total["wall_s"] / total["tokens"]
    return {
        "phases": totals,
        "ids_equal": equal,
        "max_score_difference": worst,
        "overhead_ms_per_step": totals["TP=2"]["ms_per_step"] - totals["TP=1"]["ms_per_step"],
    }


def report_markdown(results: dict) -> str:
    phases = results["phases"]
    lines = [
        f"# Tensor parallelism on the CPU ({results['model']}, {results['requests_per_round']} greedy requests x "
        f"{results['max_new_tokens']} tokens per round, {results['rounds']} rounds, {results['cpu_count']} cores, "
        f"gloo, {results['scheduler']} scheduler)",
        "",
        "| target | tokens/s | ms per step |",
        "|---|---:|---:|",
        *(f"| {name} | {p['tokens_per_s']:.1f} | {p['ms_per_step']:.2f} |" for name, p in phases.items()),
        "",
        f"TP=2 costs {results['overhead_ms_per_step']:+.2f} ms per step; ids equal: {results['ids_equal']}; "
        f"largest score difference {results['max_score_difference']:.2g}.",
    ]
    return "\n".join(lines) + "\n"


def run(
    model: str,
    quick: bool,
    requests: int | None,
    max_new_tokens: int | None,
    rounds: int | None,
    scheduler: str = "batched",
) -> dict:
    """The whole TP benchmark; builds the SmolLM2-shaped model when `model` is `smollm2-shaped`."""
    preset = QUICK if quick else FULL
    folder = Path(tempfile.mkdtemp(prefix="specwire-bench-tp-"))
    path = str(build_shaped_model(folder / "model")) if model == SHAPED else model
    requests = requests or preset["requests"]
    max_new_tokens = max_new_tokens or preset["max_new_tokens"]
    rounds = rounds or preset["rounds"]
    measured = measure(path, requests, max_new_tokens, rounds, folder, scheduler)
    return {
        "model": model,
        "scheduler": scheduler,
        "quick": quick,
        "requests_per_round": requests,
        "max_new_tokens": max_new_tokens,
        "rounds": rounds,
        "cpu_count": len(os.sched_getaffinity(0)),
        **measured,
    }
