"""Speculative verification: acceptance tables, rejection-sampling statistics, reproducibility, and
parity with transformers 5.23 (`_speculative_sampling` and the inline "case 2" of `_assisted_decoding`)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.utils import _speculative_sampling

from specwire.generation.speculation.acceptance import (
    AcceptResult,
    crop_at_stops,
    greedy_accept,
    rejection_sample,
    sampled_accept_without_draft_probs,
)


def logits_with_argmax(argmax: list[list[int]], vocab: int = 10, seed: int = 0) -> torch.Tensor:
    """Random logits `[rows, positions, vocab]` whose argmax at each position is the given token."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmax), len(argmax[0]), vocab, generator=generator)
    logits.scatter_(-1, torch.tensor(argmax)[..., None], 10.0)
    return logits


def one_hot(token: int, vocab: int) -> torch.Tensor:
    probs = torch.zeros(vocab)
    probs[token] = 1.0
    return probs


# ---------------------------------------------------------------------------------------------
# greedy_accept


GREEDY_CASES = {
    # name: (drafts [rows, k], draft lengths, target argmax [rows, k + 1], expected tokens, expected n)
    "perfect_match_gets_bonus": ([[3, 1, 4]], [3], [[3, 1, 4, 7]], [[3, 1, 4, 7]], [3]),
    "first_token_mismatch": ([[3, 1, 4]], [3], [[5, 1, 4, 7]], [[5]], [0]),
    "middle_mismatch_correction": ([[3, 1, 4]], [3], [[3, 2, 4, 7]], [[3, 2]], [1]),
    "last_draft_mismatch": ([[3, 1, 4]], [3], [[3, 1, 6, 7]], [[3, 1, 6]], [2]),
    "match_after_mismatch_does_not_count": ([[3, 1, 4]], [3], [[3, 9, 4, 7]], [[3, 9]], [1]),
    "empty_draft_k0": ([[]], [0], [[6]], [[6]], [0]),
    "empty_draft_ignores_padding_that_matches": ([[3, 1, 4]], [0], [[3, 1, 4, 7]], [[3]], [0]),
    "rows_with_different_lengths": (
        [[3, 1, 4], [3, 1, 4], [2, 2, 2], [0, 0, 0]],
        [3, 1, 2, 0],
        [[3, 1, 4, 7], [3, 1, 4, 7], [2, 5, 2, 2], [1, 1, 1, 1]],
        [[3, 1, 4, 7], [3, 1], [2, 5], [1]],
        [3, 1, 1, 0],
    ),
}


@pytest.mark.parametrize("case", GREEDY_CASES.values(), ids=GREEDY_CASES.keys())
def test_greedy_accept_table(case):
    drafts, lengths, target, expected, expected_n = case
    k = len(drafts[0])
    draft_tokens = torch.tensor(drafts, dtype=torch.long).view(len(drafts), k)
    result = greedy_accept(draft_tokens, torch.tensor(lengths), logits_with_argmax(target))
    assert result.tokens() == expected
    assert result.num_accepted.tolist() == expected_n
    assert result.num_emitted.tolist() == [n + 1 for n in expected_n]
    assert result.emitted.shape == (len(drafts), k + 1)
    # Padding after the emitted tokens, never stale draft or target tokens.
    assert (result.emitted[~result.mask] == -1).all()


def test_greedy_accept_matches_reference_loop_on_random_rows():
    generator = torch.Generator().manual_seed(7)
    rows, k, vocab = 64, 6, 3  # a tiny vocabulary makes long accepted runs common
    logits = torch.randn(rows, k + 1, vocab, generator=generator)
    argmax = logits.argmax(-1)
    # Drafts copy the target's choice with probability 0.8, so all acceptance lengths occur.
    noise = torch.randint(0, vocab, (rows, k), generator=generator)
    drafts = torch.where(torch.rand(rows, k, generator=generator) < 0.8, argmax[:, :k], noise)
    lengths = torch.randint(0, k + 1, (rows,), generator=generator)
    result = greedy_accept(drafts, lengths, logits, pad_id=99)
    for row in range(rows):
        n = 0
        while n < lengths[row] and drafts[row, n] == argmax[row, n]:
            n += 1
        expected = drafts[row, :n].tolist() + [int(argmax[row, n])]
        assert result.tokens()[row] == expected
        assert int(result.num_accepted[row]) == n
        assert result.emitted[row, n + 1 :].tolist() == [99] * (k - n)
    assert len(set(result.num_accepted.tolist())) >= 4


def hf_greedy_case2(candidate_new_tokens, new_logits, candidate_logits=None, weight=None):
    """transformers 5.23 `_assisted_decoding` greedy selection (utils.py, case 2), copied for batch 1."""
    candidate_length = candidate_new_tokens.shape[1]
    if weight is not None and candidate_logits is not None:
        p_probs = new_logits[:, :candidate_length, :].softmax(dim=-1)
        q_probs = candidate_logits.softmax(dim=-1)
        nu_probs = weight * p_probs + (1.0 - weight) * q_probs
        bonus_logits = new_logits[:, candidate_length:, :]
        selected_tokens = torch.cat([nu_probs.argmax(dim=-1), bonus_logits.argmax(dim=-1)], dim=-1)
    else:
        selected_tokens = new_logits.argmax(dim=-1)
    n_matches = ((~(candidate_new_tokens == selected_tokens[:, :-1])).cumsum(dim=-1) < 1).sum()
    return selected_tokens[:, : n_matches + 1], int(n_matches)


@pytest.mark.parametrize("weight", [None, 0.3, 0.7])
def test_greedy_accept_matches_transformers_with_and_without_ensemble_weight(weight):
    generator = torch.Generator().manual_seed(3)
    outcomes = set()
    for trial in range(60):
        k, vocab = 1 + trial % 5, 6
        new_logits = torch.randn(1, k + 1, vocab, generator=generator) * 2
        candidate_logits = new_logits[:, :k] + torch.randn(1, k, vocab, generator=generator)
        drafts = candidate_logits.argmax(-1)
        expected, n = hf_greedy_case2(drafts, new_logits, candidate_logits, weight)
        result = greedy_accept(
            drafts,
            torch.tensor([k]),
            new_logits,
            draft_probs=candidate_logits.softmax(-1),
            ensemble_weight=weight,
        )
        assert result.tokens() == expected.tolist()
        assert int(result.num_accepted[0]) == n
        outcomes.add(n == k)
    assert outcomes == {True, False}


def test_greedy_ensemble_weight_changes_the_choice():
    # The target prefers token 1 by a hair, the draft strongly prefers token 0: w=0.5 picks 0.
    target = torch.tensor([[[1.0, 1.1, -5.0], [0.0, 0.0, 3.0]]])  # [1, 2, 3]
    draft_probs = torch.tensor([[[0.98, 0.01, 0.01]]])  # [1, 1, 3]
    drafts = torch.tensor([[0]])
    plain = greedy_accept(drafts, torch.tensor([1]), target)
    ensemble = greedy_accept(drafts, torch.tensor([1]), target, draft_probs=draft_probs, ensemble_weight=0.5)
    assert plain.tokens() == [[1]]
    assert ensemble.tokens() == [[0, 2]]
    with pytest.raises(ValueError, match="open interval"):
        greedy_accept(drafts, torch.tensor([1]), target, draft_probs=draft_probs, ensemble_weight=1.0)


def test_shape_validation():
    with pytest.raises(ValueError, match="draft_lengths"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 4]), torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 2]), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(
            torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), torch.zeros(1, 3, 5), torch.zeros(1, 3, 5)
        )


# ---------------------------------------------------------------------------------------------
# sampled_accept_without_draft_probs (prompt lookup while sampling)


def hf_sampled_case2(candidate_new_tokens, new_logits):
    """transformers 5.23 `_assisted_decoding` sampling without draft logits, copied for batch 1."""
    probs = new_logits.softmax(dim=-1)
    selected_tokens = torch.multinomial(probs[0, :, :], num_samples=1).squeeze(1)[None, :]
    n_matches = ((~(candidate_new_tokens == selected_tokens[:, :-1])).cumsum(dim=-1) < 1).sum()
    return selected_tokens[:, : n_matches + 1], int(n_matches)


def test_sampled_without_draft_probs_matches_transformers_draws():
    generator = torch.Generator().manual_seed(11)
    accepted_lengths = set()
    for seed in range(80):
        k, vocab = 1 + seed % 4, 4
        new_logits = torch.randn(1, k + 1, vocab, generator=generator) * 3
        # Drafts sampled from the target itself are often accepted.
        drafts = torch.multinomial(new_logits[0, :k].softmax(-1), 1, generator=generator).view(1, k)
        torch.manual_seed(seed)
        expected, n = hf_sampled_case2(drafts, new_logits)
        result = sampled_accept_without_draft_probs(
            drafts, torch.tensor([k]), new_logits.softmax(-1), torch.Generator().manual_seed(seed)
        )
        assert result.tokens() == expected.tolist()
        assert int(result.num_accepted[0]) == n
        accepted_lengths.add(n)
    assert len(accepted_lengths) >= 3


def test_sampled_without_draft_probs_follows_target_and_respects_lengths():
    # Deterministic targets (one-hot) make the outcome exact: row 0 accepts both drafts and takes
    # the bonus; row 1 has one draft and stops at its own bonus position; row 2 rejects at once.
    vocab = 6
    p = torch.stack(
        [
            torch.stack([one_hot(1, vocab), one_hot(2, vocab), one_hot(3, vocab)]),
            torch.stack([one_hot(1, vocab), one_hot(4, vocab), one_hot(5, vocab)]),
            torch.stack([one_hot(0, vocab), one_hot(2, vocab), one_hot(3, vocab)]),
        ]
    )
    drafts = torch.tensor([[1, 2], [1, 4], [1, 2]])
    result = sampled_accept_without_draft_probs(drafts, torch.tensor([2, 1, 2]), p, torch.Generator().manual_seed(0))
    assert result.tokens() == [[1, 2, 3], [1, 4], [0]]
    assert result.num_accepted.tolist() == [2, 1, 0]


# ---------------------------------------------------------------------------------------------
# rejection_sample: exact cases


def test_rejection_sample_deterministic_cases_per_row():
    vocab = 8
    uniform = torch.full((vocab,), 1.0 / vocab)
    k = 3
    draft_probs = uniform.expand(4, k, vocab).clone()
    target_probs = uniform.expand(4, k + 1, vocab).clone()
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4], [5, 6, 7]])
    lengths = torch.tensor([3, 3, 0, 1])
    # Row 0: p == q everywhere -> ratio 1 -> every draft accepted (U < 1); bonus from one-hot p_3.
    target_probs[0, 3] = one_hot(6, vocab)
    # Row 1: p_1(x_1) = 0 -> rejected at position 1; the residual max(p - q, 0) is one-hot on 7.
    target_probs[1, 1] = one_hot(7, vocab)
    # Row 2: empty draft -> a plain sample from p_0 (one-hot on 5), whatever its padding holds.
    target_probs[2, 0] = one_hot(5, vocab)
    # Row 3: one draft, accepted (p == q), bonus from p_1 (one-hot on 0) even though k = 3.
    target_probs[3, 1] = one_hot(0, vocab)
    for seed in range(5):
        result = rejection_sample(drafts, lengths, draft_probs, target_probs, torch.Generator().manual_seed(seed))
        assert result.tokens() == [[1, 2, 3, 6], [1, 7], [5], [5, 0]]
        assert result.num_accepted.tolist() == [3, 1, 0, 1]
        assert result.emitted.shape == (4, k + 1)


def test_rejection_sample_degenerate_residual_falls_back_to_target():
    # Unnormalized draft probabilities (q = 2p on p's support plus mass on token 7): the ratio is
    # 0.5, so about half the rows reject, and the residual max(p - q, 0) is all zeros. The recovered
    # token must then come from p (support {1, 2}), not NaN, q or uniform.
    vocab, rows = 8, 400
    p = torch.zeros(vocab)
    p[1], p[2] = 0.25, 0.75
    q = 2 * p
    q[7] = 0.5
    target_probs = p.expand(rows, 2, vocab).clone()
    draft_probs = q.expand(rows, 1, vocab).clone()
    drafts = torch.ones(rows, 1, dtype=torch.long)
    result = rejection_sample(
        drafts,
        torch.ones(rows, dtype=torch.long),
        draft_probs,
        target_probs,
        torch.Generator().manual_seed(0),
    )
    rejected = result.num_accepted == 0
    assert 0.35 < rejected.float().mean() < 0.65
    recovered = result.emitted[rejected, 0]
    assert set(recovered.tolist()) == {1, 2}
    assert (recovered == 2).float().mean() > 0.6


# ---------------------------------------------------------------------------------------------
# rejection_sample: statistics (the output follows the target, not the draft)


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    empirical = torch.bincount(samples, minlength=probs.shape[0]).double() / samples.numel()
    return 0.5 * float((empirical - probs.double()).abs().sum())


def run_speculative_batch(p: torch.Tensor, q: torch.Tensor, rows: int, seed: int) -> AcceptResult:
    """`rows` independent rounds with fixed per-position draft `q [k, V]` and target `p [k + 1, V]`."""
    generator = torch.Generator().manual_seed(seed)
    k = q.shape[0]
    drafts = torch.stack([torch.multinomial(q[i], rows, replacement=True, generator=generator) for i in range(k)], 1)
    return rejection_sample(
        drafts,
        torch.full((rows,), k, dtype=torch.long),
        q.expand(rows, k, -1),
        p.expand(rows, k + 1, -1),
        generator,
    )


def test_rejection_sampling_converges_to_target_distribution():
    vocab, k = 8, 2
    generator = torch.Generator().manual_seed(1234)
    p = (torch.randn(k + 1, vocab, generator=generator) * 1.5).softmax(-1)  # target [k + 1, vocab]
    q = (torch.randn(k, vocab, generator=generator) * 1.5).softmax(-1)  # draft [k, vocab]
    # The draft is far from the target: emitting draft tokens unchecked would fail the bound below.
    assert 0.5 * float((p[:k] - q).abs().sum(-1).min()) > 0.25

    distances = {}
    for rows in (2_000, 50_000):
        result = run_speculative_batch(p, q, rows, seed=rows)
        first = result.emitted[:, 0]
        second = result.emitted[result.num_accepted >= 1, 1]  # given the first draft was accepted
        third = result.emitted[result.num_accepted == 2, 2]  # the bonus after two accepted drafts
        distances[rows] = (
            total_variation(first, p[0]),
            total_variation(second, p[1]),
            total_variation(third, p[2]),
        )
        # Acceptance rate of the first draft is sum(min(p, q)) (Leviathan et al., Theorem 3.5).
        expected_rate = float(torch.minimum(p[0], q[0]).sum())
        tolerance = 4 * (expected_rate * (1 - expected_rate) / rows) ** 0.5
        assert abs(float((result.num_accepted >= 1).float().mean()) - expected_rate) < tolerance
        assert second.numel() > rows * 0.2 and third.numel() > rows * 0.05

    small, large = distances[2_000], distances[50_000]
    assert large[0] < small[0]
    assert large[1] < small[1]
    assert max(large) < 0.03, large
    assert max(small) < 0.1, small


# ---------------------------------------------------------------------------------------------
# rejection_sample: reproducibility and parity with transformers


def random_round(generator: torch.Generator, k: int, vocab: int = 12):
    candidate_logits = torch.randn(1, k, vocab, generator=generator) * 2  # draft scores
    new_logits = torch.randn(1, k + 1, vocab, generator=generator) * 2  # target scores
    new_logits[:, :k] = 0.5 * new_logits[:, :k] + candidate_logits  # related, so some drafts pass
    drafts = torch.multinomial(candidate_logits[0].softmax(-1), 1, generator=generator).view(1, k)
    return drafts, candidate_logits, new_logits


@pytest.mark.parametrize("weight", [None, 0.5])
def test_rejection_sample_matches_transformers_speculative_sampling(weight):
    generator = torch.Generator().manual_seed(5)
    prefix = torch.tensor([[2, 7, 1]])
    full_accepts, rejects = 0, 0
    for seed in range(150):
        k = 1 + seed % 5
        drafts, candidate_logits, new_logits = random_round(generator, k)
        torch.manual_seed(seed)
        # The 5.23 signature: the 5th argument is the ensemble weight (not the old is_done_candidate).
        expected, n = _speculative_sampling(
            torch.cat([prefix, drafts], 1), candidate_logits, k, new_logits, assistant_ensemble_weight=weight
        )
        result = rejection_sample(
            drafts,
            torch.tensor([k]),
            candidate_logits.softmax(-1),
            new_logits.softmax(-1),
            torch.Generator().manual_seed(seed),
            ensemble_weight=weight,
        )
        assert result.tokens() == expected.tolist(), seed
        assert int(result.num_accepted[0]) == int(n)
        full_accepts += int(n) == k
        rejects += int(n) < k
    assert full_accepts > 10 and rejects > 10


def test_batched_rows_with_own_generators_match_transformers_per_row():
    generator = torch.Generator().manual_seed(9)
    rounds = [random_round(generator, k) for k in (4, 1, 3, 2, 4)]
    k_max = 4
    drafts = torch.full((len(rounds), k_max), -1, dtype=torch.long)
    draft_probs = torch.full((len(rounds), k_max, 12), 1.0 / 12)
    target_probs = torch.full((len(rounds), k_max + 1, 12), 1.0 / 12)
    expected_tokens = []
    for row, (row_drafts, candidate_logits, new_logits) in enumerate(rounds):
        k = row_drafts.shape[1]
        drafts[row, :k] = row_drafts[0]
        draft_probs[row, :k] = candidate_logits[0].softmax(-1)
        target_probs[row, : k + 1] = new_logits[0].softmax(-1)
        torch.manual_seed(100 + row)
        expected, _ = _speculative_sampling(row_drafts, candidate_logits, k, new_logits, assistant_ensemble_weight=None)
        expected_tokens.append(expected[0].tolist())
    generators = [torch.Generator().manual_seed(100 + row) for row in range(len(rounds))]
    lengths = torch.tensor([r[0].shape[1] for r in rounds])
    result = rejection_sample(drafts, lengths, draft_probs, target_probs, generators)
    assert result.tokens() == expected_tokens


def test_seeded_row_is_independent_of_batch_neighbours():
    vocab, k = 10, 4
    generator = torch.Generator().manual_seed(21)
    for seed in range(15):
        drafts, candidate_logits, new_logits = random_round(generator, k, vocab)
        q, p = candidate_logits.softmax(-1), new_logits.softmax(-1)
        alone = rejection_sample(drafts, torch.tensor([k]), q, p, [torch.Generator().manual_seed(seed)])

        # The same row at position 2 of a batch, between neighbours with other lengths, other
        # distributions and their own generators (one of them unseeded: the global RNG).
        rows = 4
        batch_drafts = torch.randint(0, vocab, (rows, k), generator=generator)
        batch_q = torch.rand(rows, k, vocab, generator=generator).softmax(-1)
        batch_p = torch.rand(rows, k + 1, vocab, generator=generator).softmax(-1)
        batch_drafts[2], batch_q[2], batch_p[2] = drafts[0], q[0], p[0]
        generators = [
            torch.Generator().manual_seed(999),
            None,
            torch.Generator().manual_seed(seed),
            torch.Generator(),
        ]
        batched = rejection_sample(batch_drafts, torch.tensor([1, 0, k, 3]), batch_q, batch_p, generators)
        assert batched.tokens()[2] == alone.tokens()[0]
        assert int(batched.num_accepted[2]) == int(alone.num_accepted[0])

        # A shorter row in a wider batch: it draws for its own length only, not the batch's k.
        short = k - 2
        # The generator must also end in the same state, or the request's next round would differ.
        alone_generators = [torch.Generator().manual_seed(seed) for _ in range(2)]
        short_alone = rejection_sample(
            drafts[:, :short], torch.tensor([short]), q[:, :short], p[:, : short + 1], alone_generators[0]
        )
        sampled_alone = sampled_accept_without_draft_probs(
            drafts[:, :short], torch.tensor([short]), p[:, : short + 1], alone_generators[1]
        )
        lengths = torch.tensor([1, 0, short, 3])
        generators[2] = torch.Generator().manual_seed(seed)
        short_batched = rejection_sample(batch_drafts, lengths, batch_q, batch_p, generators)
        assert short_batched.tokens()[2] == short_alone.tokens()[0]
        assert torch.equal(generators[2].get_state(), alone_generators[0].get_state())
        generators[2] = torch.Generator().manual_seed(seed)
        sampled_batched = sampled_accept_without_draft_probs(batch_drafts, lengths, batch_p, generators)
        assert sampled_batched.tokens()[2] == sampled_alone.tokens()[0]
        assert torch.equal(generators[2].get_state(), alone_generators[1].get_state())


def test_shared_generator_draws_rows_in_order():
    # With one generator, row 0 of a batch sees exactly the draws it would see alone.
    generator = torch.Generator().manual_seed(4)
    drafts, candidate_logits, new_logits = random_round(generator, 3)
    q, p = candidate_logits.softmax(-1), new_logits.softmax(-1)
    results = []
    for rows in (1, 3):
        batch = rejection_sample(
            drafts.expand(rows, -1),
            torch.full((rows,), 3),
            q.expand(rows, -1, -1),
            p.expand(rows, -1, -1),
            torch.Generator().manual_seed(77),
        )
        results.append(batch.tokens()[0])
    assert results[0] == results[1]


def test_explicit_generator_leaves_global_rng_untouched():
    drafts, candidate_logits, new_logits = random_round(torch.Generator().manual_seed(8), 3)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    rejection_sample(
        drafts,
        torch.tensor([3]),
        candidate_logits.softmax(-1),
        new_logits.softmax(-1),
        torch.Generator().manual_seed(1),
    )
    assert torch.equal(torch.random.get_rng_state(), before)


# ---------------------------------------------------------------------------------------------
# crop_at_stops


def accept_block(tokens: list[list[int]], num_accepted: list[int]) -> AcceptResult:
    width = max(len(t) for t in tokens)
    emitted = torch.tensor([t + [-1] * (width - len(t)) for t in tokens])
    return AcceptResult(
        num_accepted=torch.tensor(num_accepted),
        emitted=emitted,
        num_emitted=torch.tensor([len(t) for t in tokens]),
    )


def test_crop_at_eos_inside_the_accepted_block():
    eos = 2
    block = accept_block([[5, 2, 7, 8], [5, 6, 7, 8], [5, 6, 2], [9]], [3, 3, 2, 0])
    calls = []

    def stop_fn(j):
        calls.append(j)
        return block.emitted[:, j - 1] == eos

    cropped, finish = crop_at_stops(block, stop_fn)
    assert cropped.tokens() == [[5, 2], [5, 6, 7, 8], [5, 6, 2], [9]]
    assert cropped.num_accepted.tolist() == [1, 3, 2, 0]  # row 2 stopped on its own bonus token
    assert finish.tolist() == [1, 0, 1, 0]
    assert cropped.emitted[0].tolist() == [5, 2, -1, -1]
    assert calls == [1, 2, 3, 4]


def test_crop_returns_finish_codes_and_skips_unverified_rows():
    block = accept_block([[4, 4, 4], [4, 4], [4]], [2, 1, 0])
    block = AcceptResult(block.num_accepted, block.emitted, torch.tensor([3, 2, 0]))  # row 2 not verified
    # Code 3 fires at every prefix: each verified row stops after its first token.
    cropped, finish = crop_at_stops(block, lambda j: torch.full((3,), 3))
    assert cropped.num_emitted.tolist() == [1, 1, 0]
    assert cropped.num_accepted.tolist() == [0, 0, 0]
    assert finish.tolist() == [3, 3, 0]


def hf_crop(valid: list[int], cur_len: int, max_length: int, eos: set[int]) -> list[int]:
    """transformers 5.23 `_assisted_decoding` crop: at `max_length`, then at the first EOS (inclusive)."""
    valid = valid[: max_length - cur_len]
    for i, token in enumerate(valid):
        if token in eos:
            return valid[: i + 1]
    return valid


def test_crop_reproduces_transformers_length_and_eos_crop():
    generator = torch.Generator().manual_seed(17)
    rows, k, vocab, eos = 40, 5, 6, {0, 3}
    drafts = torch.randint(0, vocab, (rows, k), generator=generator)
    logits = torch.randn(rows, k + 1, vocab, generator=generator)
    logits[:, :k].scatter_add_(-1, drafts[..., None], torch.full((rows, k, 1), 2.0))  # mostly accepted
    result = greedy_accept(drafts, torch.randint(0, k + 1, (rows,), generator=generator), logits)
    cur_len = torch.randint(5, 10, (rows,), generator=generator)
    max_length = cur_len + torch.randint(1, k + 3, (rows,), generator=generator)
    eos_tensor = torch.tensor(sorted(eos))

    def stop_fn(j):
        at_length = cur_len + j >= max_length
        at_eos = torch.isin(result.emitted[:, j - 1], eos_tensor)
        return torch.where(at_length, 1, torch.where(at_eos, 2, 0))

    cropped, finish = crop_at_stops(result, stop_fn)
    changed = 0
    for row in range(rows):
        expected = hf_crop(result.tokens()[row], int(cur_len[row]), int(max_length[row]), eos)
        assert cropped.tokens()[row] == expected
        assert int(cropped.num_accepted[row]) == min(int(result.num_accepted[row]), len(expected) - 1)
        changed += len(expected) < int(result.num_emitted[row])
    assert changed > 5
    assert set(finish.tolist()) == {0, 1, 2}
