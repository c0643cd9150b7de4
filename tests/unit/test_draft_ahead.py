"""Drafting ahead (`OverlappingModelDrafter`): the proposals are the ones serial drafting makes, token
for token and probability for probability, greedy and sampled, over rounds that confirm the block
drafted ahead (hits), contradict it (misses), ask another length (cut, extended), and interrupt the
drafting ahead at any forward (the timing of the feedback changes nothing)."""

from __future__ import annotations

import pytest
import torch

from specwire.generation.config import GenerationConfig
from specwire.generation.speculation.draft_ahead import AHEAD_HIT, AHEAD_MISS, OverlappingModelDrafter
from specwire.generation.speculation.drafters import ModelDrafter, open_model_drafter
from specwire.models import load_model

ROWS = [[5, 6, 7, 8, 9, 10, 5, 6], [20, 21, 22, 23, 20]]
# Draft length asked each round (the controller may change it every round).
LENGTHS = [3, 3, 5, 2, 4, 1, 3, 6, 2, 3, 3, 4]


@pytest.fixture(scope="module")
def draft(tiny_draft_dir):
    return load_model(str(tiny_draft_dir), progress=False).model


def _greedy_next(model, tokens: list[int]) -> int:
    """The draft's own greedy next token after `tokens` (a fresh forward, no cache)."""
    with torch.inference_mode():
        return int(model(torch.tensor([tokens])).logits[0, -1].argmax())


def _feedback(model, rows: list[list[int]], proposal: list[list[int]], round_: int):
    """A target's feedback that confirms the block drafted ahead for some rows and rounds and contradicts
    it for others: all accepted with the draft's greedy next token (hit), all accepted with another
    bonus token, or a rejection inside the block (misses)."""
    accepted, appended = [], []
    for i, (row, block) in enumerate(zip(rows, proposal, strict=True)):
        kind = (round_ + i) % 3
        guess = _greedy_next(model, row + block)
        if kind == 0 or not block:
            accepted.append(len(block))
            appended.append([guess])
        elif kind == 1:
            accepted.append(len(block))
            appended.append([(guess + 1) % 300])
        else:
            accepted.append(len(block) // 2)
            appended.append([(block[len(block) // 2] + 7) % 300])
        row += block[: accepted[-1]] + appended[-1]
    return accepted, appended


def _stopper(forwards: int):
    """`should_stop` that turns true after `forwards` calls (the feedback arriving mid-way)."""
    calls = [0]

    def should_stop() -> bool:
        calls[0] += 1
        return calls[0] > forwards

    return should_stop


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("interrupt_after", [None, 0, 2, 5])
def test_proposals_equal_serial_drafting(draft, do_sample, interrupt_after):
    config = GenerationConfig(
        do_sample=do_sample, seed=11, eos_token_id=2, assistant_confidence_threshold=0.0, top_k=0 if do_sample else 50
    )
    serial = open_model_drafter(draft, [list(r) for r in ROWS], config, 378, return_probs=True)
    ahead = open_model_drafter(draft, [list(r) for r in ROWS], config, 378, return_probs=True, overlap=True)
    assert type(serial) is ModelDrafter and isinstance(ahead, OverlappingModelDrafter)
    rows = [list(r) for r in ROWS]
    outcomes: list[int] = []
    for round_, length in enumerate(LENGTHS):
        want, got = serial.propose(length), ahead.propose(length)
        outcomes += ahead.outcomes
        assert got.tokens == want.tokens, f"round {round_}"
        for p, q in zip(got.probs, want.probs, strict=True):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
        ahead.draft_ahead(_stopper(interrupt_after) if interrupt_after is not None else lambda: False)
        accepted, appended = _feedback(draft, rows, want.tokens, round_)
        serial.feedback(accepted, appended, [False, False])
        ahead.feedback(accepted, appended, [False, False])
    if interrupt_after != 0:
        assert AHEAD_HIT in outcomes and AHEAD_MISS in outcomes, outcomes
    else:  # stopped before its first forward every time: nothing drafted ahead, nothing to hit or miss
        assert set(outcomes) == {0}


def test_finished_rows_and_eos_blocks_are_not_drafted_ahead(draft):
    config = GenerationConfig(eos_token_id=2, assistant_confidence_threshold=0.0)
    drafter = open_model_drafter(draft, [list(r) for r in ROWS], config, 378, return_probs=False, overlap=True)
    drafter.propose(3)
    drafter.feedback([0, 0], [[9], [9]], [True, False])
    drafter.propose(3)
    drafter.draft_ahead(lambda: False)
    assert drafter.ahead[0] is None and drafter.ahead[1] is not None


# ---------------------------------------------------------------------------------------------
# Speculative sampling with drafting ahead: the output follows the target's distribution.


def _small_llama(seed: int, vocab: int, noise: float = 0.0):
    """A one-layer Llama; `noise` perturbs the head of the seed-0 weights (a draft close to the target)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0 if noise else seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions: drafts get accepted and rejected
        if noise:
            generator = torch.Generator().manual_seed(seed)
            model.lm_head.weight.add_(noise * torch.randn(model.lm_head.weight.shape, generator=generator))
    return model


def _exact_marginals(target, prompt: list[int], vocab: int, length: int) -> torch.Tensor:
    """`[length, vocab]`: the target's exact distribution of each generated position (all prefixes enumerated)."""
    marginals = torch.zeros(length, vocab, dtype=torch.float64)
    prefixes = [([], 1.0)]
    with torch.no_grad():
        for position in range(length):
            ids = torch.tensor([prompt + p for p, _ in prefixes])
            probs = target(ids).logits[:, -1].double().softmax(-1)
            grown = []
            for (prefix, weight), row in zip(prefixes, probs, strict=True):
                marginals[position] += weight * row
                grown += [(prefix + [t], weight * float(row[t])) for t in range(vocab)]
            prefixes = grown
    return marginals


def test_speculative_sampling_with_drafting_ahead_follows_the_target():
    """Leviathan et al.'s guarantee with the blocks drafted ahead in use: every generated position's
    empirical distribution converges to the target's exact one, and most rounds reuse a block."""
    from specwire.generation.speculation.acceptance import rejection_sample

    vocab, prompt, length, runs = 4, [1, 2], 4, 400
    target, draft_model = _small_llama(0, vocab), _small_llama(1, vocab, noise=0.6)
    config = GenerationConfig(do_sample=True, top_k=0, eos_token_id=None, assistant_confidence_threshold=0.0)
    outputs, hits, misses = [], 0, 0
    for run in range(runs):
        generator = torch.Generator().manual_seed(run)
        drafter = OverlappingModelDrafter(draft_model, [list(prompt)], config, vocab, True, generator)
        tokens: list[int] = list(prompt)
        coins = torch.Generator().manual_seed(10_000 + run)  # the target's randomness
        while len(tokens) < len(prompt) + length:
            proposal = drafter.propose(1)
            hits += drafter.outcomes.count(AHEAD_HIT)
            misses += drafter.outcomes.count(AHEAD_MISS)
            drafted = proposal.tokens[0]
            with torch.no_grad():
                p = target(torch.tensor([tokens + drafted])).logits[:, len(tokens) - 1 :].softmax(-1)
            result = rejection_sample(
                torch.tensor([drafted]), torch.tensor([len(drafted)]), proposal.probs[0][None], p, coins
            )
            n = int(result.num_accepted[0])
            emitted = result.emitted[0, : n + 1].tolist()
            drafter.draft_ahead(lambda: False)  # the verification above "ran" meanwhile
            drafter.feedback([n], [emitted[n:]], [False])
            tokens += emitted
        outputs.append(tokens[len(prompt) : len(prompt) + length])
    samples = torch.tensor(outputs)  # [runs, length]
    exact = _exact_marginals(target, prompt, vocab, length)
    for position in range(length):
        empirical = torch.bincount(samples[:, position], minlength=vocab).double() / runs
        distance = 0.5 * float((empirical - exact[position]).abs().sum())
        assert distance < 0.05, (position, distance, empirical, exact[position])
    assert hits > runs // 5 and misses > runs // 5, (hits, misses)
