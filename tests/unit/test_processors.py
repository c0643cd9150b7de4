"""Logits processors: hand-built expectations, bit-parity with transformers' classes, and the factory."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
from transformers.generation import logits_process as hf

from specwire.generation import processors as sw
from specwire.generation.processors import LogitsProcessorList, build_logits_processors

INF = float("inf")
VOCAB = 60


def _case(seed: int, rows: int = 6, vocab: int = VOCAB, cur_len: int = 10, id_range: int | None = None):
    """Random ids and scores with ties (scores rounded to halves) and some -inf entries."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.round(torch.randn(rows, vocab, generator=g) * 6) / 2  # [rows, vocab]
    scores[torch.rand(rows, vocab, generator=g) < 0.1] = -INF
    scores[0, : vocab // 2] = -INF  # a row with half the vocabulary already banned
    ids = torch.randint(0, id_range or vocab, (rows, cur_len), generator=g)  # [rows, cur_len]
    return ids, scores


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------------ hand-built


def test_repetition_penalty_known_values():
    scores = torch.tensor([[2.0, -2.0, 1.0, 4.0]])
    ids = torch.tensor([[0, 1, 1]])
    out = sw.RepetitionPenaltyLogitsProcessor(2.0)(ids, scores)
    assert out.tolist() == [[1.0, -4.0, 1.0, 4.0]]  # each distinct id once, sign-aware
    # Per-row ignore: row 0 ignores its first position (token 0), row 1 nothing.
    two = torch.tensor([[2.0, -2.0, 1.0, 4.0]] * 2)
    ids2 = torch.tensor([[0, 3], [0, 3]])
    out = sw.RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=torch.tensor([1, 0]))(ids2, two)
    assert out.tolist() == [[2.0, -2.0, 1.0, 2.0], [1.0, -2.0, 1.0, 2.0]]
    assert sw.RepetitionPenaltyLogitsProcessor(2.0, prompt_ignore_length=2)(ids2, two).tolist() == two.tolist()


def test_encoder_repetition_penalty_boosts_source_tokens():
    scores = torch.tensor([[2.0, -2.0, 1.0]] * 2)
    out = sw.EncoderRepetitionPenaltyLogitsProcessor(2.0, torch.tensor([[0, 1]]))(
        torch.zeros(2, 1, dtype=torch.long), scores
    )
    assert out.tolist() == [[4.0, -1.0, 1.0]] * 2


def test_no_repeat_ngram_known_values():
    ids = torch.tensor([[1, 2, 3, 1, 2], [1, 2, 3, 4, 5]])
    out = sw.NoRepeatNGramLogitsProcessor(3)(ids, torch.zeros(2, 6))
    assert out[0].tolist() == [0, 0, 0, -INF, 0, 0]  # "1 2" was followed by 3
    assert out[1].tolist() == [0.0] * 6
    assert torch.equal(sw.NoRepeatNGramLogitsProcessor(6)(ids, torch.zeros(2, 6)), torch.zeros(2, 6))


def test_encoder_no_repeat_ngram_known_values():
    proc = sw.EncoderNoRepeatNGramLogitsProcessor(2, torch.tensor([[4, 5, 4, 3]]))
    out = proc(torch.tensor([[9, 4], [9, 5]]), torch.zeros(2, 6))
    assert out.tolist() == [[0, 0, 0, -INF, 0, -INF], [0, 0, 0, 0, -INF, 0]]


def test_sequence_bias_and_bad_words_known_values():
    proc = sw.SequenceBiasLogitsProcessor({(1,): 1.5, (2, 3): -2.0, (4, 3): 1.0, (5, 6, 0): 0.5})
    ids = torch.tensor([[9, 4], [5, 2], [5, 6]])
    out = proc(ids, torch.zeros(3, 10))
    assert out[:, :4].tolist() == [[0, 1.5, 0, 1.0], [0, 1.5, 0, -2.0], [0.5, 1.5, 0, 0]]
    # The JSON form gives the same processor.
    same = sw.SequenceBiasLogitsProcessor([[[1], 1.5], [[2, 3], -2.0], [[4, 3], 1.0], [[5, 6, 0], 0.5]])
    assert torch.equal(same(ids, torch.zeros(3, 10)), out)
    bad = sw.NoBadWordsLogitsProcessor([[7], [2], [4, 8]], eos_token_id=2)
    out = bad(torch.tensor([[1, 4], [1, 1]]), torch.zeros(2, 10))
    assert out[:, [2, 7, 8]].tolist() == [[0, -INF, -INF], [0, -INF, 0]]  # EOS alone is never banned


def test_length_processors_known_values():
    scores = torch.zeros(2, 5)
    ids3 = torch.zeros(2, 3, dtype=torch.long)
    assert sw.MinLengthLogitsProcessor(4, [2, 3])(ids3, scores)[0].tolist() == [0, 0, -INF, -INF, 0]
    assert torch.equal(sw.MinLengthLogitsProcessor(3, 2)(ids3, scores), scores)
    assert sw.MinNewTokensLengthLogitsProcessor(2, 2, 2)(ids3, scores)[1].tolist() == [0, 0, -INF, 0, 0]
    assert torch.equal(sw.MinNewTokensLengthLogitsProcessor(1, 2, 2)(ids3, scores), scores)
    assert sw.ForcedBOSTokenLogitsProcessor(3)(ids3[:, :1], scores)[0].tolist() == [-INF, -INF, -INF, 0, -INF]
    assert torch.equal(sw.ForcedBOSTokenLogitsProcessor(3)(ids3, scores), scores)
    assert sw.ForcedEOSTokenLogitsProcessor(4, [1, 2])(ids3, scores)[0].tolist() == [-INF, 0, 0, -INF, -INF]
    assert torch.equal(sw.ForcedEOSTokenLogitsProcessor(5, 1)(ids3, scores), scores)


def test_suppress_and_numerics_known_values():
    scores = torch.tensor([[1.0, INF, -INF, math.nan]])
    ids = torch.zeros(1, 2, dtype=torch.long)
    assert sw.SuppressTokensLogitsProcessor([0, 9])(ids, scores)[0, 0] == -INF
    assert sw.SuppressTokensAtBeginLogitsProcessor([0], begin_index=2)(ids, scores)[0, 0] == -INF
    assert sw.SuppressTokensAtBeginLogitsProcessor([0], begin_index=3)(ids, scores)[0, 0] == 1.0
    info = torch.finfo(torch.float32)
    assert sw.InfNanRemoveLogitsProcessor()(ids, scores).tolist() == [[1.0, info.max, info.min, 0.0]]
    probs = sw.LogitNormalization()(ids, torch.tensor([[0.0, 0.0]]))
    assert torch.allclose(probs, torch.log(torch.tensor([[0.5, 0.5]])))


def test_exponential_decay_known_values():
    proc = sw.ExponentialDecayLengthPenalty((1, 2.0), eos_token_id=1, input_ids_seq_length=2)
    scores = torch.tensor([[0.0, -3.0, 5.0], [0.0, 4.0, 5.0]])
    assert torch.equal(proc(torch.zeros(2, 3, dtype=torch.long), scores), scores)  # start = 3: not yet
    out = proc(torch.zeros(2, 5, dtype=torch.long), scores)  # 2 past start: |s| * (2**2 - 1)
    assert out[:, 1].tolist() == [6.0, 16.0]


def test_warpers_known_values():
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    assert torch.allclose(sw.TemperatureLogitsWarper(0.5)(ids, scores), scores * 2)
    top_k = sw.TopKLogitsWarper(2)(ids, torch.tensor([[3.0, 1.0, 3.0, 2.0]]))
    assert top_k.tolist() == [[3.0, -INF, 3.0, -INF]]  # ties with the k-th value are kept
    assert sw.TopPLogitsWarper(0.7)(ids, scores).isinf().tolist() == [[False, False, True, True]]
    assert sw.TopPLogitsWarper(0.0)(ids, scores).isinf().sum() == 3
    # Uniform over 4: bottom masses 0.25, 0.5 are <= 1 - 0.5, so exactly two tokens go (boundary included).
    assert sw.TopPLogitsWarper(0.5)(ids, torch.zeros(1, 4)).isinf().sum() == 2
    assert sw.TopPLogitsWarper(0.5, min_tokens_to_keep=3)(ids, torch.zeros(1, 4)).isinf().sum() == 1
    assert sw.MinPLogitsWarper(0.3)(ids, scores).isinf().tolist() == [[False, False, True, True]]
    assert sw.EpsilonLogitsWarper(0.2)(ids, scores).isinf().tolist() == [[False, False, True, True]]
    # Typical: entropy 1.213 nats; |surprisal - H| ranks token 1 (1.386) before 0 (0.693).
    assert sw.TypicalLogitsWarper(0.2)(ids, scores).isinf().tolist() == [[True, False, True, True]]
    assert sw.TopHLogitsWarper(0.2)(ids, scores).isinf().tolist() == [[False, True, True, True]]
    kept = sw.EtaLogitsWarper(0.5)(ids, scores)
    eta = min(0.5, math.sqrt(0.5) * math.exp(-1.2130075))  # 0.2103
    assert kept.isinf().tolist() == [[False, False, True, True]] and eta > 0.125


def test_processors_do_not_modify_their_input():
    ids, scores = _case(0)
    before = scores.clone()
    for proc in _all_stateless(ids):
        proc(ids, scores)
        _same(scores, before)


# ------------------------------------------------------------------------------------------ parity

ENCODER = torch.tensor([[1, 2, 3, 1, 2, 4], [5, 5, 6, 7, 5, 5]])

# (name, ours, transformers), both built fresh per case.
PARITY = [
    ("temperature", lambda: sw.TemperatureLogitsWarper(0.7), lambda: hf.TemperatureLogitsWarper(0.7)),
    ("top_k", lambda: sw.TopKLogitsWarper(5), lambda: hf.TopKLogitsWarper(5)),
    (
        "top_k_beams",
        lambda: sw.TopKLogitsWarper(1, min_tokens_to_keep=3),
        lambda: hf.TopKLogitsWarper(1, min_tokens_to_keep=3),
    ),
    ("top_k_large", lambda: sw.TopKLogitsWarper(500), lambda: hf.TopKLogitsWarper(500)),
    ("top_p", lambda: sw.TopPLogitsWarper(0.8), lambda: hf.TopPLogitsWarper(0.8)),
    ("top_p_zero", lambda: sw.TopPLogitsWarper(0.0), lambda: hf.TopPLogitsWarper(0.0)),
    (
        "top_p_beams",
        lambda: sw.TopPLogitsWarper(0.3, min_tokens_to_keep=3),
        lambda: hf.TopPLogitsWarper(0.3, min_tokens_to_keep=3),
    ),
    ("min_p", lambda: sw.MinPLogitsWarper(0.1), lambda: hf.MinPLogitsWarper(0.1)),
    (
        "min_p_beams",
        lambda: sw.MinPLogitsWarper(0.9, min_tokens_to_keep=3),
        lambda: hf.MinPLogitsWarper(0.9, min_tokens_to_keep=3),
    ),
    ("top_h", lambda: sw.TopHLogitsWarper(0.4), lambda: hf.TopHLogitsWarper(0.4)),
    ("typical", lambda: sw.TypicalLogitsWarper(0.5), lambda: hf.TypicalLogitsWarper(0.5)),
    (
        "typical_beams",
        lambda: sw.TypicalLogitsWarper(0.2, min_tokens_to_keep=3),
        lambda: hf.TypicalLogitsWarper(0.2, min_tokens_to_keep=3),
    ),
    ("epsilon", lambda: sw.EpsilonLogitsWarper(0.02), lambda: hf.EpsilonLogitsWarper(0.02)),
    (
        "epsilon_beams",
        lambda: sw.EpsilonLogitsWarper(0.3, min_tokens_to_keep=3),
        lambda: hf.EpsilonLogitsWarper(0.3, min_tokens_to_keep=3),
    ),
    ("eta", lambda: sw.EtaLogitsWarper(0.02), lambda: hf.EtaLogitsWarper(0.02)),
    (
        "eta_beams",
        lambda: sw.EtaLogitsWarper(0.3, min_tokens_to_keep=3),
        lambda: hf.EtaLogitsWarper(0.3, min_tokens_to_keep=3),
    ),
    (
        "repetition",
        lambda: sw.RepetitionPenaltyLogitsProcessor(1.3),
        lambda: hf.RepetitionPenaltyLogitsProcessor(1.3),
    ),
    (
        "repetition_lt1",
        lambda: sw.RepetitionPenaltyLogitsProcessor(0.7),
        lambda: hf.RepetitionPenaltyLogitsProcessor(0.7),
    ),
    (
        "repetition_ignore_int",
        lambda: sw.RepetitionPenaltyLogitsProcessor(1.5, 4),
        lambda: hf.RepetitionPenaltyLogitsProcessor(1.5, 4),
    ),
    (
        "repetition_ignore_rows",
        lambda: sw.RepetitionPenaltyLogitsProcessor(1.5, torch.tensor([0, 3, 9, 1, 0, 12])),
        lambda: hf.RepetitionPenaltyLogitsProcessor(1.5, torch.tensor([0, 3, 9, 1, 0, 12])),
    ),
    (
        "encoder_repetition",
        lambda: sw.EncoderRepetitionPenaltyLogitsProcessor(1.7, ENCODER),
        lambda: hf.EncoderRepetitionPenaltyLogitsProcessor(1.7, ENCODER),
    ),
    ("no_repeat_1", lambda: sw.NoRepeatNGramLogitsProcessor(1), lambda: hf.NoRepeatNGramLogitsProcessor(1)),
    ("no_repeat_2", lambda: sw.NoRepeatNGramLogitsProcessor(2), lambda: hf.NoRepeatNGramLogitsProcessor(2)),
    ("no_repeat_3", lambda: sw.NoRepeatNGramLogitsProcessor(3), lambda: hf.NoRepeatNGramLogitsProcessor(3)),
    (
        "enc_no_repeat_1",
        lambda: sw.EncoderNoRepeatNGramLogitsProcessor(1, ENCODER),
        lambda: hf.EncoderNoRepeatNGramLogitsProcessor(1, ENCODER),
    ),
    (
        "enc_no_repeat_2",
        lambda: sw.EncoderNoRepeatNGramLogitsProcessor(2, ENCODER),
        lambda: hf.EncoderNoRepeatNGramLogitsProcessor(2, ENCODER),
    ),
    (
        "enc_no_repeat_3",
        lambda: sw.EncoderNoRepeatNGramLogitsProcessor(3, ENCODER),
        lambda: hf.EncoderNoRepeatNGramLogitsProcessor(3, ENCODER),
    ),
    (
        "sequence_bias",
        lambda: sw.SequenceBiasLogitsProcessor({(1,): 2.5, (2, 3): -1.5, (4, 3): 0.75, (5, 1, 3): 1.25, (3,): -0.5}),
        lambda: hf.SequenceBiasLogitsProcessor({(1,): 2.5, (2, 3): -1.5, (4, 3): 0.75, (5, 1, 3): 1.25, (3,): -0.5}),
    ),
    (
        "bad_words",
        lambda: sw.NoBadWordsLogitsProcessor([[1], [2, 3], [4, 2, 5], [0]], eos_token_id=[0]),
        lambda: hf.NoBadWordsLogitsProcessor([[1], [2, 3], [4, 2, 5], [0]], eos_token_id=[0]),
    ),
    (
        "min_length",
        lambda: sw.MinLengthLogitsProcessor(12, [0, 3]),
        lambda: hf.MinLengthLogitsProcessor(12, [0, 3]),
    ),
    (
        "min_new",
        lambda: sw.MinNewTokensLengthLogitsProcessor(4, 7, 3),
        lambda: hf.MinNewTokensLengthLogitsProcessor(4, 7, 3),
    ),
    (
        "forced_eos",
        lambda: sw.ForcedEOSTokenLogitsProcessor(11, [2, 4]),
        lambda: hf.ForcedEOSTokenLogitsProcessor(11, [2, 4]),
    ),
    ("inf_nan", lambda: sw.InfNanRemoveLogitsProcessor(), lambda: hf.InfNanRemoveLogitsProcessor()),
    (
        "decay",
        lambda: sw.ExponentialDecayLengthPenalty((3, 1.3), [0, 2], 4),
        lambda: hf.ExponentialDecayLengthPenalty((3, 1.3), [0, 2], 4),
    ),
    (
        "suppress",
        lambda: sw.SuppressTokensLogitsProcessor([1, 5, 99]),
        lambda: hf.SuppressTokensLogitsProcessor([1, 5, 99]),
    ),
    (
        "suppress_begin",
        lambda: sw.SuppressTokensAtBeginLogitsProcessor([1, 5], 10),
        lambda: hf.SuppressTokensAtBeginLogitsProcessor([1, 5], 10),
    ),
    ("normalize", lambda: sw.LogitNormalization(), lambda: hf.LogitNormalization()),
]


def _all_stateless(ids):
    return [ours() for _, ours, _ in PARITY]


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


# ------------------------------------------------------------------------------------- constructor errors

ERRORS = [
    (lambda: sw.TemperatureLogitsWarper(0.0), "set `do_sample=False`"),
    (lambda: sw.TemperatureLogitsWarper(2), "strictly positive float"),
    (lambda: sw.TemperatureLogitsWarper(-1.0), "strictly positive float"),
    (lambda: sw.TopKLogitsWarper(0), "strictly positive integer"),
    (lambda: sw.TopKLogitsWarper(3, min_tokens_to_keep=0), "min_tokens_to_keep"),
    (lambda: sw.TopPLogitsWarper(1.5), r"\[0, 1\]"),
    (lambda: sw.MinPLogitsWarper(-0.1), r"\[0, 1\]"),
    (lambda: sw.TopHLogitsWarper(0.0), r"\(0, 1\]"),
    (lambda: sw.TypicalLogitsWarper(1.0), "> 0 and < 1"),
    (lambda: sw.EpsilonLogitsWarper(0.0), "> 0 and < 1"),
    (lambda: sw.EtaLogitsWarper(1.0), "> 0 and < 1"),
    (lambda: sw.RepetitionPenaltyLogitsProcessor(0.0), "strictly positive float"),
    (lambda: sw.RepetitionPenaltyLogitsProcessor(2), "strictly positive float"),
    (lambda: sw.RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=-1), "non-negative"),
    (lambda: sw.RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=torch.zeros(2, 2)), "1-D"),
    (lambda: sw.EncoderRepetitionPenaltyLogitsProcessor(-1.0, ENCODER), "strictly positive float"),
    (lambda: sw.NoRepeatNGramLogitsProcessor(0), "strictly positive integer"),
    (lambda: sw.EncoderNoRepeatNGramLogitsProcessor(-2, ENCODER), "strictly positive integer"),
    (lambda: sw.SequenceBiasLogitsProcessor({}), "non-empty"),
    (lambda: sw.SequenceBiasLogitsProcessor({(1,): 2}), "has to be a float"),
    (lambda: sw.SequenceBiasLogitsProcessor({1: 2.0}), "tuples"),
    (lambda: sw.SequenceBiasLogitsProcessor([[[1, -2], 1.0]]), "non-negative"),
    (lambda: sw.NoBadWordsLogitsProcessor([]), "non-empty list"),
    (lambda: sw.NoBadWordsLogitsProcessor([1, 2]), "list of non-negative"),
    (lambda: sw.NoBadWordsLogitsProcessor([[2]], eos_token_id=2), "only lists end-of-sequence"),
    (lambda: sw.MinLengthLogitsProcessor(-1, 2), "non-negative integer"),
    (lambda: sw.MinNewTokensLengthLogitsProcessor(3, -1, 2), "non-negative integer"),
    (lambda: sw.MinLengthLogitsProcessor(3, [-2]), "non-negative integer token ids"),
    (lambda: sw.ForcedBOSTokenLogitsProcessor([1, 2]), "single token id"),
    (lambda: sw.ForcedEOSTokenLogitsProcessor(10, [1.5]), "non-negative integer token ids"),
    (lambda: sw.ExponentialDecayLengthPenalty(1.5, 2, 3), "pair"),
    (lambda: sw.WatermarkLogitsProcessor(100, seeding_scheme="middlehash"), "lefthash"),
    (lambda: sw.WatermarkLogitsProcessor(100, greenlist_ratio=1.0), r"\(0, 1\)"),
    (lambda: sw.WatermarkLogitsProcessor(100, context_width=0), "positive integer"),
    (lambda: sw.UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, None), "pass `model=`"),
]


@pytest.mark.parametrize("make,message", ERRORS)
def test_constructor_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_temperature_message_is_transformers_message():
    with pytest.raises(ValueError) as ours:
        sw.TemperatureLogitsWarper(0.0)
    with pytest.raises(ValueError) as theirs:
        hf.TemperatureLogitsWarper(0.0)
    assert str(ours.value) == str(theirs.value)


def test_call_time_errors():
    from specwire.errors import InvalidArgument

    with pytest.raises(ValueError, match="vocabulary size is 10"):
        sw.SequenceBiasLogitsProcessor({(12,): 1.0})(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 10))
    # Also an InvalidArgument naming its field, so a server answers INVALID_ARGUMENT, not INTERNAL.
    with pytest.raises(InvalidArgument) as caught:
        sw.NoBadWordsLogitsProcessor([[3], [12]])(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 10))
    assert [v.field for v in caught.value.violations] == ["bad_words_ids"]
    with pytest.raises(ValueError, match="one count per processed row"):
        sw.RepetitionPenaltyLogitsProcessor(1.2, torch.tensor([0, 1]))(
            torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 5)
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


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.eval()
    return model


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
    with pytest.raises(ValueError, match="SynthID"):
        build_logits_processors(
            types.SimpleNamespace(watermarking_config={"ngram_len": 5, "keys": [1, 2]}),
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
