"""A quick check of the adaptive speculation controller against plain greedy and named draft lengths.

One target service with a co-located draft (`--draft-model`), and alternating runs, per prompt, of
plain greedy, prompt lookup (controller, and the named `prompt_lookup_num_tokens=10`) and the draft
model (controller, and transformers' constant 20), so that the machine's noise falls on every row
alike. Every speculative output is checked against plain greedy. Prints a table of median tokens per
second and each row's ratio to plain greedy, and writes it as JSON.

    python -m bench.controller_check --prompts chat code low --reps 3 --max-new-tokens 128

Minutes, not hours: it is the controller's sanity check (issue #23), not the benchmark matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench.prompts import CHAT_PROMPT, CODE_EDIT_PROMPT, LOW_ACCEPTANCE_PROMPT
from bench.services import Service, free_port, wait_healthy
from bench.target import Specwire

PROMPTS = {"chat": CHAT_PROMPT, "code": CODE_EDIT_PROMPT, "low": LOW_ACCEPTANCE_PROMPT}
ROWS = {
    "plain": {},
    "lookup_ctl": {"proposer": "prompt_lookup"},
    "lookup_k10": {"proposer": "prompt_lookup", "prompt_lookup_num_tokens": 10},
    "draft_ctl": {"proposer": "draft_model"},
    "draft_k20": {"proposer": "draft_model", "num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant"},
}


def _encode(text: str) -> list[int]:
    from specwire.models.loader import load_model

    tokenizer = load_model("default", device="cpu", dtype="float32", progress=False).tokenizer
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def _lengths(stats) -> str:
    runs = getattr(stats, "draft_lengths", None) or []
    lengths = " ".join(f"{length}x{rounds}" if rounds > 1 else f"{length}" for length, rounds in runs)[:100]
    drafted, rounds = max(stats.drafted_tokens, 1), max(stats.rounds, 1)
    return (
        f"{stats.rounds} rounds, {stats.drafted_tokens} drafted, {stats.accepted_tokens} accepted, "
        f"draft {stats.draft_seconds * 1e3 / drafted:.1f} ms/token, verify {stats.verify_seconds * 1e3 / rounds:.0f} "
        f"ms/round | {lengths}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-model", default="default-int8")
    parser.add_argument("--out", default="")
    parser.add_argument("--verbose", action="store_true", help="print each run's draft lengths")
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="controller-check-"))
    service = Service(
        "target-service",
        "specwire.target_service",
        ["--model", "default", "--draft-model", args.draft_model],
        free_port(),
        log_dir / "target.log",
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    service.start(env)
    results: dict[str, dict[str, list[float]]] = {}
    try:
        wait_healthy(service, 600.0)
        side = Specwire(service.address)
        for key in args.prompts:
            prompt = _encode(PROMPTS[key])
            base = {"do_sample": False, "max_new_tokens": args.max_new_tokens}
            greedy, _ = side.generate(prompt, **base)  # warm-up, and the sequence to compare with
            for row in args.rows[1:] if args.rows[0] == "plain" else args.rows:  # warm every path once
                side.generate(prompt, **base, **ROWS[row])
            rates: dict[str, list[float]] = {row: [] for row in args.rows}
            for rep in range(args.reps):
                order = args.rows if rep % 2 == 0 else list(reversed(args.rows))
                for row in order:
                    run, output = side.generate(prompt, **base, **ROWS[row])
                    if run.sequence != greedy.sequence:
                        raise SystemExit(f"{key} {row}: output differs from plain greedy")
                    rates[row].append(run.new_tokens / run.seconds)
                    if args.verbose and row != "plain":
                        print(f"  {key} {row} {rates[row][-1]:.1f} tok/s: {_lengths(output.speculation)}", flush=True)
            results[key] = rates
            plain = statistics.median(rates["plain"]) if "plain" in rates else None
            cells = []
            for row, values in rates.items():
                median = statistics.median(values)
                ratio = f" ({median / plain:.2f}x)" if plain and row != "plain" else ""
                cells.append(f"{row} {median:.1f}{ratio}")
            print(f"{key}: " + " | ".join(cells), flush=True)
        side.close()
    finally:
        service.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
