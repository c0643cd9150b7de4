"""Compiled decoding on the CPU: tokens/s of a static cache with `torch.compile` against the dynamic cache,
in specwire and in transformers, on the same weights.

Five modes run the same greedy request (a chat prompt, a fixed number of new tokens):

- `specwire dynamic`: specwire's decoding loop with a `DynamicCache` (what the target serves by default);
- `specwire static`: `cache_implementation="static"`, eager;
- `specwire static+compiled`: the same with `compile_config={"_compile_all_devices": True, ...}`, the decoding
  steps through `torch.compile` (`specwire.generation.compilation`);
- `transformers dynamic` and `transformers static+compiled`: `model.generate()` with the same settings.

specwire runs in process through `specwire.generation.loops.generate.generate`, the loop the target service's
sequential lane runs for a static cache (gRPC adds the same cost to every mode, so it is left out). Each mode
runs once untimed (`first_call_s`: with compilation, the compile time) and then `--repeats` timed runs; the
outputs of every mode must be the dynamic cache's tokens (`ids_match`).

    python -m bench.compile                 # SmolLM2 (the embedded default), 64 new tokens, 3 repeats
    python -m bench.compile --quick         # 8 new tokens, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402 - after the offline settings

from bench.concurrency_scheduler import _chat_ids  # noqa: E402
from bench.machine import describe  # noqa: E402
from bench.progress import log  # noqa: E402
from bench.prompts import CHAT_PROMPT  # noqa: E402
from bench.stats import ratio, summarize  # noqa: E402

MODES = (
    "specwire dynamic",
    "specwire static",
    "specwire static+compiled",
    "transformers dynamic",
    "transformers static+compiled",
)


def _compile_options(backend: str, mode: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {"_compile_all_devices": True, "backend": backend}
    if mode is not None:
        options["mode"] = mode
    return options


def _runners(model: Any, ids: torch.Tensor, new_tokens: int, compile_options: dict[str, Any]) -> dict[str, Callable]:
    """One callable per mode, each returning the first output row (prompt included)."""
    import transformers

    from specwire.generation.config import GenerationConfig
    from specwire.generation.loops.generate import generate

    length = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def ours(**extra: Any) -> Callable[[], list[int]]:
        config = GenerationConfig(**length, **extra)
        return lambda: generate(model, ids, config=config).sequences[0].tolist()

    given = dict(compile_options)
    all_devices = given.pop("_compile_all_devices")
    compile_config = transformers.CompileConfig(**given)
    compile_config._compile_all_devices = all_devices

    def theirs(**extra: Any) -> Callable[[], list[int]]:
        return lambda: model.generate(ids, **length, **extra)[0].tolist()

    return {
        "specwire dynamic": ours(),
        "specwire static": ours(cache_implementation="static"),
        "specwire static+compiled": ours(cache_implementation="static", compile_config=compile_options),
        "transformers dynamic": theirs(),
        "transformers static+compiled": theirs(cache_implementation="static", compile_config=compile_config),
    }


def measure(run: Callable[[], list[int]], repeats: int, new_tokens: int) -> dict[str, Any]:
    """The first (untimed: compiling) call's seconds, then `repeats` timed calls' tokens/s."""
    started = time.perf_counter()
    with torch.inference_mode():
        sequence = run()
    first = time.perf_counter() - started
    speeds = []
    for _ in range(repeats):
        started = time.perf_counter()
        with torch.inference_mode():
            sequence = run()
        speeds.append(new_tokens / (time.perf_counter() - started))
    return {"first_call_s": first, "tokens_per_second": summarize(speeds), "sequence": sequence}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.compile", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="'default' (embedded SmolLM2), a folder, a .gguf file")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per request (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode (default 3)")
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 1 repeat (a smoke test)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument(
        "--compile-mode", default=None, help="torch.compile mode (default: CompileConfig's, 'reduce-overhead')"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", default="bench/results/compile.json", help="where to write the figures")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens, args.repeats = 8, 1
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    from specwire.models import load_model

    loaded = load_model(args.model, progress=False)
    model = loaded.model.eval()
    ids = torch.tensor([_chat_ids(loaded.tokenizer, CHAT_PROMPT)], device=model.device)
    options = _compile_options(args.backend, args.compile_mode)
    runners = _runners(model, ids, args.max_new_tokens, options)
    results: dict[str, Any] = {}
    for name in modes:
        log(f"{name}: {args.max_new_tokens} new tokens x (1 untimed + {args.repeats})")
        results[name] = measure(runners[name], args.repeats, args.max_new_tokens)
    reference = results[modes[0]]["sequence"]
    for row in results.values():
        row["ids_match"] = row.pop("sequence") == reference
    base = results.get("specwire dynamic", {}).get("tokens_per_second")
    for row in results.values():
        row["ratio_to_specwire_dynamic"] = ratio(row["tokens_per_second"], base)
    report = {
        "meta": {
            **describe("bench.compile"),
            "model": args.model,
            "prompt_tokens": ids.shape[1],
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "quick": args.quick,
            "compile_config": options,
        },
        "modes": results,
    }
    _write(report, Path(args.json))
    return report


def _write(report: dict[str, Any], path: Path) -> None:
    meta = report["meta"]
    lines = [
        f"# Compiled decoding on {meta['machine']['cpu_model']} ({meta['model']}, {meta['prompt_tokens']} prompt "
        f"tokens, {meta['max_new_tokens']} new tokens, {meta['repeats']} repeats, compile_config "
        f"{meta['compile_config']})",
        "",
        "| mode | tokens/s (median) | min | max | ratio to specwire dynamic | first call (s) | ids match |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in report["modes"].items():
        speed = row["tokens_per_second"]
        share = row["ratio_to_specwire_dynamic"]
        lines.append(
            f"| {name} | {speed['median']:.1f} | {speed['min']:.1f} | {speed['max']:.1f} | "
            f"{'' if share is None else f'{share:.2f}'} | {row['first_call_s']:.1f} | {row['ids_match']} |"
        )
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown)


if __name__ == "__main__":
    main()
