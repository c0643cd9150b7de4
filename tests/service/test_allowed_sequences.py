"""`allowed_token_sequences` over the wire: real target servers (sequential and batched) with the tiny
Llama give transformers' `generate(prefix_allowed_tokens_fn=...)` tokens for the same function, and
bad sequences are INVALID_ARGUMENT naming the sequence."""

from __future__ import annotations

import grpc
import pytest
import torch
import transformers

from specwire.client import SpecwireRpcError, TargetClient
from specwire.generation.processors.prefix import AllowedSequences
from specwire.models import load_model
from specwire.target_service.__main__ import build_server
from tests.servers import threaded_server

PROMPTS = torch.tensor([[5, 6, 7, 8, 9], [20, 21, 22, 23, 24]])
SEQUENCES = [[50, 60, 70, 80], [50, 61], [90, 91, 92], [100]]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module", params=["sequential", "batched"])
def server(request, loaded):
    with threaded_server(lambda: build_server(loaded, scheduler=request.param)) as running:
        yield running


@pytest.mark.parametrize("kwargs", [{}, {"num_beams": 3, "num_return_sequences": 2}], ids=["greedy", "beams"])
def test_same_tokens_as_transformers_prefix_allowed_tokens_fn(server, loaded, reference, kwargs):
    with TargetClient(server.address) as client:
        out = client.generate(PROMPTS, max_new_tokens=6, allowed_token_sequences=SEQUENCES, proposer="none", **kwargs)
    fn = AllowedSequences(SEQUENCES, PROMPTS.shape[1], [loaded.tokenizer.eos_token_id])
    with torch.no_grad():
        want = reference.generate(PROMPTS, max_new_tokens=6, do_sample=False, prefix_allowed_tokens_fn=fn, **kwargs)
    assert torch.equal(out.sequences, want)


@pytest.mark.parametrize(
    "sequences, field", [([[5], []], "allowed_token_sequences[1]"), ([[10**6]], "allowed_token_sequences[0]")]
)
def test_bad_sequences_are_invalid_argument(server, sequences, field):
    with TargetClient(server.address) as client:
        with pytest.raises(SpecwireRpcError) as info:
            client.generate(PROMPTS, max_new_tokens=2, allowed_token_sequences=sequences)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.violations[0].field == field
