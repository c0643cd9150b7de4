"""`python -m bench.tracing`: throughput with OpenTelemetry tracing and metrics on versus off, in one run.

Starts two identical service stacks (config, draft, target) on loopback: one with no telemetry
(`OTEL_SDK_DISABLED=true`, the default of an unconfigured process), one exporting every span and
metric over OTLP/gRPC to an in-process receiver (sampler `always_on`, metrics every 5 s) and serving
the Prometheus endpoint. Requests alternate between the stacks (ABBA order, so drift hits both
alike), one at a time, so only one stack computes at any moment; every service runs one torch thread.
Each workload runs a fixed number of new tokens (`min_new_tokens = max_new_tokens`). The headline is
the median over all back-to-back (off, on) pairs of tokens/s on / off (target: at least 0.97): on a
shared machine other jobs change the speed many-fold within minutes, which a pair shares and sums over
a whole run do not; the summed ratio and tokens per CPU second are reported as well.

  python -m bench.tracing                    embedded SmolLM2, 32 new tokens, 12 pairs per workload
  python -m bench.tracing --quick            CI-sized: 16 new tokens, 3 pairs per workload
  python -m bench.tracing --model PATH --max-new-tokens 128 --repeats 10 --json out.json

Workloads: greedy (plain decoding, chat prompt) and prompt_lookup (speculative rounds, run by the
target itself: a span per round, the speculation counters).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TELEMETRY_VARIABLES = ("OTEL_", "SPECWIRE_PROMETHEUS_")


def _without_telemetry(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(TELEMETRY_VARIABLES)}


def _stack_class():
    from bench.services import ServiceStack

    @dataclass
    class TelemetryStack(ServiceStack):
        """`bench.services.ServiceStack` whose services get `telemetry_env` (and no other OTEL_* setting)."""

        telemetry_env: dict[str, str] = field(default_factory=dict)
        threads: str = "1"

        def _env(self) -> dict[str, str]:
            # One torch thread per service: on a shared machine, oversubscribed OpenMP threads spin and
            # stall unpredictably; single-threaded services slow down alike on both sides.
            env = {**_without_telemetry(super()._env()), "OMP_NUM_THREADS": self.threads}
            return {**env, **self.telemetry_env}

    return TelemetryStack


@dataclass
class Workload:
    name: str
    prompt: str
    kwargs: dict


def workloads(max_new_tokens: int) -> list[Workload]:
    from bench.prompts import CHAT_PROMPT, CODE_EDIT_PROMPT

    fixed = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "do_sample": False}
    return [
        Workload("greedy", CHAT_PROMPT, {**fixed, "proposer": "none"}),
        Workload(
            "prompt_lookup",
            CODE_EDIT_PROMPT,
            {**fixed, "proposer": "prompt_lookup", "prompt_lookup_num_tokens": 10},
        ),
    ]


def timed(client, workload: Workload) -> tuple[float, object]:
    started = time.perf_counter()
    output = client.generate(text=workload.prompt, apply_chat_template=True, **workload.kwargs)
    seconds = time.perf_counter() - started
    return seconds, output


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tracing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="default", help="target model (default: embedded SmolLM2-135M)")
    parser.add_argument("--quick", action="store_true", help="CI-sized: 16 new tokens, 3 pairs per workload")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (default 32)")
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs per workload (default 12)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    max_new_tokens = args.max_new_tokens or (16 if args.quick else 32)
    repeats = args.repeats or (3 if args.quick else 12)

    from bench.progress import log
    from specwire.client import TargetClient
    from specwire.client.stats import acceptance, fetch
    from tests.otlp_sink import OtlpSink

    stack_class = _stack_class()
    with OtlpSink() as sink:
        stacks = {
            "off": stack_class(args.model, telemetry_env={"OTEL_SDK_DISABLED": "true"}),
            "on": stack_class(
                args.model,
                telemetry_env={
                    "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
                    "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                    "OTEL_TRACES_SAMPLER": "always_on",
                    "OTEL_METRIC_EXPORT_INTERVAL": "5000",
                    "SPECWIRE_PROMETHEUS_PORT": "0",
                },
            ),
        }
        for name, stack in stacks.items():
            log(f"starting the tracing-{name} stack")
            stack.start()
        prometheus = None
        try:
            for stack in stacks.values():
                stack.wait()
            clients = {name: TargetClient(stack.address("target")) for name, stack in stacks.items()}
            pids = {
                name: [service.process.pid for service in stack.services.values()] for name, stack in stacks.items()
            }
            results = run(clients, workloads(max_new_tokens), repeats, log, pids)
            for client in clients.values():
                client.close()
            prometheus = _prometheus_url(stacks["on"].services["target"].log_path)
            time.sleep(0.5)
            spans = sink.spans()
            services = sorted({resource.get("service.name", "?") for resource, _ in spans})
            results["exported"] = {
                "spans": len(spans),
                "services": services,
                "metric_names": sorted(sink.metric_names()),
                "prometheus": prometheus,
            }
            if prometheus:
                groups = acceptance([fetch(prometheus)])
                results["acceptance"] = [g.to_dict() for g in groups]
        finally:
            for stack in stacks.values():
                stack.stop()

    print(report(results, args.model, max_new_tokens, repeats))
    if results.get("acceptance"):
        print(f"\nspeculation on the tracing-on target (`specwire stats --prometheus {prometheus}`):")
        for g in results["acceptance"]:
            if g["acceptance_rate"] is not None:
                print(
                    f"  {g['proposer']} / {g['config']}: acceptance rate {g['acceptance_rate']:.3f}, "
                    f"mean acceptance length {g['mean_acceptance_length']:.3f}"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes (all their threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def run(clients: dict, loads: list[Workload], repeats: int, log, pids: dict[str, list[int]] | None = None) -> dict:
    """Warm both sides up, then alternate timed requests ABBA; tokens/s per workload and side.

    Besides wall-clock tokens/s, each side's services' CPU seconds over the whole timed phase (their
    exporters' background threads included) give tokens per CPU second: on a shared, busy machine that
    figure is far less disturbed by other processes than wall-clock time.
    """
    from bench.target import speculation_unavailable

    pids = pids or {side: [] for side in clients}
    per: dict[str, dict] = {}
    all_pairs: list[float] = []
    for workload in loads:
        for client in clients.values():  # warm-up (untimed): caches, first-call costs
            timed(client, workload)
        totals: dict = {side: {"seconds": 0.0, "tokens": 0, "tokens_per_s_runs": []} for side in clients}
        cpu_before = {side: cpu_seconds(pids[side]) for side in clients}
        pairs = []
        for repeat in range(repeats):
            order = ["off", "on"] if repeat % 2 == 0 else ["on", "off"]
            rates = {}
            for side in order:
                seconds, output = timed(clients[side], workload)
                tokens = workload.kwargs["max_new_tokens"]
                unavailable = workload.kwargs["proposer"] != "none" and speculation_unavailable(output)
                if unavailable:
                    log(f"{workload.name}/{side}: {unavailable}")
                totals[side]["seconds"] += seconds
                totals[side]["tokens"] += tokens
                rates[side] = tokens / seconds
                totals[side]["tokens_per_s_runs"].append(round(rates[side], 3))
            pairs.append(rates["on"] / rates["off"])
            log(f"{workload.name} {repeat + 1}/{repeats}: off {rates['off']:.2f}, on {rates['on']:.2f} tok/s")
        all_pairs += pairs
        for side in clients:
            t = totals[side]
            t["tokens_per_s"] = t["tokens"] / t["seconds"]
            t["cpu_seconds"] = cpu_seconds(pids[side]) - cpu_before[side]
            t["tokens_per_cpu_s"] = t["tokens"] / t["cpu_seconds"] if t["cpu_seconds"] > 0 else None
        totals["ratio_on_off"] = totals["on"]["tokens_per_s"] / totals["off"]["tokens_per_s"]
        totals["median_paired_ratio"] = statistics.median(pairs)
        on_cpu, off_cpu = totals["on"]["tokens_per_cpu_s"], totals["off"]["tokens_per_cpu_s"]
        totals["cpu_ratio_on_off"] = on_cpu / off_cpu if on_cpu and off_cpu else None
        off, on = totals["off"]["tokens_per_s"], totals["on"]["tokens_per_s"]
        log(
            f"{workload.name}: off {off:.2f} tok/s, on {on:.2f} tok/s, ratio {totals['ratio_on_off']:.3f} "
            f"(median paired {totals['median_paired_ratio']:.3f}, CPU {_fmt(totals['cpu_ratio_on_off'])})"
        )
        per[workload.name] = totals
    seconds = {side: sum(per[w.name][side]["seconds"] for w in loads) for side in clients}
    tokens = {side: sum(per[w.name][side]["tokens"] for w in loads) for side in clients}
    cpu = {side: sum(per[w.name][side]["cpu_seconds"] for w in loads) for side in clients}
    return {
        "workloads": per,
        "median_paired_ratio": statistics.median(all_pairs),
        "pairs": len(all_pairs),
        "overall_ratio_on_off": (tokens["on"] / seconds["on"]) / (tokens["off"] / seconds["off"]),
        "overall_cpu_ratio_on_off": (tokens["on"] / cpu["on"]) / (tokens["off"] / cpu["off"])
        if cpu["on"] > 0 and cpu["off"] > 0
        else None,
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _prometheus_url(log_path: Path) -> str | None:
    try:
        found = re.search(r"Prometheus metrics on (http://\S+/metrics)", log_path.read_text(errors="replace"))
    except OSError:
        return None
    return found.group(1) if found else None


def report(results: dict, model: str, max_new_tokens: int, repeats: int) -> str:
    lines = [
        f"tracing overhead: model {model}, {max_new_tokens} new tokens per request, {repeats} timed "
        "requests per workload and side",
        "",
        "| workload | tracing off tok/s | tracing on tok/s | on / off | median paired on / off "
        "| on / off per CPU second |",
        "|---|---|---|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        lines.append(
            f"| {name} | {w['off']['tokens_per_s']:.2f} | {w['on']['tokens_per_s']:.2f} | "
            f"{w['ratio_on_off']:.3f} | {w['median_paired_ratio']:.3f} | "
            f"{_fmt(w['cpu_ratio_on_off'])} |"
        )
    ratio = results["median_paired_ratio"]
    lines += [
        "",
        f"throughput ratio, tracing on / off (median of {results['pairs']} back-to-back pairs): {ratio:.3f} "
        f"(target >= 0.97: {'met' if ratio >= 0.97 else 'NOT met'})",
        f"summed tokens / summed seconds: {results['overall_ratio_on_off']:.3f}; per CPU second: "
        f"{_fmt(results['overall_cpu_ratio_on_off'])} (both swing with other load on a shared machine)",
    ]
    exported = results.get("exported", {})
    lines.append(
        f"exported over OTLP by the tracing-on stack: {exported.get('spans', 0)} spans from "
        f"{', '.join(exported.get('services', [])) or 'no service'}; "
        f"{len(exported.get('metric_names', []))} metric names"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
