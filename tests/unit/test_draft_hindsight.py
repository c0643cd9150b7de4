"""A draft model's hindsight (`ModelDrafter.look_back`, `Proposal.hindsight`): the tokens of the target's time off
that it checks, and its guesses of them, are the ones a full forward over the same tokens gives: `kept` counts the
guesses that were right and sure (above the confidence threshold), `confident` the sure ones."""

from __future__ import annotations

import pytest
import torch

from specwire.generation.config import GenerationConfig
from specwire.generation.speculation.drafters import Hindsight, ModelDrafter, Proposal

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6]
# The target's tokens: after the first block (none of it kept), a correction, then a time off: 4 tokens the draft
# would have drafted itself (`_time_off`), then 4 others.
CORRECTION = [41]
OTHERS = [12, 99, 7, 250]
THRESHOLD = 0.025  # the confidence threshold: the tiny draft's guesses fall on both sides of it


def _expected(model, tokens: list[int], first: int, threshold: float) -> Hindsight:
    """Guesses of `tokens[first:]` from one forward over all of them: argmax and softmax of each previous position."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    guesses = logits[first - 1 : len(tokens) - 1]
    right = guesses.argmax(-1) == torch.tensor(tokens[first:])
    sure = guesses.softmax(-1).max(-1).values >= threshold
    return Hindsight(len(tokens) - first, int((right & sure).sum()), int(sure.sum()))


def _greedy(model, tokens: list[int], count: int) -> list[int]:
    tokens = list(tokens)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[-count:]


@pytest.fixture(scope="module")
def time_off(tiny_draft) -> list[int]:
    return _greedy(tiny_draft.model, PROMPT + CORRECTION, 4) + OTHERS


def _config(do_sample: bool = False) -> GenerationConfig:
    return GenerationConfig(eos_token_id=2, do_sample=do_sample, assistant_confidence_threshold=THRESHOLD)


def _drafter(tiny_draft, do_sample: bool = False) -> ModelDrafter:
    generator = torch.Generator().manual_seed(0)
    return ModelDrafter(tiny_draft.model, [list(PROMPT)], _config(do_sample), 378, generator=generator)


def test_a_look_back_checks_the_time_off_against_a_full_forward(tiny_draft, time_off):
    drafter = _drafter(tiny_draft)
    first = drafter.propose(3)
    assert first.hindsight == [Hindsight()]  # the prompt is not checked: the target emitted none of it
    drafter.feedback([0], [CORRECTION], [False])
    for token in time_off:  # rounds without a proposal: the target decodes alone
        drafter.feedback([0], [[token]], [False])
    seen = drafter.propose(0)
    assert seen.tokens == [[]]
    tokens = PROMPT + CORRECTION + time_off
    # The correction answered the block: not a fair check. Every token after it is.
    expected = _expected(tiny_draft.model, tokens, len(PROMPT) + 1, threshold=THRESHOLD)
    assert seen.hindsight == [expected]
    assert expected.checked == len(time_off) and 0 < expected.kept <= expected.confident < len(time_off)
    assert drafter.propose(0).hindsight == [Hindsight()]  # reported once

    # Caught up, the draft proposes what a fresh draft of the same tokens proposes.
    fresh = ModelDrafter(tiny_draft.model, [list(tokens)], _config(), 378)
    assert drafter.propose(4).tokens == fresh.propose(4).tokens


def test_a_block_after_time_off_reports_the_time_off_too(tiny_draft, time_off):
    """A block asked right after time off (a probe) catches up on the same tokens and reports them."""
    drafter = _drafter(tiny_draft)
    drafter.propose(2)
    drafter.feedback([0], [CORRECTION], [False])
    for token in time_off[:5]:
        drafter.feedback([0], [[token]], [False])
    proposal = drafter.propose(3)
    tokens = PROMPT + CORRECTION + time_off[:5]
    # The last token is the forward's input: its guess came from the one before, checked too.
    assert proposal.hindsight == [_expected(tiny_draft.model, tokens, len(PROMPT) + 1, threshold=THRESHOLD)]


def test_the_token_after_a_kept_block_is_not_checked(tiny_draft, time_off):
    """The bonus token after a block the target kept whole answers that block: only the time off after it counts."""
    drafter = _drafter(tiny_draft)
    block = drafter.propose(3).tokens[0]
    drafter.feedback([len(block)], [[77]], [False])
    for token in time_off:
        drafter.feedback([0], [[token]], [False])
    tokens = PROMPT + block + [77] + time_off
    assert drafter.propose(0).hindsight == [_expected(tiny_draft.model, tokens, len(tokens) - len(time_off), THRESHOLD)]


def test_a_sampling_draft_reports_no_hindsight(tiny_draft):
    """Sampled drafts are kept by chance, not when they equal the target's token: argmax agreement says nothing."""
    drafter = _drafter(tiny_draft, do_sample=True)
    drafter.propose(2)
    drafter.feedback([0], [CORRECTION], [False])
    for token in OTHERS:
        drafter.feedback([0], [[token]], [False])
    assert drafter.propose(0).hindsight == [Hindsight()]


def test_a_look_back_on_the_opening_context_prefills_all_of_it(tiny_draft, time_off):
    """A look-back before anything was fed back (a draft service prefilling the prompt: `RemoteDrafter.prefill`)
    takes the whole prompt in one forward, so the target's tokens come in forwards of their own; a later look-back
    checks every token of the time off but the first (guessed by the prompt's forward, before it was known)."""
    drafter = _drafter(tiny_draft)
    assert drafter.propose(0) == Proposal([[]], [None], [Hindsight()])
    assert drafter.rows[0].cached == len(PROMPT)
    for token in time_off:
        drafter.feedback([0], [[token]], [False])
    seen = drafter.propose(0)
    assert seen.hindsight == [_expected(tiny_draft.model, PROMPT + time_off, len(PROMPT) + 1, threshold=THRESHOLD)]
    assert seen.hindsight[0].checked == len(time_off) - 1
    # A look-back after tokens were fed back still leaves the last one for the next forward.
    assert drafter.rows[0].cached == len(PROMPT) + len(time_off) - 1
