"""Draft-length schedules and the confidence stop, against transformers 5.23's own update code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig as HFGenerationConfig
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.stopping_criteria import ConfidenceCriteria

from specwire.generation.speculation.schedules import ConfidenceStop, DraftSchedule

# (num_accepted, num_drafted) rounds with full accepts, partial accepts, total misses and an empty draft.
ROUNDS = [(5, 5), (7, 7), (3, 9), (0, 8), (0, 7), (0, 1), (0, 1), (1, 1), (3, 3), (0, 0), (2, 4), (4, 4)]


def hf_generator(num_assistant_tokens: int, schedule: str, max_length: int = 100, min_length: int = 0):
    """The state `AssistedCandidateGenerator`'s methods read, without loading an assistant model."""
    return SimpleNamespace(
        num_assistant_tokens=num_assistant_tokens,
        assistant_generation_config=HFGenerationConfig(num_assistant_tokens_schedule=schedule),
        main_model_max_length=max_length,
        main_model_min_length=min_length,
    )


@pytest.mark.parametrize("schedule", ["constant", "heuristic", "heuristic_transient"])
def test_update_matches_transformers(schedule):
    ours = DraftSchedule(5, schedule)
    theirs = hf_generator(5, schedule)
    history = []
    for num_accepted, num_drafted in ROUNDS:
        scores = torch.zeros(1, num_drafted + 1, 4)  # only len(scores[0]) is read
        AssistedCandidateGenerator.update_candidate_strategy(
            theirs, torch.zeros(1, 3, dtype=torch.long), scores, num_accepted
        )
        ours.update(num_accepted, num_drafted)
        assert ours.num_assistant_tokens == theirs.num_assistant_tokens
        history.append(ours.num_assistant_tokens)
    if schedule == "constant":
        assert set(history) == {5}
    else:
        # 5 -> +2 -> +2 -> -1 -> -1 ... floor at 1 ... an empty draft counts as fully accepted.
        assert history == [7, 9, 8, 7, 6, 5, 4, 6, 8, 10, 9, 11]


def test_heuristic_floor_is_one():
    schedule = DraftSchedule(2, "heuristic")
    for _ in range(4):
        schedule.update(0, 3)
    assert schedule.num_assistant_tokens == 1


def test_state_is_per_request_and_never_leaks():
    # transformers writes a "heuristic" value back to the shared assistant; we start every request
    # from the configured value, so two requests built from one config do not see each other.
    config = SimpleNamespace(num_assistant_tokens=6, num_assistant_tokens_schedule="heuristic")
    first = DraftSchedule.from_config(config)
    for _ in range(3):
        first.update(first.num_assistant_tokens, first.num_assistant_tokens)
    assert first.num_assistant_tokens == 12
    second = DraftSchedule.from_config(config)
    assert second.num_assistant_tokens == 6
    first.reset()
    assert first.num_assistant_tokens == 6


def test_from_config_applies_transformers_defaults():
    schedule = DraftSchedule.from_config(SimpleNamespace(num_assistant_tokens=None, num_assistant_tokens_schedule=None))
    assert (schedule.num_assistant_tokens, schedule.schedule) == (20, "constant")
    hf_config = HFGenerationConfig(num_assistant_tokens=3, num_assistant_tokens_schedule="heuristic_transient")
    schedule = DraftSchedule.from_config(hf_config)
    assert (schedule.num_assistant_tokens, schedule.schedule) == (3, "heuristic_transient")


@pytest.mark.parametrize(
    "num_tokens, cur_len, max_length, min_length",
    [
        (20, 10, 100, 0),
        (20, 90, 100, 0),
        (5, 98, 100, 0),
        (5, 99, 100, 0),
        (7, 10, 100, 14),
        (7, 10, 100, 50),
        (3, 10, 12, 30),
        (0, 10, 100, 0),
    ],
)
def test_draft_bounds_match_transformers(num_tokens, cur_len, max_length, min_length):
    theirs = hf_generator(num_tokens, "constant", max_length, min_length)
    expected = AssistedCandidateGenerator._calculate_new_tokens(theirs, torch.zeros(1, cur_len, dtype=torch.long))
    ours = DraftSchedule(num_tokens)
    assert ours.draft_bounds(cur_len, max_length, min_length) == expected
    assert ours.num_draft_tokens(cur_len, max_length) == expected[1]


def test_draft_length_capped_by_max_length():
    schedule = DraftSchedule(10, "heuristic")
    assert schedule.num_draft_tokens(cur_len=40, max_length=45) == 4  # one slot left for the bonus token
    assert schedule.num_draft_tokens(cur_len=44, max_length=45) == 0  # plain decoding step
    assert schedule.num_draft_tokens(cur_len=45, max_length=45) == 0  # never negative


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"schedule": "adaptive"}, "has to be one of"),
        ({"num_assistant_tokens": -1}, "non-negative"),
        ({"num_assistant_tokens": 2.5}, "integer"),
        ({"num_assistant_tokens": True}, "integer"),
    ],
)
def test_schedule_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftSchedule(**kwargs)


def test_update_rejects_impossible_counts():
    with pytest.raises(ValueError, match="num_accepted"):
        DraftSchedule(4, "heuristic").update(5, 4)


# ---------------------------------------------------------------------------------------------
# ConfidenceStop


@pytest.mark.parametrize("threshold", [0.4, 0.1, 0.9, 0.3333333333333333])
def test_confidence_stop_matches_transformers_criteria(threshold):
    generator = torch.Generator().manual_seed(2)
    rows, vocab = 200, 5
    scores = torch.randn(rows, vocab, generator=generator) * 2
    tokens = torch.multinomial(scores.softmax(-1), 1, generator=generator).view(rows)
    ours = ConfidenceStop(threshold)(tokens, scores)
    criteria = ConfidenceCriteria(threshold)
    expected = [bool(criteria(torch.tensor([[7, int(tokens[row])]]), (scores[row : row + 1],))) for row in range(rows)]
    assert ours.tolist() == expected
    assert 0 < sum(expected) < rows


def test_confidence_stop_on_the_boundary_compares_in_float64():
    # softmax([0, log 2]) = [1/3, 2/3] in float32; the Python threshold 1/3 must be compared exactly.
    scores = torch.tensor([[0.0, float(torch.tensor(2.0).log())]])
    prob = float(scores.softmax(-1)[0, 0])
    token = torch.tensor([0])
    for threshold in (prob, prob + 1e-12, prob - 1e-12):
        expected = bool(ConfidenceCriteria(threshold)(torch.tensor([[0]]), (scores,)))
        assert bool(ConfidenceStop(threshold)(token, scores)[0]) == expected
    assert bool(ConfidenceStop(prob + 1e-12)(token, scores)[0])
    assert not bool(ConfidenceStop(prob)(token, scores)[0])


def test_confidence_stop_disabled_and_per_row_thresholds():
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0]] * 3)  # every token has probability 0.25
    tokens = torch.tensor([1, 2, 3])
    assert not ConfidenceStop(None).enabled
    assert not ConfidenceStop(0.0).enabled
    assert ConfidenceStop(None)(tokens, scores).tolist() == [False, False, False]
    assert ConfidenceStop(0.0)(tokens, scores).tolist() == [False, False, False]
    assert ConfidenceStop(0.4)(tokens, scores).tolist() == [True, True, True]
    per_row = ConfidenceStop([0.4, None, 0.2])
    assert per_row.enabled
    assert per_row(tokens, scores).tolist() == [True, False, False]
    with pytest.raises(ValueError, match="thresholds for 2 rows"):
        per_row(tokens[:2], scores[:2])
    with pytest.raises(ValueError, match="assistant_confidence_threshold"):
        ConfidenceStop("high")


def test_confidence_stop_from_config_default():
    assert ConfidenceStop.from_config(SimpleNamespace(assistant_confidence_threshold=None)).threshold == 0.4
    assert ConfidenceStop.from_config(SimpleNamespace(assistant_confidence_threshold=0.0)).threshold == 0.0
