"""`assistant_ensemble_weight` (DIVERSE static ensemble, arXiv 2604.07622) through real services: a target
verifying a different draft model's drafts gives transformers' assisted generation tokens with the same
weight and draft lengths; prompt lookup refuses it as transformers does; without a drafter it is a
warning. The sampling rule's output distribution is `w * p + (1 - w) * q`, checked by convergence."""

from __future__ import annotations

import pytest
import torch
import transformers

from specwire.client import SpecwireRpcError, TargetClient
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.generation.loops.speculative_rounds import accept_blocks
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy
from tests.servers import threaded_server

ROWS = [[5, 6, 7, 8, 9, 10, 5, 6], [20, 21, 22, 23, 20, 21, 22], [40, 41, 42, 40, 41]]
# Constant draft lengths and no confidence stop, so both sides draft the same blocks.
SCHEDULE = dict(num_assistant_tokens=3, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)


@pytest.fixture(scope="module")
def target(tiny_model_dir, tiny_draft_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    draft = load_model(str(tiny_draft_dir), progress=False)
    with threaded_server(lambda: build_draft_server(draft)) as draft_server:
        policy = DraftPolicy(draft_server.address, round_timeout_s=30.0)
        with threaded_server(lambda: build_target_server(loaded, drafting=policy)) as server:
            with TargetClient(server.address) as client:
                yield client


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny_draft_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(tiny_draft_dir).eval()
    assistant.generation_config.update(**SCHEDULE)  # transformers reads the schedule from the assistant
    return model, assistant


@pytest.mark.parametrize("weight", [0.2, 0.5, 0.9])
def test_greedy_ensemble_equals_transformers_assisted_generation(target, models, weight):
    model, assistant = models
    plain = target.generate(ROWS, max_new_tokens=16)
    spec = target.generate(
        ROWS, max_new_tokens=16, proposer="draft_model", assistant_ensemble_weight=weight, **SCHEDULE
    )
    assert spec.speculation.fallback_reason == "" and spec.speculation.rounds > 0
    assert not [w for w in spec.warnings if "ensemble" in w.field]
    changed = False
    for r, row in enumerate(ROWS):
        want = model.generate(
            torch.tensor([row]),
            max_new_tokens=16,
            do_sample=False,
            assistant_model=assistant,
            assistant_ensemble_weight=weight,
            **SCHEDULE,
        )[0].tolist()
        ours = spec.sequences[r].tolist()
        assert ours[len(ours) - len(want) :] == want, (weight, r)
        changed |= ours != plain.sequences[r].tolist()
    if weight <= 0.5:  # a draft-heavy ensemble leaves the target's greedy path somewhere
        assert changed


def test_without_the_weight_the_output_is_the_target_greedy_one(target):
    plain = target.generate(ROWS, max_new_tokens=16)
    spec = target.generate(ROWS, max_new_tokens=16, proposer="draft_model", **SCHEDULE)
    assert torch.equal(spec.sequences, plain.sequences)


def test_seeded_sampling_with_the_weight_runs_and_is_reproducible(target):
    kwargs = dict(max_new_tokens=12, do_sample=True, seed=3, proposer="draft_model", assistant_ensemble_weight=0.5)
    first = target.generate(ROWS, **kwargs, **SCHEDULE)
    assert torch.equal(first.sequences, target.generate(ROWS, **kwargs, **SCHEDULE).sequences)
    assert first.speculation.accepted_tokens > 0


def test_prompt_lookup_refuses_the_weight(target):
    with pytest.raises(SpecwireRpcError) as info:
        target.generate(ROWS[:1], max_new_tokens=8, prompt_lookup_num_tokens=3, assistant_ensemble_weight=0.5)
    assert info.value.code().name == "INVALID_ARGUMENT"
    assert "assistant_ensemble_weight" in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(proposer="none"), dict(proposer="draft_model", num_beams=2)])
def test_the_weight_without_drafts_is_a_warning(target, kwargs):
    out = target.generate(ROWS[:1], max_new_tokens=6, assistant_ensemble_weight=0.5, **kwargs)
    (warning,) = [w for w in out.warnings if w.field == "config.assistant_ensemble_weight"]
    assert "not honoured" in warning.message


def _total_variation(samples: torch.Tensor, distribution: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=distribution.numel()).float()
    return 0.5 * float((counts / counts.sum() - distribution).abs().sum())


def test_ensemble_sampling_converges_to_the_mixture():
    vocab, weight = 6, 0.3
    generator = torch.Generator().manual_seed(7)
    p = (torch.randn(2, vocab, generator=generator) * 1.5).softmax(-1)  # target at the draft and bonus positions
    q = (torch.randn(1, vocab, generator=generator) * 1.5).softmax(-1)  # draft
    mixture = weight * p[0] + (1 - weight) * q[0]
    assert 0.5 * float((mixture - p[0]).abs().sum()) > 0.1  # far from the lossless answer
    distances = []
    for rows in (1_000, 20_000):
        draws = torch.Generator().manual_seed(rows)
        drafts = torch.multinomial(q[0], rows, replacement=True, generator=draws)
        result = accept_blocks(
            True, [[int(t)] for t in drafts], [q] * rows, [p.log()] * rows, draws, ensemble_weight=weight
        )
        distances.append(_total_variation(result.emitted[:, 0], mixture))
    assert distances[1] < distances[0] and distances[1] < 0.03, distances


@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_short_generations_with_the_weight_equal_transformers(target, models, max_new_tokens):
    # One new token leaves no room to draft: the first token comes from the prefill, as there.
    model, assistant = models
    out = target.generate(
        ROWS[:1], max_new_tokens=max_new_tokens, proposer="draft_model", assistant_ensemble_weight=0.3, **SCHEDULE
    )
    want = model.generate(
        torch.tensor(ROWS[:1]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        assistant_model=assistant,
        assistant_ensemble_weight=0.3,
        **SCHEDULE,
    )
    assert out.sequences.tolist() == want.tolist()
