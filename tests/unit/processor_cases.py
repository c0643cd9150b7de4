"""Shared by the logits-processor tests: random cases, exact comparison, and the table of processors
paired with their transformers counterparts."""

from __future__ import annotations

import torch
from transformers.generation import logits_process as hf

from specwire.generation import processors as sw

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
