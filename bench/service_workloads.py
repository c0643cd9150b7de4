"""The workloads that measure the services rather than one request: concurrent clients against the target,
the draft stream's round trip per speculative round, and each service's peak memory."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from bench.progress import log
from bench.reference import Run
from bench.stats import percentile, summarize
from bench.workload_context import PROMPT_LOOKUP_TOKENS, Context, run_series

# ---------------------------------------------------------------------------------------------------------
# 6: concurrency


def client_wave(
    address: str, prompt: list[int], clients: int, args: dict, outputs: list | None = None
) -> tuple[float, list[float], int]:
    """`clients` concurrent Generate calls, one channel each; returns wall time, latencies and tokens (and
    appends each call's `GenerateOutput` to `outputs` when given)."""
    from specwire.client import TargetClient

    channels = [TargetClient(address) for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    latencies: list[float] = [0.0] * clients
    tokens: list[int] = [0] * clients
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            channels[i].model_info()  # connect before the clock starts
            barrier.wait()
            started = time.perf_counter()
            output = channels[i].generate(input_ids=[prompt], **args)
            latencies[i] = time.perf_counter() - started
            tokens[i] = output.sequences.shape[1] - len(prompt)
            if outputs is not None:
                outputs.append(output)
        except BaseException as error:  # noqa: BLE001 - reported by the caller
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    for channel in channels:
        channel.close()
    if errors:
        raise errors[0]
    return wall, latencies, sum(tokens)


def wave_pair(
    address: str,
    prompt: list[int],
    clients: int,
    plain: dict,
    speculative: dict,
    speculative_first: bool,
    outputs: list | None = None,
) -> tuple[float, float]:
    """A speculative wave beside a plain wave of `clients` on one target, the speculative one first or second:
    their aggregate tokens/s, `(plain, speculative)`; the speculative requests' outputs go to `outputs`."""
    waves = {"plain": (plain, None), "speculative": (speculative, outputs)}
    rates = {}
    for label in ("speculative", "plain") if speculative_first else ("plain", "speculative"):
        wall, _, tokens = client_wave(address, prompt, clients, *waves[label])
        rates[label] = tokens / wall
    return rates["plain"], rates["speculative"]


def controller_choices(outputs: list) -> dict[str, int]:
    """What the speculation controller chose over speculative requests' outputs (`client_wave`'s): rounds with
    drafts, tokens decoded without (time off), and probes or look-backs."""
    stats = [o.speculation for o in outputs]
    return {
        "requests": len(stats),
        "rounds_with_drafts": sum(s.rounds for s in stats),
        "tokens_without_draft": sum(s.tokens_without_draft for s in stats),
        "probes": sum(s.probes for s in stats),
    }


def concurrency(ctx: Context) -> dict:
    """6. 1, 2, 4, 8 concurrent clients: aggregate tokens/s and p50/p99 latency; transformers sequential."""
    prompt = ctx.prompt("chat")
    args = {"do_sample": False, "max_new_tokens": ctx.max_new_tokens}
    address = ctx.stack.address("target")
    per_level: dict[int, dict[str, list]] = {
        n: {"throughput": [], "latencies": [], "wall": []} for n in ctx.concurrency_levels
    }
    sequential: list[Run] = []
    for repeat in range(ctx.repeats):
        levels = ctx.concurrency_levels if repeat % 2 == 0 else ctx.concurrency_levels[::-1]
        for n in levels:
            wall, latencies, tokens = client_wave(address, prompt, n, args)
            per_level[n]["throughput"].append(tokens / wall)
            per_level[n]["latencies"].extend(latencies)
            per_level[n]["wall"].append(wall)
            log(
                f"  concurrency [{repeat + 1}/{ctx.repeats}] {n} client(s): {tokens} tokens in {wall:.2f}s = "
                f"{tokens / wall:.1f} tok/s aggregate, latency max {max(latencies):.2f}s"
            )
        run = ctx.reference.generate(prompt, **args)
        sequential.append(run)
        log(f"  concurrency [{repeat + 1}/{ctx.repeats}] transformers sequential: {run.tokens_per_second:.1f} tok/s")
    levels = {}
    for n, values in per_level.items():
        levels[str(n)] = {
            "clients": n,
            "aggregate_tokens_per_second": summarize(values["throughput"]),
            "latency_p50_seconds": percentile(values["latencies"], 50),
            "latency_p99_seconds": percentile(values["latencies"], 99),
            "latency_samples": len(values["latencies"]),
            "wall_seconds": summarize(values["wall"]),
        }
    return {
        "title": "Concurrent clients (greedy, chat prompt)",
        "status": "ok",
        "reason": None,
        "config": args,
        "prompt_tokens": len(prompt),
        "levels": levels,
        "transformers_sequential": run_series(sequential),
        "checks": [],
        "notes": [
            "p50/p99 are over every request of every repeat at that level (with few samples, p99 is "
            "close to the maximum); transformers has no server, so its figure is one request after "
            "another in this process."
        ],
    }


# ---------------------------------------------------------------------------------------------------------
# 7: draft round trip


async def _round_trips(address: str, prompt: list[int], num_tokens: int, rounds: int, warmup: int) -> list[float]:
    """Seconds per feedback -> proposal round on one Draft stream (prompt lookup: no model compute)."""
    import grpc

    from specwire.client.config_client import config_to_wire
    from specwire.common.v1 import common_pb2
    from specwire.draft.v1 import draft_service_pb2 as pb
    from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
    from specwire.security.channels import secure_channel

    queue: asyncio.Queue = asyncio.Queue()

    async def requests():
        while True:
            message = await queue.get()
            if message is None:
                return
            yield message

    times: list[float] = []
    async with secure_channel(address, aio=True) as channel:
        stub = pb_grpc.DraftServiceStub(channel)
        call = stub.Draft(requests())
        start = pb.DraftStart(
            rows=[common_pb2.TokenSequence(ids=prompt)],
            method=pb.DRAFT_METHOD_PROMPT_LOOKUP,
            config=config_to_wire({"prompt_lookup_num_tokens": max(num_tokens, 1), "do_sample": False}),
            num_tokens=num_tokens,
            vocab_size=max(prompt) + 1,
        )
        await queue.put(pb.DraftRequest(start=start))
        await call.read()
        for i in range(warmup + rounds):
            # Feed the prompt's own tokens back, as a copying answer would: lookups keep finding matches.
            appended = [prompt[(len(prompt) // 2 + i) % len(prompt)]]
            feedback = pb.DraftFeedback(
                rows=[pb.RowFeedback(num_accepted=0, appended_ids=appended)], num_tokens=num_tokens
            )
            started = time.perf_counter()
            await queue.put(pb.DraftRequest(feedback=feedback))
            response = await call.read()
            if response is grpc.aio.EOF:
                raise RuntimeError("the draft stream ended early")
            if i >= warmup:
                times.append(time.perf_counter() - started)
        await queue.put(None)
        call.cancel()
    return times


def roundtrip(ctx: Context) -> dict:
    """7. Draft round-trip overhead per speculative round on loopback (p50, p99)."""
    prompt = ctx.prompt("code")
    address = ctx.stack.address("draft")
    variants = {"prompt_lookup_10": PROMPT_LOOKUP_TOKENS, "empty_round": 0}
    measured: dict[str, dict[str, list[float]]] = {v: {"p50": [], "p99": [], "all": []} for v in variants}
    for repeat in range(ctx.repeats):
        for name, num_tokens in variants.items():
            times = asyncio.run(_round_trips(address, prompt, num_tokens, ctx.roundtrip_rounds, warmup=10))
            measured[name]["p50"].append(percentile(times, 50))
            measured[name]["p99"].append(percentile(times, 99))
            measured[name]["all"].extend(times)
            log(
                f"  round trip [{repeat + 1}/{ctx.repeats}] {name}: "
                f"p50 {percentile(times, 50) * 1e3:.3f} ms, "
                f"p99 {percentile(times, 99) * 1e3:.3f} ms over {len(times)} rounds"
            )
    direct = {
        name: {
            "num_tokens": variants[name],
            "rounds_per_repeat": ctx.roundtrip_rounds,
            "p50_ms": summarize([v * 1e3 for v in m["p50"]]),
            "p99_ms": summarize([v * 1e3 for v in m["p99"]]),
        }
        for name, m in measured.items()
    }
    via_target = None
    if ctx.speculation_rounds:
        via_target = {
            "requests": len(ctx.speculation_rounds),
            "draft_ms_per_round_p50": percentile(
                [r["draft_seconds_per_round"] * 1e3 for r in ctx.speculation_rounds], 50
            ),
            "draft_ms_per_round_p99": percentile(
                [r["draft_seconds_per_round"] * 1e3 for r in ctx.speculation_rounds], 99
            ),
            "verify_ms_per_round_p50": percentile(
                [r["verify_seconds_per_round"] * 1e3 for r in ctx.speculation_rounds], 50
            ),
        }
    return {
        "title": "Draft round trip per speculative round (loopback)",
        "status": "ok",
        "reason": None
        if via_target
        else "speculation not available in the target: only the direct measurement of the draft stream ran",
        "direct": direct,
        "via_target": via_target,
        "checks": [],
        "notes": [
            "direct: a benchmark client plays the target on one Draft stream (grpc.aio), timing each "
            "DraftFeedback -> DraftResponse on loopback; prompt lookup costs microseconds, so this is "
            "the transport and servicer overhead of a round. empty_round asks for 0 tokens.",
            "via_target: draft_seconds / rounds from each speculative request's stats (includes draft model compute).",
        ],
    }


# ---------------------------------------------------------------------------------------------------------
# 9: memory


def memory(ctx: Context) -> dict:
    """9. Peak resident size of each service (VmHWM), against the target's memory budget.

    On a GPU the peak device memory of the target (its `GetModelInfo`) and of transformers in this
    process (`torch.cuda.max_memory_reserved`) are added: the weights live there, not in the RSS.
    """
    usage = ctx.stack.memory()
    float32_mb = ctx.reference.float32_bytes() / 1e6
    services = {}
    for name, values in usage.items():
        services[name] = {
            "peak_rss_mb": values.get("VmHWM", 0) * 1024 / 1e6 if values else None,
            "rss_mb": values.get("VmRSS", 0) * 1024 / 1e6 if values else None,
            "args": " ".join(ctx.stack.services[name].args),
        }
    notes = ["peak = VmHWM from /proc/PID/status at the end of the run (model loading included); MB = 10^6 bytes."]
    device = ctx.reference.device
    device_peak = None
    if device.type == "cuda":
        device_peak = {
            "target": ctx.specwire.client.model_info().peak_device_memory_bytes / 1e6,
            "transformers": torch.cuda.max_memory_reserved(device) / 1e6,
        }
        notes.append(
            f"device peak = bytes torch's caching allocator reserved on {device} (max_memory_reserved), "
            "for the target service and for transformers in the benchmark process; the draft service's "
            "device memory is not reported."
        )
    return {
        "title": "Memory: peak resident size per service",
        "status": "ok",
        "reason": None,
        "device": str(device),
        "model_float32_mb": float32_mb,
        "target_budget_mb": 1.5 * float32_mb + 300,
        "services": services,
        "device_peak_mb": device_peak,
        "checks": [],
        "notes": notes,
    }
