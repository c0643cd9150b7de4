"""Start-up checks of tensor-parallel targets (no processes started): which models and devices
transformers' tensor parallelism can shard, the world size from the flag or torchrun's environment,
and the scheduler it serves with. The sharded service itself: tests/service/test_tensor_parallel.py."""

from __future__ import annotations

import argparse

import pytest
from transformers import GPT2Config, LlamaConfig

from specwire.models.tensor_parallel import tp_support
from specwire.target_service.__main__ import build_parser, resolve_scheduler
from specwire.target_service.tensor_parallel import tensor_parallel_size


def llama(heads: int = 8, kv_heads: int = 4) -> LlamaConfig:
    return LlamaConfig(hidden_size=48, num_attention_heads=heads, num_key_value_heads=kv_heads)


@pytest.mark.parametrize(
    ("config", "world", "device", "reason"),
    [
        (llama(), 2, "cpu", ""),
        (llama(8, 4), 4, "cpu", ""),
        (llama(6, 2), 4, "cpu", "num_attention_heads=6 is not divisible by 4 ranks"),
        (llama(4, 2), 4, "cpu", "num_key_value_heads=2 is not divisible by 4 ranks"),
        (GPT2Config(), 2, "cpu", "architecture 'gpt2' has no tensor-parallel plan"),
        (llama(), 2, "mps", "device type 'mps'"),
    ],
)
def test_tp_support(config, world, device, reason):
    found = tp_support(config, world, device)
    assert (reason in found and found) if reason else found == ""


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_world_size_from_the_flag_or_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert tensor_parallel_size(_args()) == 1
    assert tensor_parallel_size(_args("--tensor-parallel", "2")) == 2
    monkeypatch.setenv("WORLD_SIZE", "4")  # under torchrun --nproc-per-node 4
    assert tensor_parallel_size(_args()) == 4
    assert tensor_parallel_size(_args("--tensor-parallel", "4")) == 4
    with pytest.raises(SystemExit, match="disagrees with WORLD_SIZE=4"):
        tensor_parallel_size(_args("--tensor-parallel", "2"))
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(SystemExit, match="must be >= 1"):
        tensor_parallel_size(_args("--tensor-parallel", "0"))


def test_tensor_parallel_serves_with_the_sequential_scheduler():
    assert resolve_scheduler(_args(), 2) == "sequential"
    assert resolve_scheduler(_args("--scheduler", "sequential"), 2) == "sequential"
    with pytest.raises(SystemExit, match="--scheduler batched cannot run with tensor parallelism"):
        resolve_scheduler(_args("--scheduler", "batched"), 2)
    assert resolve_scheduler(_args("--scheduler", "batched"), 1) == "batched"
