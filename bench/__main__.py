"""`python -m bench`: specwire's services against in-process transformers.generate(), side by side.

Starts config, draft and target services on free loopback ports with the given model, loads the same
weights in this process for transformers, runs each workload through both (alternating within every
repeat), and writes results.json, results.md and PNG plots into the output folder.

  python -m bench                          full run on the embedded SmolLM2 (tens of minutes on 2 cores)
  python -m bench --quick                  CI-sized smoke run (32 new tokens, 1 repeat, a subset)
  python -m bench --model PATH --out DIR   another model (folder, .gguf, Hub id in the offline cache)
  python -m bench --workloads greedy,beam --repeats 5
  python -m bench --device cuda --dtype bfloat16   on a GPU: services and transformers on the same device

Workloads: greedy, sampling, beam, prompt_lookup, draft_model, concurrency, draft_length, structured,
speculation_matrix, roundtrip, memory. The speculation matrix (issue #23) alone, as the README reports it:

  python -m bench --workloads speculation_matrix --out results/matrix
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FULL = {
    "max_new_tokens": 128,
    "repeats": 3,
    "concurrency": [1, 2, 4, 8],
    "draft_lengths": [1, 2, 4, 8, 12, 16],
    "roundtrip_rounds": 300,
}
QUICK = {
    "max_new_tokens": 32,
    "repeats": 1,
    "concurrency": [1, 2],
    "draft_lengths": [2, 8],
    "roundtrip_rounds": 50,
}
NEEDS_DRAFT_MODEL = {"draft_model", "speculation_matrix"}


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    from bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke mode: 32 new tokens, 1 repeat, a subset")
    parser.add_argument("--model", default="default", help="target model (default: the embedded SmolLM2-135M)")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="draft model of the draft service and of transformers' assisted generation "
        "(default: default-int8 for the default model, else the target model itself)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device of the target service and of transformers: cpu, cuda, cuda:N (default cpu)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights dtype of the target, the draft and transformers (default float32)",
    )
    parser.add_argument(
        "--draft-device",
        default=None,
        help="torch device of the draft service and of transformers' assistant "
        "(default: cpu for default-int8, which is CPU-only, else --device)",
    )
    parser.add_argument("--out", default=None, help="results folder (default: results/<UTC date-time>)")
    parser.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated subset of: {','.join(WORKLOADS)} (default: all; quick: a subset)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats per figure (default 3, quick 1)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="new tokens per request (default 128, quick 32)"
    )
    parser.add_argument("--concurrency", type=_ints, default=None, help="client counts (default 1,2,4,8)")
    parser.add_argument("--draft-lengths", type=_ints, default=None, help="draft lengths (default 1,2,4,8,12,16)")
    parser.add_argument(
        "--render", metavar="DIR", help="only redraw DIR/results.md and the plots from DIR/results.json"
    )
    parser.add_argument(
        "--target-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra target-service option, repeatable (e.g. --target-arg=--scheduler=batched)",
    )
    return parser


def check_devices(args: argparse.Namespace, int8_draft: bool) -> None:
    """Fail before anything starts when a device is unusable here, or given twice."""
    from specwire.models.loader import resolve_device

    devices = {}
    for option, device in (("--device", args.device), ("--draft-device", args.draft_device)):
        try:
            devices[option] = resolve_device(device)
        except ValueError as error:
            raise SystemExit(f"{option}: {error}") from None
    if int8_draft and devices["--draft-device"].type != "cpu":
        raise SystemExit(
            f"--draft-device {args.draft_device}: the default-int8 draft runs on the CPU only; "
            "leave --draft-device out (cpu), or pass --draft-model default to draft on the GPU"
        )
    for arg in args.target_arg:
        if arg.split("=")[0] in ("--device", "--dtype"):
            raise SystemExit(
                f"--target-arg={arg}: pass the bench's own --device/--dtype instead, "
                "so transformers runs on the same device and dtype as the services"
            )


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    from bench import report
    from bench.machine import describe
    from bench.progress import log
    from bench.reference import Reference
    from bench.services import ServiceStack
    from bench.target import Specwire
    from bench.workload_context import Context
    from bench.workloads import QUICK_WORKLOADS, WORKLOADS, run_workload

    args = build_parser().parse_args(argv)
    if args.render:
        import json

        folder = Path(args.render)
        paths = report.write(json.loads((folder / "results.json").read_text()), folder)
        log("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    # SIGTERM (and SIGINT, even where a shell started us in the background with it ignored) unwinds
    # through the `finally` below, so the service processes are always stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    settings = dict(QUICK if args.quick else FULL)
    for key, value in (
        ("repeats", args.repeats),
        ("max_new_tokens", args.max_new_tokens),
        ("concurrency", args.concurrency),
        ("draft_lengths", args.draft_lengths),
    ):
        if value is not None:
            settings[key] = value
    if args.workloads:
        selected = [name.strip() for name in args.workloads.split(",") if name.strip()]
        unknown = sorted(set(selected) - set(WORKLOADS))
        if unknown:
            raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    else:
        selected = QUICK_WORKLOADS if args.quick else list(WORKLOADS)
    order = [name for name in WORKLOADS if name in selected]
    draft_name = args.draft_model or ("default-int8" if args.model == "default" else args.model)
    int8_draft = draft_name == "default-int8"  # int8 layers on the CPU, computing in float32
    if args.draft_device is None:
        args.draft_device = "cpu" if int8_draft else args.device
    check_devices(args, int8_draft)
    draft_dtype = "float32" if int8_draft else args.dtype
    # The draft-length sweep runs the draft model too, except in quick mode (its load dominates a smoke run).
    sweep_draft_model = "draft_length" in order and not args.quick
    serve_draft_model = bool(NEEDS_DRAFT_MODEL & set(order)) or sweep_draft_model
    out = Path(args.out or Path("results") / dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H-%M-%SZ"))

    started = time.perf_counter()
    meta = describe()
    log(
        f"benchmark of {args.model!r}: workloads {','.join(order)}; {settings['max_new_tokens']} new tokens, "
        f"{settings['repeats']} repeat(s); results in {out}"
    )
    stack = ServiceStack(
        args.model,
        draft_name if serve_draft_model else None,
        device=args.device,
        dtype=args.dtype,
        draft_device=args.draft_device,
        draft_dtype=draft_dtype,
        target_args=args.target_arg,
    )
    stack.start()
    try:
        # transformers loads while the services load.
        reference = Reference(args.model, args.device, args.dtype, args.draft_device, draft_dtype)
        stack.wait()
        specwire = Specwire(stack.address("target"))
        ctx = Context(
            reference=reference,
            specwire=specwire,
            stack=stack,
            repeats=settings["repeats"],
            max_new_tokens=settings["max_new_tokens"],
            quick=args.quick,
            draft_name=draft_name,
            concurrency_levels=settings["concurrency"],
            draft_lengths=settings["draft_lengths"],
            roundtrip_rounds=settings["roundtrip_rounds"],
            sweep_draft_model=sweep_draft_model,
        )
        log("warm-up: one short greedy request on each side")
        ctx.specwire.generate(ctx.prompt("chat"), do_sample=False, max_new_tokens=8)
        ctx.reference.generate(ctx.prompt("chat"), do_sample=False, max_new_tokens=8)
        workloads = {}
        for name in order:
            try:
                workloads[name] = run_workload(name, ctx)
            except KeyboardInterrupt:
                # Keep what was measured: the report is written with the rest marked as interrupted.
                log(f"interrupted during {name}: writing the results measured so far")
                for rest in order[order.index(name) :]:
                    workloads[rest] = {
                        "title": rest,
                        "status": "error",
                        "reason": "interrupted",
                        "checks": [],
                    }
                break
        if (
            "memory" in order
            and "memory" not in workloads
            or workloads.get("memory", {}).get("reason") == "interrupted"
        ):
            workloads["memory"] = run_workload("memory", ctx)
        specwire.close()
    finally:
        stack.stop()

    if stack.draft_model_error:
        draft_note = (
            f"started without a model: {draft_name!r} could not be loaded ({stack.draft_model_error}); "
            "draft-model workloads measure the transformers side only"
        )
    elif serve_draft_model:
        draft_note = f"--model {draft_name}"
    else:
        draft_note = "prompt lookup only (no workload selected needs the draft model)"
    meta.update(
        {
            "model": args.model,
            "model_id": reference.loaded.model_id,
            "draft_model": draft_name,
            "device": args.device,
            "dtype": args.dtype,
            "draft_device": args.draft_device,
            "draft_dtype": draft_dtype,
            "target_args": args.target_arg,
            "draft_service_note": draft_note,
            "quick": args.quick,
            "repeats": settings["repeats"],
            "max_new_tokens": settings["max_new_tokens"],
            "settings": settings,
            "workloads_run": order,
            "elapsed_seconds": None,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        }
    )
    results = {"meta": meta, "workloads": workloads}
    meta["elapsed_seconds"] = round(time.perf_counter() - started, 1)
    paths = report.write(results, out)
    log(f"done in {meta['elapsed_seconds']:.0f}s; wrote " + ", ".join(str(p) for p in paths.values()))
    for target in results["targets"]:
        log(
            f"target {target['name']} {target['goal']}: measured "
            f"{'n/a' if target['measured'] is None else round(target['measured'], 3)} -> "
            f"{ {True: 'met', False: 'MISSED', None: 'not measured'}[target['met']] }"
        )
    failed = [name for name, result in workloads.items() if result["status"] == "error"]
    if failed:
        log(f"workload(s) failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
