"""Single requests in alternating triples on one target with a co-located draft: plain greedy, the controller (no
draft length named) and transformers' constant schedule named (the controller off), streamed, so that the time to
each token shows where along the answer the controller gains or loses. The speculation matrix reports whole
requests; a controller that gives away speed at an answer's start and wins it back later reads the same there.

  python -m bench.speculation_triples                                  # the chat prompt, 5 triples
  python -m bench.speculation_triples --prompt low --triples 8 --json triples.json
  python -m bench.speculation_triples --settle 3                       # the steady state of a target in use
  python -m bench.speculation_triples --log-dir logs --target-arg=--log-level --target-arg=DEBUG

Starts one target service (`--draft-model` co-located), warms each mode (and, with `--settle N`, runs N whole
controller requests untimed: a fresh target's first requests start from priors), then runs `--triples` triples in
alternating order on the prompt in the model's chat template, as the matrix sends it. Prints each request, the
median tokens/s per mode, the controller's ratio to plain decoding and to the schedule per triple, each mode's
speed over plain decoding between marks along the answer (medians of the time to each mark), what the controller
chose, and whether every output equalled plain greedy's. With `--log-dir` the target's log stays there (at DEBUG
it gives each of the controller's decisions and what it expected of them).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.machine import describe
from bench.prompts import CHAT_PROMPT, CODE_EDIT_PROMPT, LOW_ACCEPTANCE_PROMPT
from bench.reference import Run
from bench.services import (
    Service,
    add_log_options,
    free_port,
    log_folder,
    served_prompt,
    service_env,
    wait_healthy,
)
from bench.target import Specwire

PROMPTS = {"chat": CHAT_PROMPT, "code": CODE_EDIT_PROMPT, "low": LOW_ACCEPTANCE_PROMPT}
# transformers' defaults, named: the matrix's "controller off" (`bench.speculation_matrix.OFF_DRAFT`).
SCHEDULE = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant"}
MARKS = (10, 20, 40, 60, 80, 100)


def _time_to(arrivals: list[tuple[int, float]], mark: int) -> float:
    return next(seconds for count, seconds in arrivals if count >= mark)


def _span(at: dict[int, list[float]], start: int, end: int) -> float:
    """Median seconds to token `end` less the median to `start` (0: the request's start)."""
    return statistics.median(at[end]) - (statistics.median(at[start]) if start else 0.0)


def segments(times: dict[str, dict[int, list[float]]], marks: list[int]) -> dict[str, dict[str, float | None]]:
    """Per mode, its speed over plain decoding between consecutive marks (`"1-10"`, `"10-20"`, ..): the medians of
    plain's time to each mark over the mode's (from the request's start to the first mark, then mark to mark).
    None where the mode's medians put both marks in the same round (a block kept whole spans them)."""
    out: dict[str, dict[str, float | None]] = {}
    for mode, at in times.items():
        spans, previous = {}, 0
        for mark in marks:
            plain = _span(times["plain"], previous, mark)
            mine = _span(at, previous, mark)
            spans[f"{previous or 1}-{mark}"] = plain / mine if mine > 0 else None
            previous = mark
        out[mode] = spans
    return out


def run(args) -> dict:
    """Start the target, run the triples, stop it; the figures."""
    log_dir = log_folder(args.log_dir, "specwire-triples-")
    target_args = ["--model", args.model, "--draft-model", args.draft_model, *args.target_arg]
    target = Service("target-service", "specwire.target_service", target_args, free_port(), log_dir / "target.log")
    plain = {"do_sample": False, "max_new_tokens": args.max_new_tokens}
    modes = {
        "plain": plain,
        "controller": {**plain, "proposer": "draft_model"},
        "schedule": {**plain, "proposer": "draft_model", **SCHEDULE},
    }
    runs: dict[str, list[Run]] = {mode: [] for mode in modes}
    chosen = []  # the controller's requests' speculation stats
    target.start(service_env())
    try:
        wait_healthy(target, 900.0)
        prompt = served_prompt(target.address, PROMPTS[args.prompt])
        specwire = Specwire(target.address)
        try:
            for kwargs in modes.values():  # warm each path (and the draft) before the clock
                specwire.generate(prompt, **{**kwargs, "max_new_tokens": 8})
            for _ in range(args.settle):  # whole controller requests: the target's shared estimates settle
                specwire.generate(prompt, **modes["controller"])
            for i in range(args.triples):
                for mode in list(modes) if i % 2 == 0 else list(modes)[::-1]:
                    timed, final = specwire.stream(prompt, **modes[mode])
                    runs[mode].append(timed)
                    if mode == "controller":
                        chosen.append(final.speculation)
                    print(f"triple {i + 1}/{args.triples} {mode}: {timed.tokens_per_second:.2f} tok/s", flush=True)
        finally:
            specwire.close()
    finally:
        target.stop()
    produced = min(run.arrivals[-1][0] for timed in runs.values() for run in timed)
    marks = [m for m in MARKS if m < produced] + [produced]
    times = {mode: {m: [_time_to(run.arrivals, m) for run in timed] for m in marks} for mode, timed in runs.items()}
    rates = {mode: [run.tokens_per_second for run in timed] for mode, timed in runs.items()}
    reference = runs["plain"][0].sequence
    return {
        "meta": describe("bench.speculation_triples"),
        "prompt": args.prompt,
        "triples": args.triples,
        "settle": args.settle,
        "max_new_tokens": args.max_new_tokens,
        "tokens_per_second": {mode: statistics.median(r) for mode, r in rates.items()},
        "controller_over_plain": [c / p for c, p in zip(rates["controller"], rates["plain"], strict=True)],
        "controller_over_schedule": [c / s for c, s in zip(rates["controller"], rates["schedule"], strict=True)],
        "time_to_token": {mode: {str(m): statistics.median(at[m]) for m in marks} for mode, at in times.items()},
        "speed_over_plain_by_segment": segments(times, marks),
        "controller": {
            "rounds_with_drafts": [s.rounds for s in chosen],
            "tokens_without_draft": [s.tokens_without_draft for s in chosen],
            "probes": [s.probes for s in chosen],
        },
        "outputs_equal": all(run.sequence == reference for timed in runs.values() for run in timed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speculation_triples", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", choices=sorted(PROMPTS), default="chat", help="default: %(default)s")
    parser.add_argument("--triples", type=int, default=5, help="default: %(default)s")
    parser.add_argument(
        "--settle",
        type=int,
        default=0,
        help="untimed controller requests first, so that the target's shared estimates settle as in a target in use "
        "(on a fresh target the first requests start from priors; default: %(default)s)",
    )
    parser.add_argument("--model", default="default", help="target model (default: %(default)s)")
    parser.add_argument("--draft-model", default="default-int8", help="co-located draft model (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
    add_log_options(parser)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    result = run(args)
    rates = result["tokens_per_second"]
    print("tokens/s (medians): " + ", ".join(f"{mode} {rate:.2f}" for mode, rate in rates.items()))
    for name in ("controller_over_plain", "controller_over_schedule"):
        ratios = result[name]
        print(
            f"{name.replace('_', ' ')}: {statistics.median(ratios):.3f}x (per triple: "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + ")"
        )
    for mode, spans in result["speed_over_plain_by_segment"].items():
        if mode != "plain":
            shown = (f"{span}: {'one round' if x is None else f'{x:.2f}x'}" for span, x in spans.items())
            print(f"{mode} over plain, tokens " + ", ".join(shown))
    chose = result["controller"]
    print(
        f"the controller drafted in {chose['rounds_with_drafts']} rounds, decoded {chose['tokens_without_draft']} "
        f"tokens without drafts, probed or looked back {chose['probes']} times (per request); "
        f"every output equal to plain greedy's: {'yes' if result['outputs_equal'] else 'NO'}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["outputs_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
