"""What one packed forward costs by block size: the lean decoder with its small blocks (the target service's
default on float32 CPU weights), the lean decoder computing every product as `model(...)` does, and the model's
own forward, in alternating order on one slot cache.

  python -m bench.verify_blocks                              # the embedded default, blocks 1-5 and 8
  python -m bench.verify_blocks --blocks 1,2,3,4 --repeats 21 --threads 1 --json blocks.json

A block of `k` tokens is what a verify of `k - 1` drafts runs (plain decoding: `k = 1`), after a prompt of
`--context` tokens. The small blocks pad one-row products too (`SmallBlocks.single_rows`; the target service's
start-up keeps that only where it measured it faster). Prints, per block size, the median milliseconds of each
forward, the small blocks' over the lean forward's of the same block, and the small blocks' over the model's own
forward of the smallest block (with 1 in `--blocks`, a plain round): what a speculative round's verify costs
against a plain round's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.machine import describe
from specwire.runtime.lean_decoder import LeanDecoder
from specwire.runtime.slot_cache import SlotKVCache, install_slot_attention, run_packed

FORWARDS = ("small blocks", "lean", "transformers")


def _timed(model, cache, block: list[int], context: int, decoder) -> float:
    """Milliseconds of one packed forward of `block` at position `context` of slot 0."""
    started = time.perf_counter()
    run_packed(model, cache, [(0, context, block)], range(len(block)), decoder)
    return (time.perf_counter() - started) * 1000


def measure(model, blocks: list[int], repeats: int, context: int) -> dict[int, dict[str, float]]:
    """Median milliseconds per block size and forward (alternating; the first round of each is a warm-up)."""
    install_slot_attention(model)
    vocab = int(model.config.get_text_config().vocab_size)
    cache = SlotKVCache(model, 1, context + max(blocks))
    small, exact = LeanDecoder(model), LeanDecoder(model, small_blocks=False)
    small.small_blocks.single_rows = True  # block 1 padded too: what a start-up that measured it faster keeps
    decoders = {"small blocks": small, "lean": exact, "transformers": None}
    with torch.inference_mode():
        run_packed(model, cache, [(0, 0, [(7 * i + 3) % vocab for i in range(context)])], [context - 1], exact)
        times: dict[int, dict[str, list[float]]] = {k: {name: [] for name in FORWARDS} for k in blocks}
        for repeat in range(repeats + 1):
            for k in blocks:
                block = [(11 * (repeat + i) + 5) % vocab for i in range(k)]
                for name in FORWARDS if repeat % 2 else reversed(FORWARDS):
                    took = _timed(model, cache, block, context, decoders[name])
                    if repeat:
                        times[k][name].append(took)
    return {k: {name: statistics.median(values) for name, values in by_name.items()} for k, by_name in times.items()}


def report(medians: dict[int, dict[str, float]]) -> str:
    plain = medians[min(medians)]["transformers"]
    lines = [
        "| block | " + " | ".join(f"{name} ms" for name in FORWARDS) + " | small blocks / lean | "
        "small blocks / plain transformers |",
        "|---" * (len(FORWARDS) + 3) + "|",
    ]
    for k, row in sorted(medians.items()):
        cells = " | ".join(f"{row[name]:.1f}" for name in FORWARDS)
        ratios = f"{row['small blocks'] / row['lean']:.2f}x | {row['small blocks'] / plain:.2f}x"
        lines.append(f"| {k} | {cells} | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.verify_blocks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="model to load (default: the embedded SmolLM2)")
    parser.add_argument("--blocks", default="1,2,3,4,5,8", help="comma-separated block sizes (tokens per forward)")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per block size and forward")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens in the cache before each block")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specwire.models import load_model

    blocks = sorted({int(k) for k in args.blocks.split(",")})
    model = load_model(args.model, progress=False).model
    medians = measure(model, blocks, args.repeats, args.context)
    machine = describe("bench.verify_blocks")
    print(
        f"# one packed forward by block size after {args.context} tokens: {machine['machine']['cpu_model']}, "
        f"torch threads {torch.get_num_threads()}, commit {machine['git_commit']}, {args.repeats} rounds (medians)"
    )
    print(report(medians))
    result = {"machine": machine, "context": args.context, "medians_ms": medians}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
