"""Start-up checks of tensor-parallel targets (no processes started): which models and devices
transformers' tensor parallelism can shard, the world size from the flag or torchrun's environment,
the scheduler and packed forward it serves with, and how a batched scheduler's packed step reaches a
follower (its slot cache rebuilt on the follower's shard). The sharded service itself:
tests/service/test_tensor_parallel.py."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from specwire.models.tensor_parallel import MirroredModel, TensorParallelWorld, _Replayer, tp_support
from specwire.runtime.slot_cache import PackedStep, SlotKVCache
from specwire.target_service.__main__ import (
    DEFAULT_SCHEDULER,
    build_parser,
    resolve_packed_forward,
    resolve_scheduler,
)
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


def test_tensor_parallel_serves_with_the_default_scheduler_and_the_transformers_forward():
    assert resolve_scheduler(_args()) == DEFAULT_SCHEDULER
    assert resolve_scheduler(_args("--scheduler", "batched")) == "batched"
    assert resolve_scheduler(_args("--scheduler", "sequential")) == "sequential"
    assert resolve_packed_forward(_args(), 1) == "lean"
    assert resolve_packed_forward(_args(), 2) == "transformers"
    assert resolve_packed_forward(_args("--packed-forward", "transformers"), 2) == "transformers"
    assert resolve_packed_forward(_args("--packed-forward", "lean"), 1) == "lean"
    with pytest.raises(SystemExit, match="--packed-forward lean cannot run with tensor parallelism"):
        resolve_packed_forward(_args("--packed-forward", "lean"), 2)


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaForCausalLM

    config = llama(4, 2)
    config.update(dict(num_hidden_layers=2, intermediate_size=64, vocab_size=64))
    return LlamaForCausalLM(config).eval()


def test_slot_cache_holds_the_kv_heads_of_this_shard(tiny_llama, monkeypatch):
    """A rank of a 2-way shard holds half the KV heads its config names (transformers' `tp_size`)."""
    assert SlotKVCache(tiny_llama, 2, 4).kv_heads == 2
    whole = SlotKVCache.bytes_per_slot(tiny_llama, 4)
    monkeypatch.setattr(tiny_llama, "_tp_size", 2)
    assert SlotKVCache(tiny_llama, 2, 4).kv_heads == 1
    assert SlotKVCache.bytes_per_slot(tiny_llama, 4) * 2 == whole


def test_a_packed_step_reaches_a_follower_as_its_own_step_over_its_own_slots(tiny_llama):
    """Rank 0 sends a packed step as (slot cache handle and size, pieces); the follower builds the same
    step over a twin cache of its own, the same twin for every step of that cache, and a new twin
    for another cache (the start-up probe's)."""
    world = TensorParallelWorld(0, 2, torch.device("cpu"), control=None)
    mirrored = MirroredModel(tiny_llama, world)
    served, probe = SlotKVCache(tiny_llama, 4, 8), SlotKVCache(tiny_llama, 3, 16)
    follower = _Replayer(tiny_llama, torch.device("cpu"))
    pieces = [(1, 0, 3), (2, 5, 1)]
    first = follower.decode(mirrored._encode({"specwire_step": PackedStep(served, pieces)}))["specwire_step"]
    again = follower.decode(mirrored._encode(PackedStep(served, [(0, 2, 1)])))
    other = follower.decode(mirrored._encode(PackedStep(probe, [(0, 0, 2)])))
    assert isinstance(first, PackedStep) and first.pieces == pieces
    assert first.cache is not served and (first.cache.num_slots, first.cache.slot_tokens) == (4, 8)
    assert torch.equal(first.write_index, PackedStep(served, pieces).write_index)
    assert again.cache is first.cache and other.cache is not first.cache
    assert (other.cache.num_slots, other.cache.slot_tokens) == (3, 16)
    assert tiny_llama.config._attn_implementation == "specwire_slots"  # installed with the first step
    assert callable(served.copy) and "copy" in vars(served)  # mirrored: rank 0 broadcasts slot copies
