"""Rounds in which no row drafts (a controller's time off) decode plainly: with a drafter that never proposes, the
speculative loop's tokens, scores and finish reasons equal plain greedy's, with a stop string that ends one row
of a batch before the other (the rounds after it take the general acceptance, with a finished row)."""

from __future__ import annotations

import pytest
import torch

from specwire.generation.config import GenerationConfig, merge
from specwire.generation.loops.generate import drain, generate
from specwire.generation.loops.speculative import iter_speculative
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


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from specwire.models import load_model

    return load_model(str(tiny_model_dir), progress=False)


def _config(tiny, **kwargs):
    return merge(GenerationConfig.from_dict({**kwargs, **OUTPUT_FLAGS}), tiny.generation_config)


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
    speculative = drain(
        iter_speculative(
            tiny.model,
            batch.input_ids,
            batch.attention_mask,
            config=config,
            open_drafter=lambda rows, _resolved: SilentDrafter(rows),
            stats=stats,
            tokenizer=tiny.tokenizer,
            draft_length=4,
        )
    )
    assert not stats.fallback_reason and stats.drafted_tokens == 0
    assert torch.equal(speculative.sequences, plain.sequences)
    assert speculative.finish_reasons == plain.finish_reasons
    if stop:
        assert plain.finish_reasons[0] != plain.finish_reasons[1]
    for a, b in zip(speculative.scores, plain.scores, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
