"""Logits processors: build_logits_processors against transformers' own factory."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from transformers.generation import logits_process as hf

from specwire.generation.processors import LogitsProcessorList, build_logits_processors
from tests.unit.processor_cases import _same

# ------------------------------------------------------------------------------------------ factory

FACTORY_CASES = [
    ("greedy-defaults", {}, {}),
    ("sample-defaults", {"do_sample": True}, {}),
    (
        "all-warpers",
        {
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
            "min_p": 0.05,
            "typical_p": 0.9,
            "epsilon_cutoff": 3e-4,
            "eta_cutoff": 3e-4,
            "top_h": 0.6,
            "top_k": 20,
        },
        {},
    ),
    ("beam-sample-mtk", {"do_sample": True, "num_beams": 2, "top_k": 1, "top_p": 0.1, "min_p": 0.9}, {}),
    ("beam-sample-no-eos", {"do_sample": True, "num_beams": 3, "top_k": 1}, {"eos": None}),
    ("warpers-off-without-sampling", {"do_sample": False, "temperature": 0.5, "top_p": 0.5, "top_k": 5}, {}),
    (
        "disabled-values",
        {
            "do_sample": True,
            "top_k": 0,
            "top_p": 1.0,
            "typical_p": 1.0,
            "epsilon_cutoff": 0.0,
            "eta_cutoff": 1.0,
            "temperature": 1.0,
            "repetition_penalty": 1.0,
            "encoder_repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0,
        },
        {},
    ),
    (
        "penalties-and-bias",
        {
            "repetition_penalty": 1.3,
            "encoder_repetition_penalty": 1.1,
            "no_repeat_ngram_size": 2,
            "encoder_no_repeat_ngram_size": 3,
            "bad_words_ids": [[5], [6, 7], [2]],
            "sequence_bias": [[[8], 1.5], [[9, 10], -2.0]],
            "min_length": 12,
            "min_new_tokens": 3,
        },
        {},
    ),
    ("left-padding", {"repetition_penalty": 1.5}, {"pad": [2, 0]}),
    ("min-length-needs-eos", {"min_length": 12, "min_new_tokens": 3, "bad_words_ids": [[2]]}, {"eos": None}),
    (
        "length-and-suppress",
        {
            "forced_bos_token_id": 1,
            "forced_eos_token_id": 2,
            "remove_invalid_values": True,
            "exponential_decay_length_penalty": (1, 1.5),
            "suppress_tokens": [3, 4],
            "begin_suppress_tokens": [5],
            "renormalize_logits": True,
        },
        {},
    ),
    (
        "begin-index-one-token-prompt",
        {"forced_bos_token_id": 1, "begin_suppress_tokens": [5, 6]},
        {"input_len": 1},
    ),
    ("cfg-last-token", {"guidance_scale": 1.5}, {}),
    ("cfg-negative-prompt", {"guidance_scale": 2.0, "do_sample": True, "top_k": 10}, {"negative": True}),
    (
        "watermark-lefthash",
        {"watermarking_config": {"bias": 2.5}, "do_sample": True, "renormalize_logits": True},
        {},
    ),
    ("watermark-selfhash", {"watermarking_config": {"seeding_scheme": "selfhash", "context_width": 2}}, {}),
]


def _transformers_config(fields: dict, eos, max_length: int):
    from transformers import GenerationConfig

    gc = GenerationConfig(**fields)
    # What generate() does before building processors: global defaults fill unset fields.
    for key, value in GenerationConfig._get_default_generation_params().items():
        if getattr(gc, key, None) is None:
            setattr(gc, key, value)
    gc.max_length = max_length
    gc.eos_token_id = eos
    return gc


FIELDS = [
    "guidance_scale",
    "use_cache",
    "sequence_bias",
    "encoder_repetition_penalty",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "do_sample",
    "num_beams",
    "temperature",
    "top_h",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "renormalize_logits",
    "max_length",
]


@pytest.mark.parametrize("name,fields,setup", FACTORY_CASES, ids=[c[0] for c in FACTORY_CASES])
def test_factory_matches_transformers(tiny_model, name, fields, setup):
    vocab = tiny_model.config.vocab_size
    eos = setup.get("eos", [2])
    input_len = setup.get("input_len", 6)
    g = torch.Generator().manual_seed(len(name))
    batch = 2
    prompt = torch.randint(3, vocab, (batch, input_len), generator=g)
    pad = setup.get("pad")
    mask = None
    if pad is not None:
        mask = torch.ones(batch, input_len, dtype=torch.long)
        for row, n in enumerate(pad):
            mask[row, :n] = 0
            prompt[row, :n] = 0
    negative = torch.randint(3, vocab, (batch, 3), generator=g) if setup.get("negative") else None
    gc = _transformers_config(fields, eos, max_length=input_len + 5)
    ns = types.SimpleNamespace(**{k: getattr(gc, k) for k in FIELDS})
    ns.watermarking_config = fields.get("watermarking_config")  # our config carries the plain dict
    beams = gc.num_beams
    rows = batch * beams
    rows_prompt = prompt.repeat_interleave(beams, dim=0)  # generate() expands before building processors
    rows_mask = mask.repeat_interleave(beams, dim=0) if mask is not None else None

    tiny_model._prepare_special_tokens(gc, device="cpu")
    theirs = tiny_model._get_logits_processor(
        generation_config=gc,
        input_ids_seq_length=input_len,
        encoder_input_ids=prompt,
        logits_processor=hf.LogitsProcessorList(),
        device=torch.device("cpu"),
        model_kwargs={"attention_mask": rows_mask},
        negative_prompt_ids=negative,
    )
    pad_lengths = (rows_mask != 0).int().argmax(dim=1) if rows_mask is not None else None
    ours = build_logits_processors(
        ns,
        input_len=input_len,
        vocab_size=vocab,
        eos_token_ids=eos,
        num_beams=beams,
        prompt_ids=prompt,
        prompt_pad_lengths=pad_lengths,
        model=tiny_model,
        negative_prompt_ids=negative,
    )
    assert isinstance(ours, LogitsProcessorList)
    assert [type(p).__name__ for p in ours] == [type(p).__name__ for p in theirs]
    for ours_p, theirs_p in zip(ours, theirs, strict=True):
        if hasattr(theirs_p, "min_tokens_to_keep"):
            assert ours_p.min_tokens_to_keep == theirs_p.min_tokens_to_keep
        if hasattr(theirs_p, "begin_index"):
            assert ours_p.begin_index == theirs_p.begin_index
    ids = rows_prompt
    with torch.no_grad():
        for _ in range(4):  # consecutive steps, the CFG branch included
            scores = torch.randn(rows, vocab, generator=g) * 4
            got = ours(ids, scores)
            torch.testing.assert_close(got, theirs(ids, scores.clone()), rtol=1e-6, atol=1e-6, equal_nan=True)
            next_ids = torch.where(torch.isfinite(got).any(-1), got.argmax(-1), 0)
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
    if name == "greedy-defaults":
        assert len(ours) == 0
    if name == "sample-defaults":
        assert [type(p).__name__ for p in ours] == ["TopKLogitsWarper"]  # top_k=50 is on by default


def test_factory_warns_and_errors():
    ns = types.SimpleNamespace(encoder_repetition_penalty=1.2, encoder_no_repeat_ngram_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        procs = build_logits_processors(
            ns,
            input_len=2,
            vocab_size=10,
            eos_token_ids=2,
            num_beams=1,
            prompt_ids=torch.tensor([[-100, -100]]),
        )
    assert len(procs) == 0 and len(caught) == 2
    with pytest.raises(ValueError, match="no `eos_token_id`"):
        build_logits_processors(
            types.SimpleNamespace(exponential_decay_length_penalty=(1, 1.1)),
            input_len=2,
            vocab_size=10,
            eos_token_ids=None,
            num_beams=1,
            prompt_ids=torch.tensor([[1, 2]]),
        )
    with pytest.raises(ValueError, match="Unknown SynthID"):
        build_logits_processors(
            types.SimpleNamespace(watermarking_config={"ngram_len": 5, "keys": [1, 2], "zz": 1}),
            input_len=2,
            vocab_size=10,
            eos_token_ids=2,
            num_beams=1,
            prompt_ids=torch.tensor([[1, 2]]),
        )
    with pytest.raises(ValueError, match="pass `model=`"):
        build_logits_processors(
            types.SimpleNamespace(guidance_scale=1.5),
            input_len=2,
            vocab_size=10,
            eos_token_ids=2,
            num_beams=1,
            prompt_ids=torch.tensor([[1, 2]]),
        )
    with pytest.raises(ValueError, match="strictly positive float"):
        build_logits_processors(
            types.SimpleNamespace(do_sample=True, temperature=0.0),
            input_len=2,
            vocab_size=10,
            eos_token_ids=2,
            num_beams=1,
            prompt_ids=torch.tensor([[1, 2]]),
        )


def test_factory_reads_our_generation_config():
    """Our dataclass works as-is (JSON forms: list sequence_bias, list decay pair, dict watermark)."""
    from specwire.generation.config import GenerationConfig

    config = GenerationConfig(
        do_sample=True,
        top_k=5,
        sequence_bias={(1,): 1.0, (2, 3): -1.0},
        watermarking_config={"bias": 2.5},
        exponential_decay_length_penalty=[2, 1.1],
        repetition_penalty=1.2,
    )
    procs = build_logits_processors(
        config, input_len=2, vocab_size=50, eos_token_ids=[2], num_beams=1, prompt_ids=torch.tensor([[4, 5]])
    )
    assert [type(p).__name__ for p in procs] == [
        "SequenceBiasLogitsProcessor",
        "RepetitionPenaltyLogitsProcessor",
        "ExponentialDecayLengthPenalty",
        "TopKLogitsWarper",
        "WatermarkLogitsProcessor",
    ]
    ids, scores = torch.tensor([[4, 5]]), torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    expected = hf.LogitsProcessorList(
        [
            hf.SequenceBiasLogitsProcessor({(1,): 1.0, (2, 3): -1.0}),
            hf.RepetitionPenaltyLogitsProcessor(1.2),
            hf.ExponentialDecayLengthPenalty((2, 1.1), [2], 2),
            hf.TopKLogitsWarper(5),
            hf.WatermarkLogitsProcessor(50, "cpu", bias=2.5),
        ]
    )
    _same(procs(ids, scores), expected(ids, scores.clone()))


def test_user_processors_go_where_transformers_merges_them():
    """After transformers' own processors (suppress tokens here), before the sampling warpers and the watermark:
    transformers 5.23's `_merge_criteria_processor_list` inserts a user list there."""
    from specwire.generation.config import GenerationConfig

    def user(input_ids, scores):
        return scores

    config = GenerationConfig(do_sample=True, top_k=5, suppress_tokens=[3], watermarking_config={"bias": 2.5})
    procs = build_logits_processors(
        config,
        input_len=2,
        vocab_size=50,
        eos_token_ids=[2],
        num_beams=1,
        prompt_ids=torch.tensor([[4, 5]]),
        user_processors=[user],
    )
    assert [type(p).__name__ for p in procs] == [
        "SuppressTokensLogitsProcessor",
        "function",
        "TopKLogitsWarper",
        "WatermarkLogitsProcessor",
    ]
