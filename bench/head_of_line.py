"""Head-of-line blocking: do batched requests keep their throughput while one request's draft service hangs?

  python -m bench.head_of_line                      # embedded SmolLM2, 8 clients, a few minutes at most
  python -m bench.head_of_line --rounds 1 --json bench/results/head_of_line.json
  python -m bench.head_of_line --target-pythonpath /work/main   # the same against another checkout

Starts a target service (its own process, `--draft-timeout` 5 s, as deployed) whose draft service is a
stand-in that accepts every `Draft` stream and never answers: a hung draft pod. Then, in alternating
phases (so that drift in the machine's load hits every phase alike):

- `alone`: 8 concurrent clients, each sending `--requests` greedy requests of exactly
  `--max-new-tokens` tokens back to back (no speculation);
- `hung draft (batched)`: the same, while one more client keeps a request with
  `proposer=draft_model` running, one after the other: each waits its whole draft timeout on the hung
  stand-in (the case of issue #17's item 5);
- `hung draft (lane)`: the same, with the extra request in the scheduler's sequential lane (longer
  than a KV slot: the target runs with `--slot-tokens 96`, which the 8 clients' requests fit),
  whose loop used to run on the scheduler thread.

The extra request is made cheap on purpose (a 4-token text prompt, one row, at least 8 new tokens so
that it reaches its first draft round, and a deadline of the draft timeout + 0.5 s, so that it ends
soon after its draft wait): what it costs the others is then its waiting, not its own forwards. (With
a 45-token chat prompt and no deadline, an earlier version of this bench measured 0.83 for the
batched case after the fix: on 2 CPU cores, that request's prefill and decoding are real work.)

Throughput = the 8 clients' generated tokens / wall time (the extra request's tokens not counted).
Reports each scenario's throughput and its ratio to `alone` (target: >= 0.90), as JSON and Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.concurrency_scheduler import PROMPTS, _chat_ids  # noqa: E402 - after the offline settings

SLOT_TOKENS = 96  # the clients' requests (prompts of <= 48 tokens + 32) fit a slot; the lane request does not
DRAFT_TIMEOUT_S = 5.0
EXTRA_PROMPT = "The quick brown fox"


class HungDraftService:
    """A DraftService on a loopback port that accepts every stream, reads its requests and never answers
    (a hung pod); served from a background event loop, so the tests use it too."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="hung-draft")
        self.thread.start()
        self.streams = 0
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        self.address = f"127.0.0.1:{self.port}"

    async def _start(self) -> int:
        import grpc

        from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc

        outer = self

        class Hung(pb_grpc.DraftServiceServicer):
            async def Draft(self, request_iterator, context):  # noqa: N802 - the gRPC method name
                outer.streams += 1
                async for _ in request_iterator:  # until the target cancels the stream
                    pass
                return
                yield  # an async generator that never yields: no answer ever

        self.server = grpc.aio.server()
        pb_grpc.add_DraftServiceServicer_to_server(Hung(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __enter__(self) -> HungDraftService:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _phase(address: str, prompts: list[list[int]], clients: int, requests: int, max_new_tokens: int, extra) -> dict:
    """8 clients' throughput; `extra(target, stop)` runs in one more thread meanwhile (None: alone)."""
    import grpc

    from specwire.client import SpecwireRpcError, TargetClient

    tokens = [0] * clients
    errors: list[BaseException] = []
    barrier = threading.Barrier(clients + 1 + (extra is not None))
    stop = threading.Event()
    extra_done = [0]

    def client(i: int) -> None:
        try:
            with TargetClient(address) as target:
                barrier.wait(60)
                for j in range(requests):
                    prompt = prompts[(i + j * clients) % len(prompts)]
                    out = target.generate(
                        [prompt], max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
                    )
                    tokens[i] += out.sequences.shape[1] - len(prompt)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            if not barrier.broken:
                barrier.abort()

    def run_extra() -> None:
        try:
            with TargetClient(address) as target:
                barrier.wait(60)
                while not stop.is_set():
                    try:
                        out = extra(target)
                        assert "draft" in out.speculation.fallback_reason, out.speculation.fallback_reason
                    except SpecwireRpcError as exc:  # its deadline, right after its draft wait
                        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                            raise
                    extra_done[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            if not barrier.broken:
                barrier.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    if extra is not None:
        extra_thread = threading.Thread(target=run_extra)
        extra_thread.start()
    for t in threads:
        t.start()
    barrier.wait(120)
    started = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    stop.set()
    if extra is not None:
        extra_thread.join(120)
    if errors:
        raise errors[0]
    return {"tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall, "extra_requests": extra_done[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.head_of_line", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="'default' (embedded SmolLM2), a folder, a .gguf file")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="requests per client per phase (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the phases (default 2)")
    parser.add_argument("--no-lane", action="store_true", help="skip the sequential-lane scenario")
    parser.add_argument("--target-pythonpath", default=None, help="run the target from this checkout instead")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the target (OMP_NUM_THREADS; default: torch's choice). On a machine shared "
        "with other work, 1 keeps OpenMP's spinning out of the figures",
    )
    parser.add_argument("--json", default="bench/results/head_of_line.json", help="where to write the figures")
    args = parser.parse_args(argv)

    from bench.services import Service, free_port, wait_healthy
    from specwire.models import load_model

    tokenizer = load_model(args.model, progress=False).tokenizer  # prompt ids only; the model runs in the target
    prompts = [_chat_ids(tokenizer, text) for text in PROMPTS]
    hung = HungDraftService()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if args.target_pythonpath:
        env["PYTHONPATH"] = args.target_pythonpath
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    server = Service(
        "target-service",
        "specwire.target_service",
        [
            "--model",
            args.model,
            "--draft-address",
            hung.address,
            "--draft-timeout",
            str(DRAFT_TIMEOUT_S),
            "--slot-tokens",
            str(SLOT_TOKENS),
        ],
        free_port(),
        Path(tempfile.mkdtemp(prefix="specwire-bench-")) / "target.log",
    )
    server.start(env)

    extra_deadline = DRAFT_TIMEOUT_S + 0.5
    # A few plain-text tokens (no EOS can end it before its first draft round: min_new_tokens).
    extra_prompt = list(tokenizer(EXTRA_PROMPT)["input_ids"])

    def hung_batched(target):
        return target.generate(
            [extra_prompt],
            max_new_tokens=16,
            min_new_tokens=8,
            do_sample=False,
            proposer="draft_model",
            timeout=extra_deadline,
        )

    def hung_lane(target):  # max_length 100 > 96 slot tokens: the sequential lane
        return target.generate(
            [extra_prompt],
            max_new_tokens=SLOT_TOKENS,
            min_new_tokens=8,
            do_sample=False,
            proposer="draft_model",
            timeout=extra_deadline,
        )

    scenarios = {"alone": None, "hung draft (batched)": hung_batched}
    if not args.no_lane:
        scenarios["hung draft (lane)"] = hung_lane
    totals = {name: {"tokens": 0, "wall_s": 0.0, "extra_requests": 0, "draft_streams": 0} for name in scenarios}
    per_round: dict[str, list[float]] = {name: [] for name in scenarios}  # tokens/s of each round
    try:
        wait_healthy(server, 900)
        _phase(server.address, prompts, args.clients, 1, args.max_new_tokens, None)  # warm-up, not counted
        for round_ in range(args.rounds):
            for name, extra in scenarios.items():
                streams = hung.streams
                run = _phase(server.address, prompts, args.clients, args.requests, args.max_new_tokens, extra)
                run["draft_streams"] = hung.streams - streams
                print(
                    f"round {round_ + 1} {name:>22}: {run['tokens']} tokens in {run['wall_s']:.2f}s = "
                    f"{run['tokens_per_s']:.1f} tokens/s ({run['extra_requests']} hung-draft requests)",
                    flush=True,
                )
                for key in totals[name]:
                    totals[name][key] += run[key]
                per_round[name].append(run["tokens_per_s"])
    finally:
        server.stop()
        hung.stop()
    alone = totals["alone"]["tokens"] / totals["alone"]["wall_s"]
    results = {
        "model": args.model,
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "draft_timeout_s": DRAFT_TIMEOUT_S,
        "target_pythonpath": args.target_pythonpath,
        "target_threads": args.threads,
        "cpu_count": os.cpu_count(),
        "scenarios": {
            name: {
                **total,
                "tokens_per_s": total["tokens"] / total["wall_s"],
                "ratio_to_alone": total["tokens"] / total["wall_s"] / alone,
                # Each round's ratio to the same round's `alone`: robust to load that drifts between rounds.
                "round_ratios": [speed / base for speed, base in zip(per_round[name], per_round["alone"], strict=True)],
                "median_round_ratio": statistics.median(
                    speed / base for speed, base in zip(per_round[name], per_round["alone"], strict=True)
                ),
            }
            for name, total in totals.items()
        },
    }
    lines = [
        f"# Head-of-line blocking ({args.model}, {args.clients} greedy clients x {args.requests} x "
        f"{args.max_new_tokens} tokens, {args.rounds} rounds, draft timeout {DRAFT_TIMEOUT_S:g}s)",
        "",
        "| scenario | tokens/s | ratio to alone | median of round ratios | hung-draft requests |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in results["scenarios"].items():
        lines.append(
            f"| {name} | {row['tokens_per_s']:.1f} | {row['ratio_to_alone']:.2f} | "
            f"{row['median_round_ratio']:.2f} | {row['extra_requests']} |"
        )
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown)


if __name__ == "__main__":
    main()
