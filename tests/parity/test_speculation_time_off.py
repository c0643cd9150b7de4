"""Rounds in which no row drafts (a controller's time off) decode plainly: with a drafter that never proposes, the
speculative loop's tokens, scores and finish reasons equal plain greedy's, with a stop string that ends one row
of a batch before the other (the rounds after it take the general acceptance, with a finished row). And the loop
tells the controller which rounds' drafts were drafted ahead."""

from __future__ import annotations

import pytest
import torch

from specwire.generation.config import GenerationConfig, merge
from specwire.generation.loops.generate import drain, generate
from specwire.generation.loops.speculative import iter_speculative
from specwire.generation.speculation.controller import SpeculationController
from specwire.generation.speculation.costs import SharedCosts
from specwire.generation.speculation.drafters import Proposal
from specwire.generation.speculation.stats import SpeculationStats

from .test_decoding_parity import OUTPUT_FLAGS

PROMPTS = ["Hello there, how are", "A longer prompt, padded on the left of the other row"]


class SilentDrafter:
    """Proposes nothing, every round."""

    def __init__(self, rows):
        self.rows = len(rows)

    def propose(self, num_tokens):
        return Proposal([[] for _ in range(self.rows)], [None] * self.rows)

    def feedback(self, num_accepted, appended, finished):
        pass

    def close(self):
        pass


class AheadDrafter(SilentDrafter):
    """Proposes the target's own next tokens (`answer`: the prompt and plain greedy's tokens), every other block
    said to be drafted ahead (`Proposal.ahead_hit`)."""

    def __init__(self, rows, answer):
        super().__init__(rows)
        self.answer, self.at, self.proposed = answer, len(rows[0]), 0

    def propose(self, num_tokens):
        self.proposed += 1
        block = self.answer[self.at : self.at + num_tokens]
        return Proposal([block], [None], ahead_hit=self.proposed % 2 == 0)

    def feedback(self, num_accepted, appended, finished):
        self.at += num_accepted[0] + len(appended[0])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from specwire.models import load_model

    return load_model(str(tiny_model_dir), progress=False)


def _config(tiny, **kwargs):
    return merge(GenerationConfig.from_dict({**kwargs, **OUTPUT_FLAGS}), tiny.generation_config)


def _speculate(tiny, batch, config, drafter, stats, **kwargs):
    """The speculative loop's result for `batch`, drafting with `drafter(rows)`."""
    return drain(
        iter_speculative(
            tiny.model,
            batch.input_ids,
            batch.attention_mask,
            config=config,
            open_drafter=lambda rows, _resolved: drafter(rows),
            stats=stats,
            tokenizer=tiny.tokenizer,
            **kwargs,
        )
    )


@pytest.mark.parametrize("stop", [False, True])
def test_rounds_without_drafts_equal_plain_greedy(tiny, stop):
    batch = tiny.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    config = _config(tiny, max_new_tokens=24, do_sample=False)
    if stop:  # a piece of the first row's plain output: that row stops there, the other one goes on
        first = generate(tiny.model, batch.input_ids, batch.attention_mask, config=config, tokenizer=tiny.tokenizer)
        text = tiny.tokenizer.decode(first.sequences[0, batch.input_ids.shape[1] :])
        config = _config(tiny, max_new_tokens=24, do_sample=False, stop_strings=[text[8:12]])
    plain = generate(tiny.model, batch.input_ids, batch.attention_mask, config=config, tokenizer=tiny.tokenizer)
    stats = SpeculationStats()
    speculative = _speculate(tiny, batch, config, SilentDrafter, stats, draft_length=4)
    assert not stats.fallback_reason and stats.drafted_tokens == 0
    assert torch.equal(speculative.sequences, plain.sequences)
    assert speculative.finish_reasons == plain.finish_reasons
    if stop:
        assert plain.finish_reasons[0] != plain.finish_reasons[1]
    for a, b in zip(speculative.scores, plain.scores, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_rounds_drafted_ahead_reach_the_controller_as_hits(tiny):
    """The loop hands the controller whether a round's drafts were drafted ahead: hits and misses are priced apart."""
    batch = tiny.tokenizer(PROMPTS[:1], return_tensors="pt")
    config = _config(tiny, max_new_tokens=80, do_sample=False)
    plain = generate(tiny.model, batch.input_ids, batch.attention_mask, config=config, tokenizer=tiny.tokenizer)
    answer = plain.sequences[0].tolist()
    costs, stats = SharedCosts(), SpeculationStats()
    controller = SpeculationController(costs, "draft_model", overlapped=True)
    speculative = _speculate(tiny, batch, config, lambda rows: AheadDrafter(rows, answer), stats, controller=controller)
    assert torch.equal(speculative.sequences, plain.sequences)
    assert stats.accepted_tokens > 0
    assert costs.ahead("draft_model") is not None and costs.draft_blocks("draft_model") > 0, stats
