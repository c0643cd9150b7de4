"""Replicas: do two target replicas behind the load-balanced client serve twice the tokens of one?

  python -m bench.scale                                   # embedded SmolLM2, 8 clients, a few minutes
  python -m bench.scale --quick --model PATH              # smoke run on a small model (CI: a tiny one)
  python -m bench.scale --cores 0-3,4-7 --json bench/results/scale.json
  python -m bench.scale --tp [--quick --model PATH]       # TP=2 against TP=1 instead (bench/scale_tp.py)

Starts two target services (each its own process, as deployed), each pinned with `taskset` to its own
share of the cores (default: this process's cores split in two halves; `--cores` names them) with as
many torch threads as it has cores. Then, in alternating phases (so that drift in the machine's load
hits both alike):

- `1 replica`: 8 concurrent clients dial `ipv4:127.0.0.1:A` (one replica; the other idles on its
  own cores), each sending `--requests` greedy requests of exactly `--max-new-tokens` tokens;
- `2 replicas`: the same clients dial `ipv4:127.0.0.1:A,127.0.0.1:B`: each client's channel
  balances its calls over both replicas (`round_robin`, the default for an address list).

Every client is its own `TargetClient` (its own channel), as separate client processes would be.
Throughput = generated tokens / wall time. Reports tokens/s of each phase and the ratio 2 : 1 (ideal
2.0 when the replicas do not share cores and the clients are not the bottleneck), plus each replica's
share of the requests read from its own Prometheus endpoint. The clients run in this process,
unpinned: on a small machine they take CPU from the replicas, which lowers the ratio (stated in the
results with the core split).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.concurrency_scheduler import PROMPTS, _chat_ids  # noqa: E402 - after the offline settings
from bench.services import Service, free_port, wait_healthy  # noqa: E402

REQUESTS_METRIC = "gen_ai_server_request_duration_seconds_count"
FULL = {"requests": 4, "max_new_tokens": 64, "rounds": 2}
CONNECT_SETTLE_S = 0.5  # connecting to a loopback replica takes milliseconds
QUICK = {"requests": 1, "max_new_tokens": 16, "rounds": 1}


def parse_cores(text: str) -> list[list[int]]:
    """`0-3,4-7` or `0,1`: one core list per replica (`a-b` is a range)."""
    groups = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        groups.append(list(range(int(first), int(last or first) + 1)))
    if len(groups) != 2 or set(groups[0]) & set(groups[1]):
        raise SystemExit(f"--cores needs two disjoint core ranges, e.g. 0-3,4-7; got {text!r}")
    return groups


def split_cores() -> list[list[int]]:
    """This process's cores in two halves (two replicas on one core share it: refused)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("bench.scale needs 2 cores or more: each replica gets its own")
    half = len(cores) // 2
    return [cores[:half], cores[half : 2 * half]]


@dataclass
class PinnedService(Service):
    """A `Service` started under `taskset -c CORES`, with as many torch threads as cores."""

    cores: list[int] = field(default_factory=list)

    def start(self, env: dict[str, str]) -> None:
        self.log_file = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", self.module, "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        cores = ",".join(map(str, self.cores))
        env = {**env, "OMP_NUM_THREADS": str(len(self.cores))}
        self.process = subprocess.Popen(
            [shutil.which("taskset") or "taskset", "-c", cores, *command],
            env=env,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
        )


def served(metrics_port: int) -> int:
    """Generation requests a replica has finished, from its Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return int(
        sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == REQUESTS_METRIC)
    )


def phase(target: str, prompts: list[list[int]], clients: int, requests: int, max_new_tokens: int) -> dict:
    """`clients` concurrent clients of `target`, each sending `requests` requests: tokens and wall time."""
    import grpc

    from specwire.client import TargetClient

    tokens = [0] * clients
    errors: list[BaseException] = []
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        try:
            with TargetClient(target) as client:
                # A fresh round_robin channel sends its first calls to the first replica that connects:
                # let every replica connect before the clock starts, as a long-lived client would have.
                grpc.channel_ready_future(client.channel).result(60)
                time.sleep(CONNECT_SETTLE_S)
                barrier.wait(60)
                for j in range(requests):
                    prompt = prompts[(i + j * clients) % len(prompts)]
                    out = client.generate(
                        [prompt], max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
                    )
                    tokens[i] += out.sequences.shape[1] - len(prompt)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            if not barrier.broken:
                barrier.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait(120)
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return {"tokens": sum(tokens), "wall_s": wall}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="'default' (embedded SmolLM2), a folder, a .gguf file")
    parser.add_argument("--quick", action="store_true", help="smoke mode: 1 request per client, 16 tokens, 1 round")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=None, help=f"per client per phase (default {FULL['requests']})")
    parser.add_argument("--max-new-tokens", type=int, default=None, help=f"default {FULL['max_new_tokens']}")
    parser.add_argument("--rounds", type=int, default=None, help=f"alternating rounds (default {FULL['rounds']})")
    parser.add_argument("--cores", default=None, help="two disjoint core ranges, e.g. 0-3,4-7 (default: halves)")
    parser.add_argument(
        "--json", default=None, help="where to write the figures (+ .md); default bench/results/scale[_tp].json"
    )
    parser.add_argument(
        "--tp",
        action="store_true",
        help="measure tensor parallelism instead: TP=2 against TP=1 on the CPU, same requests, outputs compared "
        "(see bench/scale_tp.py; its default model is SmolLM2-shaped with 8/4 heads, --model overrides)",
    )
    parser.add_argument(
        "--tp-scheduler",
        default="batched",
        choices=["batched", "sequential"],
        help="with --tp: the scheduler of both targets (default batched, the service's default)",
    )
    return parser


def start_replicas(model: str, cores: list[list[int]], logs: Path) -> list[tuple[PinnedService, int]]:
    """One target process per core group, pinned to it, each with a Prometheus port: (service, port)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = []
    for i, group in enumerate(cores):
        replica = PinnedService(
            "target-service", "specwire.target_service", ["--model", model], free_port(), logs / f"target-{i}.log"
        )
        replica.cores = group
        metrics_port = free_port()
        started.append((replica, metrics_port))
        replica.start({**env, "SPECWIRE_PROMETHEUS_PORT": str(metrics_port)})
    return started


def measure(replicas, prompts, clients: int, requests: int, max_new_tokens: int, rounds: int) -> dict:
    """The alternating phases: tokens and wall time of each, each round's tokens/s, the 2-replica shares."""
    metrics_ports = [port for _, port in replicas]
    targets = {
        "1 replica": f"ipv4:{replicas[0][0].address}",
        "2 replicas": "ipv4:" + ",".join(r.address for r, _ in replicas),
    }
    for target in targets.values():  # warm-up of every replica, not counted
        phase(target, prompts, clients, 1, max_new_tokens)
    totals = {name: {"tokens": 0, "wall_s": 0.0, "round_tokens_per_s": []} for name in targets}
    shares = [0, 0]  # requests each replica served in the `2 replicas` phases
    for round_ in range(rounds):
        for name, target in targets.items():
            before = [served(p) for p in metrics_ports]
            run = phase(target, prompts, clients, requests, max_new_tokens)
            if name == "2 replicas":
                shares = [s + served(p) - b for s, p, b in zip(shares, metrics_ports, before, strict=True)]
            speed = run["tokens"] / run["wall_s"]
            print(f"round {round_ + 1} {name:>10}: {run['tokens']} tokens, {speed:.1f} tokens/s", flush=True)
            totals[name]["tokens"] += run["tokens"]
            totals[name]["wall_s"] += run["wall_s"]
            totals[name]["round_tokens_per_s"].append(speed)
    for total in totals.values():
        total["tokens_per_s"] = total["tokens"] / total["wall_s"]
    return {"phases": totals, "requests_per_replica_2_replicas": shares}


def report(results: dict, path: Path) -> None:
    """Print the Markdown table and write `path` (JSON) and its `.md`."""
    phases = results["phases"]
    cores = " | ".join(",".join(map(str, group)) for group in results["replica_cores"])
    shares = results["requests_per_replica_2_replicas"]
    lines = [
        f"# Replicas ({results['model']}, {results['clients']} greedy clients x {results['requests_per_client']} x "
        f"{results['max_new_tokens']} tokens, {results['rounds']} rounds, replica cores {cores}, clients unpinned)",
        "",
        "| phase | tokens/s |",
        "|---|---:|",
        *(f"| {name} | {phase['tokens_per_s']:.1f} |" for name, phase in phases.items()),
        "",
        f"Ratio 2 : 1 = {results['ratio_2_to_1']:.2f} (median of round ratios {results['median_round_ratio']:.2f}); "
        f"requests per replica with 2: {shares[0]} / {shares[1]}.",
    ]
    write(results, "\n".join(lines) + "\n", path)


def write(results: dict, markdown: str, path: Path) -> None:
    """Print the Markdown and write `path` (JSON) and its `.md`."""
    print(markdown)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.tp:
        from bench import scale_tp

        model = scale_tp.SHAPED if args.model == "default" else args.model
        results = scale_tp.run(model, args.quick, args.requests, args.max_new_tokens, args.rounds, args.tp_scheduler)
        write(results, scale_tp.report_markdown(results), Path(args.json or "bench/results/scale_tp.json"))
        return results
    preset = QUICK if args.quick else FULL
    requests = args.requests or preset["requests"]
    max_new_tokens = args.max_new_tokens or preset["max_new_tokens"]
    rounds = args.rounds or preset["rounds"]
    cores = parse_cores(args.cores) if args.cores else split_cores()

    from specwire.models import load_model

    tokenizer = load_model(args.model, progress=False).tokenizer  # prompt ids only; the model runs in the targets
    prompts = [_chat_ids(tokenizer, text) for text in PROMPTS]
    replicas: list[tuple[PinnedService, int]] = []
    try:
        replicas = start_replicas(args.model, cores, Path(tempfile.mkdtemp(prefix="specwire-bench-scale-")))
        for replica, _ in replicas:
            wait_healthy(replica, 900)
        measured = measure(replicas, prompts, args.clients, requests, max_new_tokens, rounds)
    finally:
        for replica, _ in replicas:
            replica.stop()
    phases = measured["phases"]
    results = {
        "model": args.model,
        "quick": args.quick,
        "clients": args.clients,
        "requests_per_client": requests,
        "max_new_tokens": max_new_tokens,
        "rounds": rounds,
        "cpu_count": os.cpu_count(),
        "replica_cores": cores,
        "clients_pinned": False,
        **measured,
        "ratio_2_to_1": phases["2 replicas"]["tokens_per_s"] / phases["1 replica"]["tokens_per_s"],
        "median_round_ratio": statistics.median(
            two / one
            for two, one in zip(
                phases["2 replicas"]["round_tokens_per_s"], phases["1 replica"]["round_tokens_per_s"], strict=True
            )
        ),
    }
    report(results, Path(args.json or "bench/results/scale.json"))
    return results


if __name__ == "__main__":
    main()
