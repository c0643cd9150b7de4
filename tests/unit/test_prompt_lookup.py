"""Prompt lookup candidates against transformers 5.23 `PromptLookupCandidateGenerator`, row by row."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
from transformers.generation.logits_process import (
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TopPLogitsWarper,
)

from specwire.generation.speculation.prompt_lookup import banned_fn_from_processors, prompt_lookup_candidates

VOCAB = 7


def hf_candidates(ids: list[int], num_output_tokens, ngram, max_length, eos, processors=None) -> list[int]:
    generator = PromptLookupCandidateGenerator(
        eos_token_id=None if eos is None else torch.tensor(eos),
        num_output_tokens=num_output_tokens,
        max_matching_ngram_size=ngram,
        max_length=max_length,
        logits_processor=processors,
        vocab_size=VOCAB,
    )
    input_ids = torch.tensor([ids])
    candidate_input_ids, logits = generator.get_candidates(input_ids)
    assert logits is None
    return candidate_input_ids[0, len(ids) :].tolist()


def ours(ids: list[int], num_output_tokens, ngram, max_length, eos, processors=None) -> list[int]:
    banned_fn = None if processors is None else banned_fn_from_processors(processors, VOCAB)
    candidates, lengths = prompt_lookup_candidates(
        torch.tensor([ids]),
        num_output_tokens,
        max_length=max_length,
        max_matching_ngram_size=ngram,
        eos_token_ids=eos,
        banned_fn=banned_fn,
    )
    return candidates[0, : int(lengths[0])].tolist()


STRUCTURED = {
    # name: (ids, num_output_tokens, ngram, max_length, eos, expected)
    "bigram_match": ([1, 2, 3, 4, 5, 1, 2], 3, 2, 50, None, [3, 4, 5]),
    "first_occurrence_wins": ([1, 2, 3, 9, 1, 2, 4, 6, 1, 2], 2, 2, 50, None, [3, 9]),
    "longest_ngram_first": ([5, 2, 8, 8, 3, 2, 6, 6, 3, 2], 2, 2, 50, None, [6, 6]),
    "falls_back_to_unigram": ([4, 1, 6, 5, 0, 3, 2, 1], 3, 3, 50, None, [6, 5, 0]),
    "capped_by_sequence_end": ([1, 2, 3, 1, 2], 5, 2, 50, None, [3, 1, 2]),
    "cut_before_eos": ([1, 2, 3, 0, 4, 1, 2], 4, 2, 50, [0], [3]),
    "eos_first_gives_nothing": ([1, 2, 0, 3, 1, 2], 4, 2, 50, [0], []),
    "no_match": ([1, 2, 3, 4], 3, 2, 50, None, []),
    "one_slot_left": ([1, 2, 3, 1, 2], 3, 2, 6, None, []),
    "single_token": ([3], 3, 2, 50, None, []),
}


@pytest.mark.parametrize("case", STRUCTURED.values(), ids=STRUCTURED.keys())
def test_structured_cases(case):
    ids, num, ngram, max_length, eos, expected = case
    assert ours(ids, num, ngram, max_length, eos) == expected
    assert hf_candidates(ids, num, ngram, max_length, eos) == expected


def test_random_sequences_match_transformers():
    generator = torch.Generator().manual_seed(0)
    lengths_seen = set()
    for trial in range(400):
        length = int(torch.randint(1, 40, (1,), generator=generator))
        vocab = 3 + trial % 5  # small vocabularies make repeated n-grams common
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        num = 1 + trial % 8
        ngram = 1 + trial % 4
        max_length = length + 1 + int(torch.randint(0, 12, (1,), generator=generator))
        eos = [None, [0], [1, 2]][trial % 3]
        expected = hf_candidates(ids, num, ngram, max_length, eos)
        assert ours(ids, num, ngram, max_length, eos) == expected, (ids, num, ngram, max_length, eos)
        lengths_seen.add(len(expected))
    assert len(lengths_seen) >= 6


def make_processors(kind: int, prompt_len: int) -> LogitsProcessorList:
    eos = 0
    options = [
        [NoRepeatNGramLogitsProcessor(2)],
        [SuppressTokensLogitsProcessor([3])],
        [MinLengthLogitsProcessor(prompt_len + 3, eos)],
        [RepetitionPenaltyLogitsProcessor(1.3)],  # lowers scores but never bans
        [TopPLogitsWarper(0.6)],  # on flat logits, bans a fixed subset of the vocabulary
        [
            NoRepeatNGramLogitsProcessor(3),
            SuppressTokensLogitsProcessor([5]),
            MinLengthLogitsProcessor(prompt_len + 2, eos),
        ],
        # remove_invalid_values turns -inf into finfo.min, which still counts as banned.
        [SuppressTokensLogitsProcessor([2]), InfNanRemoveLogitsProcessor()],
        # Bans everything but EOS at the last position (forced_eos_token_id).
        [ForcedEOSTokenLogitsProcessor(prompt_len + 3, eos)],
    ]
    return LogitsProcessorList(options[kind % len(options)])


def test_processor_check_matches_transformers():
    generator = torch.Generator().manual_seed(1)
    truncated = 0
    for trial in range(300):
        length = int(torch.randint(4, 36, (1,), generator=generator))
        ids = torch.randint(0, 6, (length,), generator=generator).tolist()
        processors = make_processors(trial, length)
        num, ngram = 1 + trial % 6, 1 + trial % 3
        eos = [0] if trial % 2 else None
        expected = hf_candidates(ids, num, ngram, length + 20, eos, processors)
        assert ours(ids, num, ngram, length + 20, eos, processors) == expected, (trial, ids)
        truncated += len(expected) < len(ours(ids, num, ngram, length + 20, eos, None))
    assert truncated > 20


def test_banned_first_candidate_moves_to_next_match():
    ids = [1, 2, 3, 8, 1, 2, 4, 6, 1, 2]
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor([3])])
    vocab = 9
    banned_fn = banned_fn_from_processors(processors, vocab)
    candidates, lengths = prompt_lookup_candidates(torch.tensor([ids]), 2, max_length=50, banned_fn=banned_fn)
    # The first match proposes [3, 8]; 3 is suppressed, so the second match's [4, 6] wins.
    assert candidates[0, : int(lengths[0])].tolist() == [4, 6]
    # A ban after the first token truncates instead.
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor([8])])
    candidates, lengths = prompt_lookup_candidates(
        torch.tensor([ids]), 2, max_length=50, banned_fn=banned_fn_from_processors(processors, vocab)
    )
    assert candidates[0, : int(lengths[0])].tolist() == [3]


def test_batch_with_padding_and_per_row_settings():
    generator = torch.Generator().manual_seed(2)
    rows, width = 24, 30
    sequences, settings = [], []
    for row in range(rows):
        length = int(torch.randint(1, width + 1, (1,), generator=generator))
        sequences.append(torch.randint(0, 4, (length,), generator=generator).tolist())
        settings.append(
            dict(
                num=1 + row % 7,
                ngram=1 + row % 3,
                max_length=length + 1 + row % 5,
                eos=[[0], None, [1, 3]][row % 3],
            )
        )
    input_ids = torch.full((rows, width), 0, dtype=torch.long)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    for row, ids in enumerate(sequences):
        if row % 2:  # left padding
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        else:  # right padding
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
    processors = [make_processors(row, len(ids)) if row % 4 == 0 else None for row, ids in enumerate(sequences)]
    candidates, lengths = prompt_lookup_candidates(
        input_ids,
        [s["num"] for s in settings],
        max_length=torch.tensor([s["max_length"] for s in settings]),
        max_matching_ngram_size=[s["ngram"] for s in settings],
        eos_token_ids=[s["eos"] for s in settings],
        banned_fn=banned_fn_from_processors(processors, VOCAB),
        attention_mask=attention_mask,
        pad_id=-7,
    )
    assert candidates.shape == (rows, int(lengths.max()))
    for row, ids in enumerate(sequences):
        s = settings[row]
        expected = hf_candidates(ids, s["num"], s["ngram"], s["max_length"], s["eos"], processors[row])
        assert candidates[row, : int(lengths[row])].tolist() == expected, row
        assert (candidates[row, int(lengths[row]) :] == -7).all()
    assert int(lengths.max()) > 1 and int(lengths.min()) == 0


def test_unset_ngram_size_means_two():
    # Last trigram "1 9 2" first occurs at index 5 -> [6, 6]; last bigram "9 2" at index 1 -> [7, 7];
    # last unigram "2" at index 2 -> [7, 7] as well, so also check n = 1 on a bigram-only case.
    ids = torch.tensor([[5, 9, 2, 7, 7, 1, 9, 2, 6, 6, 1, 9, 2]])
    assert prompt_lookup_candidates(ids, 2, max_length=50)[0].tolist() == [[7, 7]]
    assert prompt_lookup_candidates(ids, 2, max_length=50, max_matching_ngram_size=0)[0].tolist() == [[7, 7]]
    assert prompt_lookup_candidates(ids, 2, max_length=50, max_matching_ngram_size=3)[0].tolist() == [[6, 6]]
    assert hf_candidates(ids[0].tolist(), 2, 2, 50, None) == [7, 7]
    assert hf_candidates(ids[0].tolist(), 2, 3, 50, None) == [6, 6]
    # Last bigram "9 2" at index 4 -> [8, 1]; the unigram "2" first occurs at index 1 -> [6, 6].
    ids = torch.tensor([[4, 2, 6, 6, 9, 2, 8, 1, 9, 2]])
    assert prompt_lookup_candidates(ids, 2, max_length=50)[0].tolist() == [[8, 1]]
    assert prompt_lookup_candidates(ids, 2, max_length=50, max_matching_ngram_size=1)[0].tolist() == [[6, 6]]


def test_empty_batch():
    candidates, lengths = prompt_lookup_candidates(torch.zeros(0, 5, dtype=torch.long), 3, max_length=10)
    assert candidates.shape == (0, 0) and lengths.shape == (0,)


def test_rejects_bad_arguments():
    ids = torch.tensor([[1, 2, 1]])
    with pytest.raises(ValueError, match="num_output_tokens"):
        prompt_lookup_candidates(ids, 0, max_length=10)
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        prompt_lookup_candidates(ids, 3, max_length=10, max_matching_ngram_size=-1)
    with pytest.raises(ValueError, match="2 entries for 1 rows"):
        prompt_lookup_candidates(ids, [3, 4], max_length=10)
    with pytest.raises(ValueError, match="attention_mask"):
        prompt_lookup_candidates(ids, 3, max_length=10, attention_mask=torch.ones(1, 2))


# --- specwire's default rule: the longest suffix match (SuffixMatcher, PromptLookupDrafter) -------------


def brute_force_longest(ids: list[int], k: int, min_match: int, max_match: int) -> list[int]:
    """The rule written out directly: the earliest earlier position with the longest suffix match."""
    best, best_length = None, 0
    for end in range(len(ids) - 1):
        length = 0
        while length < max_match and end - length >= 0 and ids[end - length] == ids[len(ids) - 1 - length]:
            length += 1
        if length >= min_match and length > best_length:
            best, best_length = end, length
    return [] if best is None else ids[best + 1 : best + 1 + k]


def test_suffix_matcher_equals_the_rule_written_out_while_the_row_grows():
    from specwire.generation.speculation.prompt_lookup import SuffixMatcher

    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        ids = torch.randint(0, 4, (int(torch.randint(1, 40, (1,), generator=generator)),), generator=generator)
        ids = ids.tolist()
        min_match, max_match = (1, 3) if trial % 3 == 0 else (2, 8)
        matcher = SuffixMatcher(ids[:3], min_match=min_match, max_match=max_match)
        for cut in range(3, len(ids) + 1):
            matcher.extend(ids[len(matcher.tokens) : cut])
            for k in (1, 4):
                assert matcher.propose(k) == brute_force_longest(ids[:cut], k, min_match, max_match), (ids[:cut], k)


def test_drafter_rules_and_cuts():
    from specwire.generation.config import GenerationConfig
    from specwire.generation.speculation.drafters import PromptLookupDrafter

    ids = [11, 12, 13, 19, 12, 13, 14, 19, 12, 13]
    greedy = GenerationConfig(do_sample=False, eos_token_id=14)
    # Longest match (19, 12, 13) proposes [14, ...]; 14 is the EOS, so nothing is left.
    assert PromptLookupDrafter([ids], greedy, 30).propose(3).tokens == [[]]
    assert PromptLookupDrafter([ids], GenerationConfig(do_sample=False), 30).propose(3).tokens == [[14, 19, 12]]
    # transformers' rule: the first occurrence of the bigram.
    transformers_rule = PromptLookupDrafter([ids], greedy, 30, rule="transformers")
    assert transformers_rule.propose(3).tokens == [[19, 12, 13]]
    # A processor that bans a token cuts the proposal before it (here: token 12 suppressed).
    suppress = GenerationConfig(do_sample=False, suppress_tokens=[12])
    assert PromptLookupDrafter([ids], suppress, 30).propose(3).tokens == [[14, 19]]
    # max_matching_ngram_size=1 allows one-token matches; the default does not.
    short = [5, 6, 7, 8, 6]
    assert PromptLookupDrafter([short], GenerationConfig(do_sample=False), 30).propose(2).tokens == [[]]
    assert PromptLookupDrafter([short], GenerationConfig(max_matching_ngram_size=1), 30).propose(2).tokens == [[7, 8]]
    with pytest.raises(ValueError, match="rule must be one of"):
        PromptLookupDrafter([ids], greedy, 30, rule="fastest")
