"""`cache_implementation="static"` (and `max_cache_len`) through a real target service: a StaticCache of
transformers' size gives transformers' static-cache tokens, and the dynamic cache's (ids exact, scores
within 1e-4), for greedy, sampling, beams and left padding; speculative requests are refused as
transformers refuses them; `max_cache_len` without a static cache is a warning."""

from __future__ import annotations

import pytest
import torch
import transformers

from specwire.client import SpecwireRpcError, TargetClient
from specwire.generation.config import GenerationConfig
from specwire.generation.loops.generate import generate
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from tests.servers import threaded_server

IDS = torch.tensor([[0, 0, 5, 6, 7, 8], [20, 21, 22, 23, 24, 25]])
MASK = (IDS != 0).long()
SCORES = dict(output_scores=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def target(loaded):
    with threaded_server(lambda: build_target_server(loaded)) as server:
        with TargetClient(server.address) as client:
            yield client


def _close(ours, theirs):
    assert len(ours) == len(theirs)
    for mine, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_new_tokens=8),
        dict(max_new_tokens=6, num_beams=3, num_return_sequences=2),
        dict(max_new_tokens=6, max_cache_len=64),
        dict(max_new_tokens=7, repetition_penalty=1.4, no_repeat_ngram_size=2),
    ],
)
def test_static_cache_equals_transformers_and_the_dynamic_cache(target, tiny_model_dir, kwargs):
    ours = target.generate(IDS, attention_mask=MASK, cache_implementation="static", **SCORES, **kwargs)
    dynamic = target.generate(IDS, attention_mask=MASK, **SCORES, **kwargs)
    # A fresh model: transformers sizes a static cache by the largest any earlier call on it used.
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    want = reference.generate(IDS, attention_mask=MASK, cache_implementation="static", **SCORES, **kwargs)
    assert ours.sequences.tolist() == want.sequences.tolist() == dynamic.sequences.tolist()
    _close(ours.scores, want.scores)
    _close(ours.scores, dynamic.scores)
    assert not [w for w in ours.warnings if w.field in ("config.cache_implementation", "config.max_cache_len")]


def test_the_loop_really_uses_a_static_cache(loaded, monkeypatch):
    import transformers as tf

    made = []
    original = tf.StaticCache.__init__

    def spy(self, *args, **kwargs):
        made.append(kwargs.get("max_cache_len"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(tf.StaticCache, "__init__", spy)
    config = GenerationConfig(cache_implementation="static", max_new_tokens=5)
    generate(loaded.model, IDS, MASK, config=config)
    assert made == [IDS.shape[1] + 5 - 1]  # transformers' size: max_length - 1


def test_seeded_sampling_with_a_static_cache_equals_the_dynamic_cache(target):
    kwargs = dict(max_new_tokens=8, do_sample=True, seed=7, top_k=20)
    static = target.generate(IDS, attention_mask=MASK, cache_implementation="static", **kwargs)
    assert static.sequences.tolist() == target.generate(IDS, attention_mask=MASK, **kwargs).sequences.tolist()


@pytest.mark.parametrize("kwargs", [dict(prompt_lookup_num_tokens=3), dict(proposer="prompt_lookup")])
def test_speculation_with_a_static_cache_is_refused_as_transformers_refuses_it(target, kwargs):
    with pytest.raises(SpecwireRpcError) as info:
        target.generate(IDS[1:], max_new_tokens=8, cache_implementation="static", **kwargs)
    assert info.value.code().name == "INVALID_ARGUMENT" and "cache_implementation" in str(info.value)


def test_max_cache_len_without_a_static_cache_is_a_warning(target):
    out = target.generate(IDS, attention_mask=MASK, max_new_tokens=3, max_cache_len=64)
    assert [w for w in out.warnings if w.field == "config.max_cache_len" and "not honoured" in w.message]


@pytest.mark.parametrize("alias", ["sliding_window", "hybrid_chunked"])
def test_the_deprecated_static_aliases_use_a_static_cache_as_transformers_does(target, tiny_model_dir, alias):
    kwargs = dict(max_new_tokens=7, **SCORES)
    ours = target.generate(IDS, attention_mask=MASK, cache_implementation=alias, **kwargs)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    want = reference.generate(IDS, attention_mask=MASK, cache_implementation=alias, **kwargs)
    assert type(want.past_key_values).__name__ == "StaticCache"
    assert ours.sequences.tolist() == want.sequences.tolist()
    _close(ours.scores, want.scores)
    assert not [w for w in ours.warnings if w.field == "config.cache_implementation"]
    with pytest.raises(SpecwireRpcError) as info:  # a static cache: no speculation, as for "static"
        target.generate(IDS[1:], max_new_tokens=4, cache_implementation=alias, proposer="prompt_lookup")
    assert info.value.code().name == "INVALID_ARGUMENT"


def test_an_alias_really_builds_a_static_cache(loaded, monkeypatch):
    made = []
    original = transformers.StaticCache.__init__

    def spy(self, *args, **kwargs):
        made.append(kwargs.get("max_cache_len"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.StaticCache, "__init__", spy)
    generate(loaded.model, IDS, MASK, config=GenerationConfig(cache_implementation="sliding_window", max_new_tokens=3))
    generate(loaded.model, IDS, MASK, config=GenerationConfig(cache_implementation="hybrid", max_new_tokens=3))
    assert made == [IDS.shape[1] + 3 - 1]  # "hybrid" is unset by transformers: a dynamic cache


def test_hybrid_is_the_dynamic_cache_without_a_warning(target):
    out = target.generate(IDS, attention_mask=MASK, max_new_tokens=4, cache_implementation="hybrid")
    assert out.sequences.tolist() == target.generate(IDS, attention_mask=MASK, max_new_tokens=4).sequences.tolist()
    assert not [w for w in out.warnings if w.field == "config.cache_implementation"]
