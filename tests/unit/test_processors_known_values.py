"""Logits processors: hand-built expectations, and the errors of their constructors and calls."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation import logits_process as hf

from specwire.generation import processors as sw
from tests.unit.processor_cases import ENCODER, INF, _all_stateless, _case, _same

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
