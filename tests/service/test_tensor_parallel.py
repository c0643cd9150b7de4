"""Tensor-parallel targets (`target-service --tensor-parallel 2`, issue #24 item 3) on the CPU (gloo).

Two real services on one tiny Llama (4 attention heads, 2 KV heads): one sharded over 2 ranks, one
on a single process, both with the sequential scheduler and a co-located draft model. Every decoding
mode asked of both must give the same ids, and scores within `SCORE_TOLERANCE` of each other relative
to max(1, |score|): a sharded forward sums its partial products in another order (all-reduce over the
ranks), so its logits differ from the unsharded ones by float rounding (measured on this model: at
most 1.9e-6 absolute, with guidance; 7.6e-6 absolute on constrained beam scores of magnitude > 1).
Then start-up refusals (heads not divisible by the ranks, the batched scheduler) and the shutdown of
every rank on SIGTERM, or of rank 0 when a follower dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specwire.client import TargetClient
from specwire.client.health import wait_healthy
from tests.servers import free_port

SCORE_TOLERANCE = 1e-5
PROMPT = [[5, 6, 7, 8, 9, 10]]
REPEATING = [[5, 6, 7, 5, 6, 7, 5, 6]]  # prompt lookup finds its drafts in it


def _start(model: Path, draft: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    command = [sys.executable, "-m", "specwire.target_service", "--model", str(model), "--port", str(port)]
    command += ["--draft-model", str(draft), "--grace", "2", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


@pytest.fixture(scope="module")
def services(tiny_model_dir, tiny_draft_dir):
    """(sharded, single): the addresses of a 2-rank service and a one-process service, started together."""
    sharded, sharded_address = _start(tiny_model_dir, tiny_draft_dir, "--tensor-parallel", "2")
    single, single_address = _start(tiny_model_dir, tiny_draft_dir, "--scheduler", "sequential")
    try:
        wait_healthy(sharded_address, timeout=120, process=sharded)
        wait_healthy(single_address, timeout=120, process=single)
        yield sharded, sharded_address, single_address
    finally:
        _stop(sharded)
        _stop(single)


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
    "two_prompts_padded": dict(
        input_ids=[[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]],
        attention_mask=[[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]],
        max_new_tokens=8,
        do_sample=False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_outputs_equal_single_process(services, case):
    """Same ids, scores within SCORE_TOLERANCE, for each decoding mode (speculation included)."""
    _, sharded_address, single_address = services
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


def test_concurrent_and_cancelled_requests(services):
    """Requests interleaved step by step (one KV cache each, mirrored by handle) and a request cut off
    by its deadline (its cache dropped on every rank) leave the ranks in step: the same ids as one process."""
    from concurrent.futures import ThreadPoolExecutor

    from specwire.client.errors import SpecwireRpcError

    _, sharded_address, single_address = services
    prompts = [[5 + i, 6, 7 + i, 8, 9 + 2 * i] for i in range(4)]
    request = dict(max_new_tokens=12, do_sample=False)
    with TargetClient(sharded_address) as sharded, TargetClient(single_address) as single:
        with pytest.raises(SpecwireRpcError):  # 200 tokens cannot finish in 50 ms
            sharded.generate(input_ids=[prompts[0]], max_new_tokens=200, min_new_tokens=200, timeout=0.05)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: sharded.generate(input_ids=[p], **request).sequences.tolist(), prompts))
        want = [single.generate(input_ids=[p], **request).sequences.tolist() for p in prompts]
    assert got == want


def test_sharded_scores_are_not_bitwise_those_of_one_process(services):
    """The tolerance is needed and small: the sharded forward really ran (its rounding shows)."""
    _, sharded_address, single_address = services
    request = dict(input_ids=PROMPT, max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    with TargetClient(sharded_address) as sharded, TargetClient(single_address) as single:
        got = torch.stack(list(sharded.generate(**request).logits))
        want = torch.stack(list(single.generate(**request).logits))
    assert 0.0 < float((got - want).abs().max()) <= SCORE_TOLERANCE


def test_model_info_names_the_sharded_architecture(services):
    _, sharded_address, _ = services
    with TargetClient(sharded_address) as client:
        info = client.model_info()
    assert info.architecture == "LlamaForCausalLM" and info.device == "cpu"


def test_refused_when_heads_do_not_divide(tiny_model_dir, tiny_draft_dir):
    """4 attention heads over 3 ranks: a clear start-up error, before any rank starts."""
    process, _ = _start(tiny_model_dir, tiny_draft_dir, "--tensor-parallel", "3")
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "--tensor-parallel 3 cannot shard" in output and "num_attention_heads=4 is not divisible by 3" in output


def test_refused_with_the_batched_scheduler(tiny_model_dir, tiny_draft_dir):
    process, _ = _start(tiny_model_dir, tiny_draft_dir, "--tensor-parallel", "2", "--scheduler", "batched")
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0 and "--scheduler batched cannot run with tensor parallelism" in output


def test_sigterm_stops_every_rank(services):
    """Last in this module (it stops the shared sharded service): SIGTERM on rank 0 ends rank 1 too."""
    sharded, sharded_address, _ = services
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
    output = sharded.stdout.read() if sharded.stdout else ""
    assert "rank 0 stopped" in output  # the follower left on rank 0's stop message, not by being killed


def test_a_dead_follower_stops_the_service(tiny_model_dir, tiny_draft_dir):
    """Rank 1 killed: rank 0 reports why and exits instead of waiting on collectives forever."""
    process, address = _start(tiny_model_dir, tiny_draft_dir, "--tensor-parallel", "2")
    try:
        wait_healthy(address, timeout=120, process=process)
        (follower,) = _children(process.pid)
        os.kill(follower, signal.SIGKILL)
        assert process.wait(30) != 0
        output = process.stdout.read() if process.stdout else ""
        assert "tensor-parallel rank 1" in output and "exited with code -9" in output
    finally:
        _stop(process)
