"""Tensors that the generation code makes for itself land on the model's device.

No GPU is needed for this. Under torch's `FakeTensorMode`, every op checks that its operands share
one device and raises `FakeTensorDeviceMismatchError` otherwise, which is what a CUDA run raises
when a CPU tensor meets a CUDA one. `meta` stands in for the accelerator: a CPU-only build can create
fake tensors there, and not on `cuda`, for every op used here.

Fake tensors hold no values. Code that reads a value (`int()`, `bool()`, `.tolist()`) stops there
with `DataDependentOutputException`. So each check runs the code up to its first such read:
reaching it means every tensor op before it had its operands on one device.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from specwire.generation.config import GenerationConfig
from specwire.generation.loops.speculative_rounds import accept_blocks
from specwire.generation.processors.guidance import UnbatchedClassifierFreeGuidanceLogitsProcessor
from specwire.generation.speculation.drafters import ModelDrafter
from specwire.models import load_model

VOCAB = 64
ACCELERATOR = "meta"  # stands in for cuda (see above)


def fake_mode():
    """Device-checked fake tensors; real CPU tensors passed in become fake CPU ones."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def test_fake_mode_catches_a_cpu_tensor_meeting_an_accelerator_one():
    # The premise of this file: the mixing is caught, as it would be on a GPU, gathers included.
    with fake_mode(), pytest.raises(RuntimeError, match="same device"):
        torch.zeros(1, 4, device=ACCELERATOR).gather(-1, torch.tensor([[1]]))


@pytest.mark.parametrize(
    ("do_sample", "with_draft_probs"), [(False, False), (True, False), (True, True)], ids=["greedy", "lookup", "draft"]
)
def test_speculative_acceptance_builds_its_drafts_on_the_scores_device(do_sample, with_draft_probs):
    block = [3, 5, 7]
    with fake_mode():
        scores = torch.randn(len(block) + 1, VOCAB, device=ACCELERATOR)  # the target's scores for the block
        draft_probs = torch.rand(len(block), VOCAB) if with_draft_probs else None  # from the wire: CPU
        with pytest.raises(DataDependentOutputException):  # reached the first read of the result
            accept_blocks(do_sample, [block], [draft_probs], [scores], None).tokens()


def test_draft_model_confidence_stop_gathers_on_the_scores_device(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    config = GenerationConfig(assistant_confidence_threshold=0.4, eos_token_id=2)
    drafter = ModelDrafter(loaded.model, [[5, 6, 7]], config, loaded.vocab_size)
    with fake_mode():
        scores = torch.randn(1, loaded.vocab_size, device=ACCELERATOR)
        with pytest.raises(DataDependentOutputException):  # reached `bool(stop)`, after the gather
            drafter._unsure(9, scores)


class _MaskedToyLM(torch.nn.Module):
    """Embedding, the attention mask as a multiplier, LM head: uses both inputs like a real model."""

    def __init__(self, device: str):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8, device=device)
        self.head = torch.nn.Linear(8, VOCAB, device=device)

    def forward(self, ids, attention_mask=None, use_cache=True, past_key_values=None):
        hidden = self.embed(ids) * attention_mask[..., None]
        return SimpleNamespace(logits=self.head(hidden), past_key_values=None)


def test_negative_prompt_from_the_wire_follows_the_rows_to_their_device():
    negative = torch.tensor([[4, 5, 6]])  # what the target service builds from the request: CPU tensors
    with fake_mode():
        model = _MaskedToyLM(ACCELERATOR)
        guidance = UnbatchedClassifierFreeGuidanceLogitsProcessor(
            1.5, model, unconditional_ids=negative, unconditional_attention_mask=torch.ones_like(negative)
        )
        for length in (4, 5):  # the first step primes the negative branch, the second extends its mask
            ids = torch.zeros(1, length, dtype=torch.long, device=ACCELERATOR)
            out = guidance(ids, torch.randn(1, VOCAB, device=ACCELERATOR))
    assert out.device.type == ACCELERATOR
