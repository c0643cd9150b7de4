"""Aggregate throughput of 1 vs N concurrent clients, for each target-service scheduler.

  python -m bench.concurrency_scheduler --model default            # embedded SmolLM2, 64 new tokens
  python -m bench.concurrency_scheduler --model PATH --clients 8 --requests 2 --schedulers batched
  python -m bench.concurrency_scheduler --sampling --schedulers batched   # seeded top-p/top-k sampling

For each scheduler (`sequential`, `batched`) starts a target service process on loopback (its own
process, as deployed: two schedulers' model threads in one process would slow each other, see
`specwire.model_thread`), warms it up, and runs greedy requests (64 new tokens by default; with
`--sampling`, seeded sampling with temperature 0.7, top-k 50 and top-p 0.9) from 1
client, then from N concurrent clients (each its own channel and prompt, each sending `--requests`
requests back to back). Aggregate tokens/s = generated tokens of all clients / wall time. Prints one
line per run and the N-vs-1 ratio per scheduler; `--json PATH` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "Explain how a web browser loads a page, from the address bar to the pixels.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP? Give examples of when to use each.",
    "Describe the water cycle to a ten-year-old.",
    "List five tips for writing clean Python code and explain each briefly.",
    "Why is the sky blue? Answer in a few paragraphs.",
    "Summarize the history of the printing press and its effect on Europe.",
    "How do vaccines train the immune system? Explain step by step.",
    "Give a recipe for a simple vegetable soup, with quantities.",
    "Compare electric cars and petrol cars on cost, emissions and convenience.",
    "What is a hash table and how does it handle collisions?",
    "Write a polite email asking a colleague to review a pull request.",
]


SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9}


def _run_clients(
    address: str,
    prompts: list[list[int]],
    clients: int,
    requests: int,
    max_new_tokens: int,
    verbose: bool = False,
    sampling: bool = False,
) -> dict:
    from specwire.client import TargetClient

    tokens = [0] * clients
    errors: list[BaseException] = []
    barrier = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        try:
            with TargetClient(address) as target:
                barrier.wait(60)
                for j in range(requests):
                    prompt = prompts[(i + j * clients) % len(prompts)]
                    mode = SAMPLING if sampling else {"do_sample": False}
                    out = target.generate([prompt], max_new_tokens=max_new_tokens, seed=i * 1000 + j, **mode)
                    tokens[i] += out.sequences.shape[1] - len(prompt)
                    if verbose:
                        print(
                            f"    client {i} request {j}: {out.sequences.shape[1] - len(prompt)} tokens "
                            f"at {time.perf_counter() - started:.1f}s",
                            flush=True,
                        )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            if not barrier.broken:
                barrier.abort()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait(120)
    started = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    total = sum(tokens)
    return {
        "clients": clients,
        "requests": clients * requests,
        "tokens": total,
        "wall_s": wall,
        "tokens_per_s": total / wall,
    }


def _chat_ids(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.concurrency_scheduler", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="'default' (embedded SmolLM2), a folder, a .gguf file")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1, help="requests per client, back to back")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--schedulers", default="sequential,batched")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--verbose", action="store_true", help="print every finished request")
    parser.add_argument("--sampling", action="store_true", help="seeded sampling (T 0.7, top-k 50, top-p 0.9)")
    args = parser.parse_args(argv)

    from bench.services import Service, free_port, wait_healthy
    from specwire.models import load_model

    # Only the tokenizer is used here (prompt ids); the model runs in the services.
    prompts = [_chat_ids(load_model(args.model, progress=False).tokenizer, text) for text in PROMPTS]
    results = {}
    for scheduler in args.schedulers.split(","):
        log_path = Path(tempfile.mkdtemp(prefix="specwire-bench-")) / "target.log"
        server = Service(
            "target-service",
            "specwire.target_service",
            ["--model", args.model, "--scheduler", scheduler],
            free_port(),
            log_path,
        )
        server.start({**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        try:
            wait_healthy(server, 900)
            _run_clients(server.address, prompts, 2, 1, 8)  # warm-up
            run = dict(max_new_tokens=args.max_new_tokens, verbose=args.verbose, sampling=args.sampling)
            one = _run_clients(server.address, prompts, 1, args.requests, **run)
            many = _run_clients(server.address, prompts, args.clients, args.requests, **run)
        finally:
            server.stop()
        ratio = many["tokens_per_s"] / one["tokens_per_s"]
        results[scheduler] = {"one": one, "many": many, "ratio": ratio}
        for run in (one, many):
            print(
                f"{scheduler:>10}  {run['clients']} client(s): {run['tokens']} tokens in {run['wall_s']:.2f}s "
                f"= {run['tokens_per_s']:.1f} tokens/s",
                flush=True,
            )
        print(f"{scheduler:>10}  {args.clients} vs 1 client(s): {ratio:.2f}x aggregate tokens/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
