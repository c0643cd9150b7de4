"""`python -m bench.soak`: mixed load, faults and resource sampling against the three services.

  python -m bench.soak --minutes 30 --clients 8        the documented soak (SmolLM2, int8 draft model)
  python -m bench.soak --minutes 4                     a short check of the same
  python -m bench.soak --minutes 0.5 --model DIR --draft-model DIR2 --interval 1 --out DIR3   (tests)

Writes soak.json (time series, counts, targets), soak.md and soak.png into --out, prints a line per
interval, and exits 1 with one line per missed target (2 if the services could not be started).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SERVICES = ("config", "draft", "target")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the load (default 30)")
    parser.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    parser.add_argument("--model", default="default", help="target model (default: the embedded SmolLM2-135M)")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="draft service model (default: default-int8 for the default model, else the target model)",
    )
    parser.add_argument("--device", default="cpu", help="target device (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--interval", type=float, default=10.0, help="seconds between resource samples and progress lines (default 10)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=24, help="new tokens of a normal request (default 24)")
    parser.add_argument(
        "--request-timeout", type=float, default=120.0, help="deadline of a normal request, seconds (default 120)"
    )
    parser.add_argument(
        "--hostile-timeout",
        type=float,
        default=30.0,
        help="deadline of a bad or over-limit request, which should be refused at once (default 30)",
    )
    parser.add_argument("--no-faults", action="store_true", help="no draft kill, no config restart")
    parser.add_argument(
        "--skip", default="", help="comma-separated request kinds to leave out (see bench.soak.kinds.EXPECTED)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    parser.add_argument("--out", default=None, help="results folder (default bench/results/soak-<UTC date-time>)")
    parser.add_argument(
        "--target-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra target-service option, repeatable (e.g. --target-arg=--max-queued=64)",
    )
    parser.add_argument("--render", metavar="DIR", help="only redraw DIR/soak.md and soak.png from DIR/soak.json")
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    from bench.soak import report

    args = build_parser().parse_args(argv)
    if args.render:
        import json

        from bench.soak import evaluate

        folder = Path(args.render)
        results = json.loads((folder / "soak.json").read_text())
        evaluate.evaluate(results)  # the targets as the code defines them now
        report.write(results, folder)
        return 0
    from bench.soak.kinds import EXPECTED

    skip = {kind.strip() for kind in args.skip.split(",") if kind.strip()}
    if unknown := skip - set(EXPECTED):
        raise SystemExit(f"--skip: unknown kind(s) {sorted(unknown)}; choose from {sorted(EXPECTED)}")
    if args.minutes <= 0 or args.clients < 1 or args.interval <= 0:
        raise SystemExit("--minutes, --clients and --interval must be positive")
    # SIGTERM (and SIGINT, even where a shell started us in the background with it ignored) unwinds
    # through the `finally` of `run`, so the services are always stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    out = Path(args.out or Path("bench/results") / dt.datetime.now(dt.UTC).strftime("soak-%Y-%m-%dT%H-%M-%SZ"))
    return run(args, skip, out)


def run(args: argparse.Namespace, skip: set[str], out: Path) -> int:
    from bench.machine import describe
    from bench.progress import log
    from bench.services import ServiceFailed, ServiceStack
    from bench.soak import evaluate, report
    from bench.soak.faults import FaultInjector, schedule
    from bench.soak.kinds import REGISTRY_CONFIGS, ModelFacts, mix
    from bench.soak.load import ClientPool, Recorder
    from bench.soak.monitor import HealthProbe, read_process
    from specwire.client import ConfigClient, TargetClient

    draft_name = args.draft_model or ("default-int8" if args.model == "default" else args.model)
    duration = args.minutes * 60.0
    meta = describe("bench.soak")
    stack = ServiceStack(
        args.model,
        draft_name,
        device=args.device,
        dtype=args.dtype,
        draft_dtype="float32" if draft_name == "default-int8" else args.dtype,
        target_args=args.target_arg,
        timeout=600.0,
        log_dir=Path(tempfile.mkdtemp(prefix="specwire-soak-")),
    )
    log(
        f"soak of {args.model!r} (draft {draft_name!r}): {args.minutes:g} min, {args.clients} clients; results in {out}"
    )
    samples: list[dict] = []
    intervals: list[dict] = []
    deaths: list[dict] = []
    recorder = Recorder()
    injector = pool = None
    probes: dict[str, HealthProbe] = {}
    stack.start()
    try:
        try:
            stack.wait()
        except ServiceFailed as error:
            log(f"services did not start: {error}")
            return 2
        with ConfigClient(stack.address("config")) as registry:
            for name, config in REGISTRY_CONFIGS.items():
                registry.create(name, config)
                registry.set_tag(name, "prod", 1)
        with TargetClient(stack.address("target"), timeout=60) as target:
            info = target.model_info()
        # `limits` exists once the target reports its request limits (GetModelInfo).
        limits = getattr(info, "limits", None)
        facts = ModelFacts(info.vocab_size, info.max_position_embeddings, getattr(limits, "max_output_bytes", 0))
        weights, left_out = mix(facts, skip)
        for kind, why in left_out.items():
            if kind not in skip:
                log(f"kind {kind} left out: {why}")
        probes = {name: HealthProbe(stack.address(name)) for name in SERVICES}

        def sample(t: float, phase: str) -> list[dict]:
            rows = []
            for name in SERVICES:
                process = stack.services[name].process
                values = read_process(process.pid) if process.poll() is None else None
                row = {"t": round(t, 2), "phase": phase, "service": name, "pid": process.pid}
                row.update(values or {"rss_kib": None, "threads": None, "fds": None, "thread_names": None})
                row["health"] = probes[name].check()
                rows.append(row)
            samples.extend(rows)
            return rows

        idle_before = sample(0.0, "idle_before")
        started = time.monotonic()
        plan = [] if args.no_faults else schedule(duration, args.minutes)
        injector = FaultInjector(stack, stack._env(), started, plan)
        pool = ClientPool(
            stack.address("target"),
            args.clients,
            weights,
            facts,
            started,
            duration,
            args.seed,
            args.max_new_tokens,
            args.request_timeout,
            args.hostile_timeout,
            recorder,
            injector,
        )
        injector.start()
        pool.start()
        tick = 0
        while True:
            tick += 1
            next_t = min(tick * args.interval, duration)
            time.sleep(max(0.0, next_t - (time.monotonic() - started)))
            t = time.monotonic() - started
            rows = sample(t, "load")
            # The processes were read after `t`, up to now: a fault that began meanwhile explains a gone one.
            read_until = time.monotonic() - started
            for row in rows:
                gone = row["rss_kib"] is None and not injector.down_during(row["service"], t, read_until)
                if gone and not any(d["pid"] == row["pid"] for d in deaths):
                    deaths.append({"service": row["service"], "pid": row["pid"], "t": round(t, 1)})
            intervals.append(recorder.take_interval(t))
            log(report.progress_line(rows, intervals[-1], recorder))
            if next_t >= duration:
                break
            if any(d["service"] == "target" for d in deaths[-1:]):
                log("the target service is gone: ending the load early")
                break
        # Requests in flight end by their own deadline; a fault under way by its restart timeout.
        stuck = pool.join(args.request_timeout + 15)
        injector.stop(injector.restart_timeout_s + 60)
        last = recorder.take_interval(time.monotonic() - started)
        if last["by_outcome"]:
            last["after_load"] = True  # requests in flight at the end, drained by their deadlines
            intervals.append(last)
        # Idle again: what the services hold once the load is gone (leaked threads stay).
        threading.Event().wait(min(10.0, 2 * args.interval))
        idle_after = sample(time.monotonic() - started, "idle_after")
        health_at_end = {row["service"]: row["health"] for row in idle_after}
        elapsed = time.monotonic() - started
    except KeyboardInterrupt:
        log("interrupted: stopping the services, no report")
        return 130
    finally:
        if pool is not None:
            pool.stop_event.set()
        if injector is not None:
            injector.stop_event.set()
        for probe in probes.values():
            probe.close()
        stack.stop()

    meta.update(
        {
            "model": args.model,
            "model_id": info.model_id,
            "vocab_size": facts.vocab_size,
            "max_position_embeddings": facts.max_position_embeddings,
            "max_output_bytes": facts.max_output_bytes,
            "draft_model": draft_name,
            "draft_service_note": stack.draft_model_error or "",
            "device": args.device,
            "dtype": args.dtype,
            "target_args": args.target_arg,
            "minutes": args.minutes,
            "clients": args.clients,
            "interval_s": args.interval,
            "max_new_tokens": args.max_new_tokens,
            "request_timeout_s": args.request_timeout,
            "hostile_timeout_s": args.hostile_timeout,
            "seed": args.seed,
            "elapsed_s": round(elapsed, 1),
            "warmup_s": evaluate.warmup_seconds(duration),
            "service_logs": str(stack.log_dir),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        }
    )
    results = {
        "meta": meta,
        "mix": {"weights": weights, "left_out": left_out},
        "samples": samples,
        "idle": {"before": idle_before, "after": idle_after},
        "intervals": intervals,
        "requests": report.request_totals(recorder),
        "faults": [record.to_json() for record in injector.records],
        "fault_plan": [{"at_s": round(at, 1), "fault": name} for at, name in plan],
        "unexpected_exits": deaths,
        "health_at_end": health_at_end,
        "client_crashes": pool.crashes + [f"{name} still running after the load" for name in stuck],
    }
    evaluate.evaluate(results)
    paths = report.write(results, out)
    log("wrote " + ", ".join(str(p) for p in paths))
    missed = evaluate.misses(results["targets"])
    if results["client_crashes"]:
        missed.append("MISSED soak client: " + "; ".join(results["client_crashes"]))
    for line in missed:
        print(line, file=sys.stderr)
    if not missed:
        log("every target met")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
