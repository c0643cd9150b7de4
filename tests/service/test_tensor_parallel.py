"""Tensor-parallel targets (`target-service --tensor-parallel 2`, issue #24 item 3) on the CPU (gloo).

Three real services on one tiny Llama (4 attention heads, 2 KV heads), each with a co-located draft
model: two sharded over 2 ranks, one with the batched scheduler (the default: packed forwards over a
slot cache that every rank holds its shard of; prefills chunked small) and one with the sequential
scheduler, and one on a single process (batched). Every decoding mode asked of a sharded service and
of the single one must give the same ids, and scores within `SCORE_TOLERANCE` of each other relative
to max(1, |score|): a sharded forward sums its partial products in another order (all-reduce over
the ranks), so its logits differ from the unsharded ones by float rounding (measured on this model:
at most 1.9e-6 absolute, with guidance; 7.6e-6 absolute on constrained beam scores of magnitude > 1;
the batched sharded service within 1e-6 of the single one). Under the batched scheduler, greedy,
sampling, beams, the speculative modes and left-padded prompts run packed forwards; guidance, the
static cache, contrastive, DoLa and constrained beams run in its sequential lane: both paths are
mirrored. Then start-up refusals (heads not divisible by the ranks, the lean packed forward) and the
shutdown of every rank on SIGTERM, or of rank 0 when a follower dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from specwire.client import TargetClient
from specwire.client.health import wait_healthy
from tests.servers import free_port

SCORE_TOLERANCE = 1e-5
PROMPT = [[5, 6, 7, 8, 9, 10]]
REPEATING = [[5, 6, 7, 5, 6, 7, 5, 6]]  # prompt lookup finds its drafts in it
# Longer than the batched sharded service's prefill chunks (`--max-tokens-per-step 8`: chunks of
# `min_prefill_tokens`, 32): its prefill runs over three packed forwards.
LONG = [[(7 * i + 3) % 300 + 4 for i in range(80)]]


def _start(model: Path, draft: Path, *extra: str, log: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    """A target service; its output goes to `log` when given (a long-lived service must not block on a
    full pipe nobody reads), else to the process's `stdout` pipe."""
    port = free_port()
    command = [sys.executable, "-m", "specwire.target_service", "--model", str(model), "--port", str(port)]
    command += ["--draft-model", str(draft), "--grace", "2", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    output: Any = subprocess.PIPE if log is None else log.open("w")
    process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        output.close()  # the child holds its own copy
    return process, f"127.0.0.1:{port}"


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc: no psutil in the test dependencies)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference of two score tensors relative to max(1, |score|) (beam scores are sums of
    log-probabilities, whose rounding grows with them); their masked (-inf) entries must be the same."""
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    scale = want[finite].abs().clamp(min=1.0)
    return float(((got[finite] - want[finite]).abs() / scale).max())


@dataclass
class Service:
    process: subprocess.Popen[str]
    address: str
    log: Path

    def output(self) -> str:
        return self.log.read_text()


SCHEDULERS = ("batched", "sequential")


@pytest.fixture(scope="module")
def services(tiny_model_dir, tiny_draft_dir, tmp_path_factory):
    """{"batched": 2 ranks, default scheduler; "sequential": 2 ranks; "single": one process (batched)},
    started together."""
    logs = tmp_path_factory.mktemp("tp-logs")
    extras = {
        "batched": ("--tensor-parallel", "2", "--max-tokens-per-step", "8"),
        "sequential": ("--tensor-parallel", "2", "--scheduler", "sequential"),
        "single": (),
    }
    started = {}
    try:
        for name, extra in extras.items():
            log = logs / f"{name}.log"
            started[name] = Service(*_start(tiny_model_dir, tiny_draft_dir, *extra, log=log), log)
        for service in started.values():
            wait_healthy(service.address, timeout=120, process=service.process)
        yield started
    finally:
        for service in started.values():
            _stop(service.process)


CASES = {
    "greedy": dict(input_ids=PROMPT, max_new_tokens=10, do_sample=False),
    "sample": dict(input_ids=PROMPT, max_new_tokens=10, do_sample=True, seed=7, top_k=20, temperature=0.9),
    "beam": dict(input_ids=PROMPT, max_new_tokens=8, num_beams=3, num_return_sequences=2),
    "prompt_lookup": dict(input_ids=REPEATING, max_new_tokens=10, prompt_lookup_num_tokens=3),
    "draft_model": dict(
        input_ids=PROMPT,
        max_new_tokens=10,
        proposer="draft_model",
        num_assistant_tokens=3,
        assistant_confidence_threshold=0.0,
    ),
    "guidance": dict(input_ids=PROMPT, max_new_tokens=8, guidance_scale=1.5, negative_prompt_ids=[[5, 9]]),
    "static_cache": dict(input_ids=PROMPT, max_new_tokens=8, cache_implementation="static"),
    "contrastive": dict(input_ids=PROMPT, max_new_tokens=8, penalty_alpha=0.6, top_k=4),
    "dola": dict(input_ids=PROMPT, max_new_tokens=8, dola_layers="low", repetition_penalty=1.2),
    "constrained_beam": dict(input_ids=PROMPT, max_new_tokens=8, num_beams=3, force_words_ids=[[20, 21]]),
    "long_prompt": dict(input_ids=LONG, max_new_tokens=8, do_sample=False),
    "two_prompts_padded": dict(
        input_ids=[[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]],
        attention_mask=[[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]],
        max_new_tokens=8,
        do_sample=False,
    ),
}


def test_the_sharded_default_serves_with_the_batched_scheduler(services):
    """The batched sharded service really has its slot cache, and runs packed forwards through
    transformers' forward (the lean decoder would skip the sharded layers' all-reduces)."""
    output = services["batched"].output()
    assert "batched scheduler: " in output and "transformers forward" in output
    assert "batched scheduler disabled" not in output
    assert "follower: allocated its share of a SlotKVCache" in output  # at start-up, not with a request


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_outputs_equal_single_process(services, case, scheduler):
    """Same ids, scores within SCORE_TOLERANCE, for each decoding mode (speculation included)."""
    sharded_address, single_address = services[scheduler].address, services["single"].address
    request = dict(CASES[case], output_scores=True, return_dict_in_generate=True)
    with TargetClient(sharded_address) as sharded, TargetClient(single_address) as single:
        got = sharded.generate(**request)
        want = single.generate(**request)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert got.sequences.shape[1] > len(request["input_ids"][0])  # it generated
    assert len(got.scores) == len(want.scores) > 0
    worst = max(_difference(a, b) for a, b in zip(got.scores, want.scores, strict=True))
    assert worst <= SCORE_TOLERANCE, f"{case}: scores differ by {worst:g}"
    if case == "dola":  # DoLa runs the LM head on early layers: a mirrored call of its own
        assert any("dola" in warning.field for warning in got.warnings)
    if case in ("prompt_lookup", "draft_model"):
        assert got.speculation is not None and got.speculation.accepted_tokens == want.speculation.accepted_tokens


CONCURRENT = [dict(input_ids=[[5 + i, 6, 7 + i, 8, 9 + 2 * i]], max_new_tokens=12, do_sample=False) for i in range(4)]
CONCURRENT += [
    dict(input_ids=LONG, max_new_tokens=10, do_sample=False),  # its prefill chunks share forwards with decodes
    dict(input_ids=[[9, 8, 7, 6]], max_new_tokens=10, num_beams=3, num_return_sequences=3),
    dict(input_ids=[[11, 12, 13]], max_new_tokens=10, do_sample=True, seed=3, top_k=10),
    dict(input_ids=REPEATING, max_new_tokens=10, prompt_lookup_num_tokens=3),
]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_concurrent_and_cancelled_requests(services, scheduler):
    """Concurrent requests (batched: sharing packed forwards, beams copying slots between them;
    sequential: interleaved step by step, one KV cache each, mirrored by handle) and a request cut off
    by its deadline (its slot released, or its cache dropped on every rank) leave the ranks in step:
    the same ids as one process."""
    from concurrent.futures import ThreadPoolExecutor

    from specwire.client.errors import SpecwireRpcError

    sharded_address, single_address = services[scheduler].address, services["single"].address
    with TargetClient(sharded_address) as sharded, TargetClient(single_address) as single:
        with pytest.raises(SpecwireRpcError):  # 200 tokens cannot finish in 50 ms
            sharded.generate(input_ids=[[5, 6, 7]], max_new_tokens=200, min_new_tokens=200, timeout=0.05)
        with ThreadPoolExecutor(len(CONCURRENT)) as pool:
            got = list(pool.map(lambda r: sharded.generate(**r).sequences.tolist(), CONCURRENT))
        want = [single.generate(**request).sequences.tolist() for request in CONCURRENT]
    assert got == want


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_sharded_scores_are_not_bitwise_those_of_one_process(services, scheduler):
    """The tolerance is needed and small: the sharded forward really ran (its rounding shows)."""
    sharded_address, single_address = services[scheduler].address, services["single"].address
    request = dict(input_ids=PROMPT, max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    with TargetClient(sharded_address) as sharded, TargetClient(single_address) as single:
        got = torch.stack(list(sharded.generate(**request).logits))
        want = torch.stack(list(single.generate(**request).logits))
    assert 0.0 < float((got - want).abs().max()) <= SCORE_TOLERANCE


def test_model_info_names_the_sharded_architecture(services):
    with TargetClient(services["batched"].address) as client:
        info = client.model_info()
    assert info.architecture == "LlamaForCausalLM" and info.device == "cpu"


def test_refused_when_heads_do_not_divide(tiny_model_dir, tiny_draft_dir):
    """4 attention heads over 3 ranks: a clear start-up error, before any rank starts."""
    process, _ = _start(tiny_model_dir, tiny_draft_dir, "--tensor-parallel", "3")
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "--tensor-parallel 3 cannot shard" in output and "num_attention_heads=4 is not divisible by 3" in output


def test_refused_with_the_lean_packed_forward(tiny_model_dir, tiny_draft_dir):
    """The lean decoder applies the layers' weights itself (no all-reduce): refused before any rank starts."""
    process, _ = _start(tiny_model_dir, tiny_draft_dir, "--tensor-parallel", "2", "--packed-forward", "lean")
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0 and "--packed-forward lean cannot run with tensor parallelism" in output
    assert "started ranks" not in output


def test_sigterm_stops_every_rank(services):
    """Near the end of this module (it stops the shared batched sharded service): SIGTERM on rank 0 ends rank 1 too."""
    sharded, sharded_address = services["batched"].process, services["batched"].address
    followers = _children(sharded.pid)
    assert len(followers) == 1, f"rank 0 should have started one follower, found {followers}"
    with TargetClient(sharded_address) as client:  # serving up to the signal
        assert client.generate(input_ids=PROMPT, max_new_tokens=2).sequences.shape[1] == len(PROMPT[0]) + 2
    sharded.send_signal(signal.SIGTERM)
    assert sharded.wait(30) == 0
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() for pid in followers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in followers if Path(f"/proc/{pid}").exists()], "a follower outlived rank 0"
    assert (
        "rank 0 stopped" in services["batched"].output()
    )  # the follower left on rank 0's stop message, not by being killed


def test_a_dead_follower_stops_the_service(services):
    """Last in this module (it ends the shared sequential sharded service): rank 1 killed, rank 0 reports why
    and exits instead of waiting on collectives forever."""
    service = services["sequential"]
    followers = _children(service.process.pid)
    assert len(followers) == 1, f"rank 0 should have one follower, found {followers}:\n{service.output()}"
    os.kill(followers[0], signal.SIGKILL)
    assert service.process.wait(30) != 0
    output = service.output()
    assert "tensor-parallel rank 1" in output and "exited with code -9" in output
