"""`output_attentions` / `output_hidden_states` through a real target service, against
transformers.generate(output_attentions=True, output_hidden_states=True, return_dict_in_generate=True)
on the same tiny model with eager attention: same steps, layers, shapes and values (the first step
holds the prompt), batched with left padding, with and without a cache; refusals where they are not
returned; speculative requests fall back to plain decoding and say so."""

from __future__ import annotations

import pytest
import torch
import transformers

from specwire.client import SpecwireRpcError, TargetClient
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.limits import RequestLimits
from tests.servers import threaded_server

PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22]]
BOTH = dict(output_attentions=True, output_hidden_states=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def eager_target(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    loaded.model.set_attn_implementation("eager")
    with threaded_server(lambda: build_target_server(loaded)) as server:
        with TargetClient(server.address) as client:
            yield client


@pytest.fixture(scope="module")
def sdpa_target(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    with threaded_server(lambda: build_target_server(loaded)) as server:
        with TargetClient(server.address) as client:
            yield client


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()


def _left_padded(rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _assert_layered_close(ours, theirs):
    assert ours is not None and len(ours) == len(theirs)
    for step, (our_layers, their_layers) in enumerate(zip(ours, theirs, strict=True)):
        assert len(our_layers) == len(their_layers), step
        for mine, want in zip(our_layers, their_layers, strict=True):
            assert mine.shape == want.shape, (step, mine.shape, want.shape)
            torch.testing.assert_close(mine, want.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_new_tokens=6),
        dict(max_new_tokens=5, use_cache=False),
        dict(max_new_tokens=4, no_repeat_ngram_size=2),
        dict(max_new_tokens=5, repetition_penalty=1.5, output_scores=True),
        dict(max_new_tokens=4, prefill_chunk_size=4),  # the first step is the last chunk's, as there
    ],
)
def test_attentions_and_hidden_states_match_transformers(eager_target, reference, kwargs):
    ids, mask = _left_padded(PROMPTS)
    out = eager_target.generate(ids, attention_mask=mask, **BOTH, **kwargs)
    want = reference.generate(ids, attention_mask=mask, do_sample=False, **BOTH, **kwargs)
    assert out.sequences.tolist() == want.sequences.tolist()
    _assert_layered_close(out.attentions, want.attentions)
    _assert_layered_close(out.hidden_states, want.hidden_states)
    if "prefill_chunk_size" not in kwargs:
        assert out.attentions[0][0].shape[-2] == ids.shape[1]  # the prompt step
    layers = reference.config.num_hidden_layers
    assert len(out.attentions[0]) == layers and len(out.hidden_states[0]) == layers + 1


@pytest.mark.parametrize("kwargs", [dict(num_beams=2), dict(num_beams=3, num_return_sequences=2, length_penalty=0.5)])
def test_beam_search_returns_every_step_of_every_beam_like_transformers(eager_target, reference, kwargs):
    ids, mask = _left_padded(PROMPTS)
    out = eager_target.generate(ids, attention_mask=mask, max_new_tokens=5, output_scores=True, **BOTH, **kwargs)
    want = reference.generate(ids, attention_mask=mask, max_new_tokens=5, output_scores=True, **BOTH, **kwargs)
    assert out.sequences.tolist() == want.sequences.tolist()
    _assert_layered_close(out.attentions, want.attentions)
    _assert_layered_close(out.hidden_states, want.hidden_states)
    assert out.attentions[0][0].shape[0] == ids.shape[0] * kwargs["num_beams"]


def test_seeded_sampling_returns_one_entry_per_generated_token(eager_target):
    out = eager_target.generate(PROMPTS[:1], max_new_tokens=7, do_sample=True, seed=5, **BOTH)
    assert len(out.attentions) == len(out.hidden_states) == out.sequences.shape[1] - len(PROMPTS[0])


def test_hidden_states_alone_on_an_sdpa_model(sdpa_target, reference):
    ids = torch.tensor(PROMPTS[:1])
    kwargs = dict(max_new_tokens=5, output_hidden_states=True, return_dict_in_generate=True)
    out = sdpa_target.generate(ids, **kwargs)
    want = reference.generate(ids, do_sample=False, **kwargs)
    assert out.attentions is None
    _assert_layered_close(out.hidden_states, want.hidden_states)


def test_without_return_dict_nothing_is_returned_as_in_transformers(eager_target):
    out = eager_target.generate(PROMPTS[:1], max_new_tokens=3, output_attentions=True)
    assert out.attentions is None and out.hidden_states is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(output_attentions=True), "output_attentions"),  # sdpa computes no weights
    ],
)
def test_refusals_name_the_field(sdpa_target, kwargs, field):
    with pytest.raises(SpecwireRpcError) as info:
        sdpa_target.generate(PROMPTS[:1], max_new_tokens=3, return_dict_in_generate=True, **kwargs)
    assert info.value.code().name == "INVALID_ARGUMENT" and field in str(info.value)


def test_speculative_requests_fall_back_to_plain_decoding(eager_target, reference):
    ids = torch.tensor(PROMPTS[:1])
    out = eager_target.generate(ids, max_new_tokens=5, prompt_lookup_num_tokens=3, **BOTH)
    assert "output_attentions" in out.speculation.fallback_reason
    want = reference.generate(ids, do_sample=False, max_new_tokens=5, **BOTH)
    _assert_layered_close(out.attentions, want.attentions)


def test_the_output_budget_counts_them(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    loaded.model.set_attn_implementation("eager")
    limits = RequestLimits(max_model_len=256, max_output_bytes=200_000)
    with threaded_server(lambda: build_target_server(loaded, limits=limits)) as server:
        with TargetClient(server.address) as client:
            assert client.generate(PROMPTS[:1], max_new_tokens=4, **BOTH).attentions is not None
            with pytest.raises(SpecwireRpcError) as info:
                client.generate(PROMPTS[:1], max_new_tokens=200, **BOTH)
    assert info.value.code().name == "INVALID_ARGUMENT"
    assert "output_attentions" in str(info.value) and "max_new_tokens <=" in str(info.value)


def test_the_stream_final_message_carries_them(eager_target):
    ids = torch.tensor(PROMPTS[:1])
    *_, final = eager_target.stream(ids, max_new_tokens=4, **BOTH)
    whole = eager_target.generate(ids, max_new_tokens=4, **BOTH)
    _assert_layered_close(final.attentions, whole.attentions)
    _assert_layered_close(final.hidden_states, whole.hidden_states)
