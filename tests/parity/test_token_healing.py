"""Token healing on the embedded SmolLM2 through the target service and the client: the healed ids equal
transformers' `generate(token_healing=True, tokenizer=...)`, differ from plain greedy (so the test fails when
healing is dropped), and prompt lookup after healing gives the same ids."""

from __future__ import annotations

import grpc
import pytest
import torch

from specwire.client import TargetClient
from specwire.client.errors import SpecwireRpcError
from specwire.generation.config import GenerationConfig
from specwire.generation.loops.generate import generate
from specwire.target_service.__main__ import build_server as build_target_server
from tests.servers import threaded_server

# SmolLM2 heals "hel" into "hello" (token 2797 -> 28120); "The quick brown fo" has nothing to heal.
PROMPTS = ["print('hel", "The quick brown fo"]


@pytest.mark.smollm
def test_token_healing_equals_transformers(smollm):
    tok = smollm.tokenizer
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=8, do_sample=False)
    want = smollm.model.generate(**enc, token_healing=True, tokenizer=tok, **kwargs)
    plain_want = smollm.model.generate(**enc, **kwargs)
    assert not torch.equal(want, plain_want)
    beams_want = smollm.model.generate(
        **enc, token_healing=True, tokenizer=tok, num_beams=2, num_return_sequences=2, max_new_tokens=6
    )
    with threaded_server(lambda: build_target_server(smollm)) as server:
        with TargetClient(server.address) as client:
            healed = client.generate(text=PROMPTS, token_healing=True, **kwargs)
            plain = client.generate(text=PROMPTS, **kwargs)
            lookup = client.generate(text=PROMPTS, token_healing=True, prompt_lookup_num_tokens=3, **kwargs)
            beams = client.generate(
                text=PROMPTS, token_healing=True, num_beams=2, num_return_sequences=2, max_new_tokens=6
            )
            with pytest.raises(SpecwireRpcError) as err:
                client.generate(text=["The capital of France is"], token_healing=True, max_new_tokens=2)
    assert torch.equal(healed.sequences, want)
    assert torch.equal(plain.sequences, plain_want)
    assert torch.equal(lookup.sequences, want)
    assert torch.equal(beams.sequences, beams_want)
    # transformers fails on this tail (a KeyError in its trie lookup); the service says why instead.
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_healing" in err.value.details()


@pytest.mark.smollm
def test_library_generate_heals_as_transformers(smollm):
    """The library entry point (`specwire.generation.loops.generate.generate`) heals too, with the tokenizer."""
    tok = smollm.tokenizer
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    want = smollm.model.generate(**enc, token_healing=True, tokenizer=tok, max_new_tokens=6, do_sample=False)
    config = GenerationConfig(token_healing=True, max_new_tokens=6, do_sample=False)
    ours = generate(smollm.model, enc.input_ids, enc.attention_mask, config=config, tokenizer=tok)
    assert ours.sequences.tolist() == want.tolist()
    with pytest.raises(ValueError, match="tokenizer"):
        generate(smollm.model, enc.input_ids, enc.attention_mask, config=config)
