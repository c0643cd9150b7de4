"""Logits processors: bit-parity with transformers' classes (stateless processors, watermark, guidance)."""

from __future__ import annotations

import math
import types

import pytest
import torch
from transformers.generation import logits_process as hf

from specwire.generation import processors as sw
from specwire.generation.processors import build_logits_processors
from tests.unit.processor_cases import INF, PARITY, _case, _same

# ------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("name,ours,theirs", PARITY, ids=[p[0] for p in PARITY])
def test_parity_with_transformers_on_random_inputs(name, ours, theirs):
    for seed in range(6):
        for cur_len in (1, 3, 10, 13):
            # A small id alphabet makes repeated n-grams and sequence-bias prefixes frequent.
            ids, scores = _case(seed, cur_len=cur_len, id_range=8 if seed % 2 else None)
            if seed == 5:
                scores[1, 3] = INF
                scores[2, 4] = math.nan
                if name not in ("inf_nan",):
                    scores = scores.nan_to_num(nan=0.0, posinf=7.0)
            expected = theirs()(ids, scores.clone())
            got = ours()(ids, scores)
            _same(got, expected)


def test_parity_processor_instances_keep_no_per_step_state():
    """Calling one instance on many prefixes (speculative verification) equals fresh instances."""
    ids, scores = _case(3, cur_len=14, id_range=6)
    for _, ours, theirs in PARITY:
        shared = ours()
        for cur_len in (14, 9, 12, 9, 13):
            _same(shared(ids[:, :cur_len], scores), theirs()(ids[:, :cur_len], scores.clone()))


def test_parity_float16_scores():
    ids, scores = _case(1)
    half = scores.to(torch.float16)
    for name, ours, theirs in PARITY:
        if name in ("top_h", "eta", "eta_beams"):
            continue  # torch.distributions.Categorical has no float16 CPU kernels for these paths
        _same(ours()(ids, half), theirs()(ids, half.clone()))


def test_forced_bos_parity():
    ids, scores = _case(2, cur_len=1)
    _same(
        sw.ForcedBOSTokenLogitsProcessor(7)(ids, scores),
        hf.ForcedBOSTokenLogitsProcessor(7)(ids, scores.clone()),
    )


# ------------------------------------------------------------------------------------------ watermark


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"seeding_scheme": "selfhash"},
        {"seeding_scheme": "selfhash", "context_width": 3, "hashing_key": 2**40 + 15},
        {"greenlist_ratio": 0.5, "bias": 1.25, "hashing_key": 7, "context_width": 2},
    ],
    ids=["lefthash", "selfhash", "selfhash-wide-bigkey", "lefthash-wide"],
)
def test_watermark_bit_identical_to_transformers(kwargs):
    vocab = 97
    ours = sw.WatermarkLogitsProcessor(vocab, **kwargs)
    theirs = hf.WatermarkLogitsProcessor(vocab, "cpu", **kwargs)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        scores = torch.randn(3, vocab, generator=g)
        for cur_len in (1, 4):
            ids = torch.randint(0, vocab, (3, cur_len), generator=g)
            out = ours(ids, scores)
            _same(out, theirs(ids, scores.clone()))
            if cur_len >= ours.context_width:
                assert (out != scores).any()


def test_watermark_lefthash_green_list_size():
    proc = sw.WatermarkLogitsProcessor(40, greenlist_ratio=0.25, bias=3.0)
    out = proc(torch.tensor([[5], [6]]), torch.zeros(2, 40))
    assert (out == 3.0).sum(dim=-1).tolist() == [10, 10]
    assert not torch.equal(out[0], out[1])  # different last tokens seed different lists


# ------------------------------------------------------------------------------------------ guidance


@pytest.mark.parametrize("negative", [False, True], ids=["last-token", "negative-prompt"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_cfg_matches_transformers_over_consecutive_steps(tiny_model, negative, use_cache):
    g = torch.Generator().manual_seed(0)
    vocab = tiny_model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 5), generator=g)
    neg_ids = torch.randint(3, vocab, (2, 3), generator=g) if negative else None
    neg_mask = torch.tensor([[0, 1, 1], [1, 1, 1]]) if negative else None
    ours = sw.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, tiny_model, neg_ids, neg_mask, use_cache=use_cache)
    theirs = hf.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, tiny_model, neg_ids, neg_mask, use_cache=use_cache)
    with torch.no_grad():
        for _ in range(4):
            scores = torch.randn(2, vocab, generator=g)
            got = ours(ids, scores)
            torch.testing.assert_close(got, theirs(ids, scores.clone()), rtol=1e-6, atol=1e-6)
            ids = torch.cat([ids, got.argmax(-1, keepdim=True)], dim=1)


@pytest.mark.parametrize("use_cache", [True, False])
def test_cfg_one_negative_prompt_is_broadcast_to_every_row(tiny_model, use_cache):
    """A [1, len] negative prompt guides each row as if that row were generated alone with it
    (transformers' batch-1 behaviour per row; it fails at the second step for more rows)."""
    g = torch.Generator().manual_seed(1)
    vocab = tiny_model.config.vocab_size
    ids = torch.randint(3, vocab, (3, 4), generator=g)
    neg_ids, neg_mask = torch.tensor([[11, 12, 13]]), torch.tensor([[0, 1, 1]])
    batched = sw.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, tiny_model, neg_ids, neg_mask, use_cache)
    alone = [
        hf.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, tiny_model, neg_ids, neg_mask, use_cache=use_cache)
        for _ in range(3)
    ]
    with torch.no_grad():
        for _ in range(3):
            scores = torch.randn(3, vocab, generator=g)
            got = batched(ids, scores)
            for row in range(3):
                want = alone[row](ids[row : row + 1], scores[row : row + 1].clone())
                torch.testing.assert_close(got[row : row + 1], want, rtol=1e-5, atol=1e-5)
            ids = torch.cat([ids, got.argmax(-1, keepdim=True)], dim=1)


def test_cfg_negative_prompt_rows_must_fit_the_batch(tiny_model):
    from specwire.errors import InvalidArgument

    vocab = tiny_model.config.vocab_size
    proc = sw.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, tiny_model, torch.tensor([[5], [6]]))
    with pytest.raises(InvalidArgument, match="negative_prompt_ids"):
        proc(torch.tensor([[1, 2]] * 3), torch.zeros(3, vocab))
    with pytest.raises(InvalidArgument, match="negative_prompt_attention_mask"):
        sw.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, tiny_model, torch.tensor([[5, 6]]), torch.tensor([[1]]))
    with pytest.raises(InvalidArgument, match="negative_prompt_ids"):
        build_logits_processors(
            types.SimpleNamespace(guidance_scale=1.5),
            input_len=2,
            vocab_size=vocab,
            eos_token_ids=None,
            num_beams=1,
            prompt_ids=torch.tensor([[1, 2]] * 3),
            model=tiny_model,
            negative_prompt_ids=torch.tensor([[5], [6]]),
        )
    # One per prompt is repeated for that prompt's rows (num_return_sequences / beams: [p0, p0, p1, p1]).
    per_prompt = sw.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, tiny_model, torch.tensor([[5], [6]]))
    ids = torch.tensor([[1, 2]] * 4)
    with torch.no_grad():
        out = per_prompt(ids, torch.zeros(4, vocab))
    torch.testing.assert_close(out[0], out[1])
    torch.testing.assert_close(out[2], out[3])
    assert not torch.allclose(out[1], out[2])


def test_cfg_rejects_non_consecutive_calls(tiny_model):
    proc = sw.UnbatchedClassifierFreeGuidanceLogitsProcessor(2.0, tiny_model)
    ids = torch.tensor([[5, 6, 7]])
    scores = torch.zeros(1, tiny_model.config.vocab_size)
    proc(ids, scores)
    with pytest.raises(RuntimeError, match="consecutive"):
        proc(ids, scores)
    unit = sw.UnbatchedClassifierFreeGuidanceLogitsProcessor(1, tiny_model)
    _same(unit(ids, scores), scores.log_softmax(-1))
