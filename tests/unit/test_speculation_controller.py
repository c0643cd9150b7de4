"""The adaptive speculation controller's cost model and decisions, on synthetic costs (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from specwire.generation.speculation.controller import ControllerOptions, SpeculationController
from specwire.generation.speculation.costs import SharedCosts
from specwire.generation.speculation.estimates import AcceptanceEstimate, LinearCost, RunLengths, SizedCost


def _costs(verify=(0.030, 0.002), draft=(0.0, 0.010), proposer="draft_model", samples=20) -> SharedCosts:
    """Costs measured `samples` times at several sizes, exactly on the given lines."""
    costs = SharedCosts()
    for i in range(samples):
        tokens = 1 + i % 8  # a round of one token had no draft
        costs.observe_verify(tokens, verify[0] + verify[1] * tokens, drafted=tokens > 1)
        k = 1 + i % 6
        costs.observe_draft(proposer, k, draft[0] + draft[1] * k)
    return costs


def _controller(costs: SharedCosts, acceptance: float, **kwargs) -> SpeculationController:
    estimate = AcceptanceEstimate(prior_mean=acceptance, prior_strength=1e6)  # pinned
    always = AcceptanceEstimate(prior_mean=0.999, prior_strength=1e6)  # the drafter always proposes
    return SpeculationController(costs, "draft_model", acceptance=estimate, continuation=always, **kwargs)


def test_linear_cost_recovers_a_line_and_keeps_the_prior_with_one_size():
    cost = LinearCost()
    for x in (1, 3, 5, 9, 2, 7, 12, 21, 16) * 4:  # blocks of many sizes outweigh the prior
        cost.observe(x, 0.02 + 0.004 * x)
    intercept, slope = cost.fit(0.05)
    assert intercept == pytest.approx(0.02, rel=0.1) and slope == pytest.approx(0.004, rel=0.1)
    noisy = LinearCost()
    for i in range(30):  # blocks of 2 and 3 tokens with noise: the slope stays near the prior's
        noisy.observe(2 + i % 2, 0.060 + (0.03 if i % 4 == 1 else 0.0))
    intercept, slope = noisy.fit(0.05)
    assert slope < 0.2 * intercept
    one = LinearCost()
    for _ in range(5):
        one.observe(1, 0.021)
    intercept, slope = one.fit(0.05)  # one size: the prior's ratio, through the measured point
    assert intercept + slope == pytest.approx(0.021) and slope == pytest.approx(0.05 * intercept)
    assert LinearCost().fit(0.05) is None


def test_acceptance_estimate_counts_the_first_rejection_and_forgets():
    estimate = AcceptanceEstimate(prior_mean=0.5, prior_strength=2.0, decay=0.8)
    assert estimate.mean == pytest.approx(0.5)
    estimate.observe(4, 4)  # all accepted: 4 successes, no failure
    assert estimate.mean == pytest.approx(5 / 6)  # (1 + 4) / (2 + 4)
    for _ in range(20):
        estimate.observe(4, 0)  # rejected at once, again and again: the old evidence fades
    assert estimate.mean < 0.2
    estimate.observe(0, 0)  # nothing asked: no evidence
    assert estimate.mean < 0.2
    short = AcceptanceEstimate(prior_mean=0.5, prior_strength=2.0)
    short.observe(4, 2)  # a chain of 4 whose first 2 succeeded: 2 successes, then a failure
    assert short.mean == pytest.approx(3 / 5)


def test_slow_draft_and_low_acceptance_pick_plain_decoding():
    costs = _costs(draft=(0.005, 0.030))  # a draft token costs as much as a target forward
    assert _controller(costs, 0.3).best_length() == 0


def test_cheap_draft_and_high_acceptance_pick_long_blocks():
    costs = _costs(verify=(0.030, 0.0005), draft=(0.0, 0.0005))
    assert _controller(costs, 0.95).best_length() >= 12
    # The same acceptance with a dearer draft picks shorter blocks.
    dear = _costs(verify=(0.030, 0.0005), draft=(0.0, 0.006))
    assert 0 < _controller(dear, 0.95).best_length() < _controller(costs, 0.95).best_length()


def test_load_makes_blocks_shorter_and_can_stop_drafting():
    costs = _costs(verify=(0.030, 0.004), draft=(0.0, 0.001))
    alone = _controller(costs, 0.7).best_length()
    busy = _controller(costs, 0.7, load=lambda: 3).best_length()
    crowded = _controller(costs, 0.7, load=lambda: 30).best_length()
    assert alone > busy > crowded == 0


def test_prior_before_any_measurement_drafts_a_few_tokens():
    k = SpeculationController(SharedCosts(), "draft_model").best_length()
    assert 1 <= k <= 6  # not transformers' 20, not plain decoding


@pytest.mark.parametrize("budget, first_gaps", [(0.0, [4, 8, 8]), (0.05, [8, 8, 8])])
def test_time_off_then_probes_that_back_off_then_resume(budget, first_gaps):
    costs = _costs(draft=(0.005, 0.030))
    # A probe costs 0.06 s more than a plain round of 0.032 s: within a 5 % budget, 38 plain rounds (capped at 8).
    # The estimates decide (`loss_budget=None`): this test's rounds are not what the shared costs say.
    options = ControllerOptions(off_rounds=2, max_off_rounds=8, probe_length=2, probe_budget=budget, loss_budget=None)
    always = AcceptanceEstimate(prior_mean=0.999, prior_strength=1e6)
    controller = SpeculationController(costs, "draft_model", options=options, continuation=always)

    def round_with(acceptance_accepted: int) -> int:
        k = controller.next_length()
        drafted = [k] if k else [0]
        controller.observe(k, [k], drafted, [min(acceptance_accepted, k)], 0.03 * k, 0.032, 1 + k)
        return k

    lengths = [round_with(0) for _ in range(30)]
    # Plain decoding at once (the draft is too slow), probes of 2, each followed by twice the time off (to 8).
    assert lengths[:3] == [0, 0, 2]
    probes = [i for i, k in enumerate(lengths) if k]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)]
    assert all(k == 2 for k in (lengths[i] for i in probes))
    assert gaps[:3] == first_gaps
    assert controller.probes == len(probes)
    # The draft becomes cheap (another request measured it) and the next probe is all accepted: drafting resumes.
    for k in range(1, 7):
        for _ in range(10):
            costs.observe_draft("draft_model", k, 0.0001 * k)
    controller.acceptance = AcceptanceEstimate(prior_mean=0.9, prior_strength=1e6)
    lengths = [round_with(20) for _ in range(12)]
    first = next(i for i, k in enumerate(lengths) if k)
    assert all(k > 0 for k in lengths[first:]) and max(lengths) > 2
    assert controller.off_period == 0


def test_draft_cost_is_not_learned_from_cold_or_probe_rounds():
    costs = SharedCosts()
    controller = SpeculationController(costs, "draft_model")
    controller.next_length()
    controller.observe(3, [3], [3], [3], 5.0, 0.03, 4)  # the first block: the draft's prefill
    assert costs._drafts == {}
    controller.next_length()
    controller.observe(3, [3], [3], [3], 0.03, 0.03, 4)
    # 30 ms for 3 drafts, with a block's fixed part priced as one drafted token (`DRAFT_FIXED_RATIO`).
    assert costs.draft("draft_model", 0.03) == pytest.approx((0.0075, 0.0075), abs=1e-6)


def test_an_overlapped_draft_is_priced_by_the_requests_own_chance_of_a_hit():
    """A remote draft service drafting ahead: a round whose drafts were drafted ahead (a hit) waits for nothing, one
    whose block was discarded (a miss) for the whole draft. The two are learned apart, and each request mixes them by
    its own chance of a hit: one whose drafts are mostly kept drafts, one whose drafts are often rejected does not,
    whatever the hits of other requests made the target measure."""
    costs = _costs(draft=(0.005, 0.040))  # misses: a drafted token costs more than a target forward
    for k in (2, 3, 4, 5) * 10:  # hits, from requests whose blocks were kept whole: nearly free
        costs.observe_draft("draft_model", k, 0.002, ahead_hit=True)
    d0, d1 = costs.prices("draft_model").draft
    assert d0 + 4 * d1 == pytest.approx(0.005 + 4 * 0.040, rel=0.05)  # misses alone
    h0, h1 = costs.prices("draft_model").ahead
    assert h0 + 4 * h1 == pytest.approx(0.002, rel=0.1)
    assert _controller(costs, 0.95, overlapped=True).best_length() > 0
    assert _controller(costs, 0.95).best_length() == 0  # serial: every round pays the whole draft
    assert _controller(costs, 0.6, overlapped=True).best_length() == 0  # mostly misses
    # Long blocks are drafted ahead less often (a hit needs all of them kept), so they are priced dearer.
    sure = _controller(costs, 0.95, overlapped=True)
    assert sure._hit_chance(2) > sure._hit_chance(8) > sure._hit_chance(20)
    assert sure._hit_chance(1) == pytest.approx(0.95**2, rel=1e-3)  # the draft kept, then the target's token guessed


def test_options_are_checked():
    with pytest.raises(ValueError, match="max_length"):
        ControllerOptions(max_length=0)
    with pytest.raises(ValueError, match="max_off_rounds"):
        ControllerOptions(off_rounds=8, max_off_rounds=4)
    with pytest.raises(ValueError, match="prior_mean"):
        AcceptanceEstimate(prior_mean=1.0)


# ---------------------------------------------------------------------------------------------
# The rejection-sampling distribution with the controller on: a tiny target, a tiny draft of other
# weights (its distribution differs), the decoding loop in-process.

SAMPLES = 300
PROMPT = [5, 6, 7, 8, 9, 10, 5, 6]


def _marginals(tokens: list[list[int]], vocab: int) -> torch.Tensor:
    """`[positions, vocab]`: how often each token came at each generated position, as frequencies."""
    counts = torch.zeros(len(tokens[0]), vocab)
    for row in tokens:
        for position, token in enumerate(row):
            counts[position, token] += 1
    return counts / len(tokens)


def _total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest per-position total variation distance between two `[positions, vocab]` marginals."""
    return float(0.5 * (a - b).abs().sum(-1).max())


def test_sampling_with_the_controller_keeps_the_target_distribution(tiny_model_dir, tiny_draft_dir):
    from specwire.generation.config import GenerationConfig, merge
    from specwire.generation.loops.generate import drain, generate
    from specwire.generation.loops.speculative import iter_speculative
    from specwire.generation.speculation.drafters import open_model_drafter
    from specwire.generation.speculation.stats import SpeculationStats
    from specwire.models import load_model

    target, draft = load_model(str(tiny_model_dir), progress=False), load_model(str(tiny_draft_dir), progress=False)
    prompt = torch.tensor([PROMPT])
    width = len(PROMPT)

    def config(seed: int) -> GenerationConfig:
        given = GenerationConfig.from_dict(
            {"do_sample": True, "top_k": 2, "max_new_tokens": 3, "min_new_tokens": 3, "seed": seed}
        )
        return merge(given, target.generation_config)

    plain, own_draft, speculative = [], [], []
    drafted = 0
    for seed in range(SAMPLES):
        plain.append(generate(target.model, prompt, config=config(seed)).sequences[0, width:].tolist())
        if seed < SAMPLES // 3:  # enough to tell the draft's distribution apart
            own_draft.append(generate(draft.model, prompt, config=config(seed)).sequences[0, width:].tolist())
        stats = SpeculationStats()
        result = drain(
            iter_speculative(
                target.model,
                prompt,
                config=config(10_000 + seed),
                open_drafter=lambda rows, resolved: open_model_drafter(
                    draft.model, rows, resolved, target.vocab_size, True
                ),
                stats=stats,
                # Fresh costs: each request's first round drafts the prior's few tokens (shared costs
                # would soon measure that this draft does not pay, and stop drafting).
                controller=SpeculationController(SharedCosts(), "draft_model"),
            )
        )
        speculative.append(result.sequences[0, width:].tolist())
        drafted += stats.drafted_tokens
        assert stats.decided_by == "controller"
    assert drafted >= SAMPLES  # every request verified drafts: rejection sampling decided their tokens
    vocab = target.vocab_size
    p, q, ours = _marginals(plain, vocab), _marginals(own_draft, vocab), _marginals(speculative, vocab)
    # Two samples of the same distribution stay close (two plain samples of 300: about 0.09 apart); the
    # draft's own distribution is far from it (so a loop that kept the draft's tokens would fail this test).
    assert _total_variation(ours, p) < 0.15
    assert _total_variation(q, p) > 0.5


def test_a_fixed_cost_of_drafting_rounds_is_not_mistaken_for_a_cost_per_token():
    """SmolLM2-135M on a 2-core CPU: a plain round 37 ms, a round with drafts 30 ms more plus 3 ms a token."""
    costs = SharedCosts()
    for _ in range(10):
        costs.observe_verify(1, 0.037, drafted=False)
        for tokens in (2, 3):
            costs.observe_verify(tokens, 0.067 + 0.003 * tokens)
        for k in (1, 2):
            costs.observe_draft("draft_model", k, 0.005 * k)
    # Long blocks amortize the fixed cost; one line through all rounds would price a token at ~30 ms.
    assert _controller(costs, 0.85).best_length() >= 4
    assert _controller(costs, 0.3).best_length() == 0  # and low acceptance still does not pay it


def test_a_drafter_that_rarely_proposes_costs_little_and_still_pays_when_it_does():
    """Prompt lookup on chat: mostly no match (a plain round), now and then a long accepted copy."""
    costs = SharedCosts()
    for _ in range(10):
        costs.observe_verify(1, 0.037, drafted=False)
        for tokens in (3, 6, 11):
            costs.observe_verify(tokens, 0.067 + 0.003 * tokens)
        costs.observe_draft("prompt_lookup", 0, 0.0001)
        costs.observe_draft("prompt_lookup", 5, 0.0002)
    controller = SpeculationController(costs, "prompt_lookup")
    for _ in range(20):  # asked 8: no match in 3 rounds of 4, else 8 proposed and all kept
        for proposed in (0, 0, 0, 8):
            controller.observe(8, [8], [proposed], [proposed], 0.0001, 0.05, 1 + proposed)
    assert controller.continuation.mean < 0.8 and controller.acceptance.mean > 0.9
    assert controller.best_length() >= 4


# A verify forward's cost by tokens on a 2-core CPU (SmolLM2-135M, batched scheduler, after the chat prompt):
# 2 and 3 tokens cost more than 4 (the matrix products switch kernels with the row count).
_CPU_CURVE = {1: 0.036, 2: 0.072, 3: 0.097, 4: 0.076, 5: 0.079, 6: 0.097, 11: 0.105, 21: 0.177}


def _curve_costs(draft_per_token=0.001, proposer="draft_model") -> SharedCosts:
    costs = SharedCosts()
    for _ in range(10):
        for tokens, seconds in _CPU_CURVE.items():
            costs.observe_verify(tokens, seconds, drafted=tokens > 1)
        for k in (1, 3, 5):
            costs.observe_draft(proposer, k, draft_per_token * k)
    return costs


def test_sized_cost_prices_a_measured_size_by_its_own_mean_and_others_by_the_line():
    cost = SizedCost()
    for _ in range(10):
        for tokens, seconds in _CPU_CURVE.items():
            if tokens > 1:
                cost.observe(tokens, seconds)
    line = cost.line.fit(0.05)
    assert line is not None
    assert cost.at(3, line) > cost.at(4, line)  # the step the line alone would miss
    assert cost.at(3, line) == pytest.approx(0.097, rel=0.1) and cost.at(4, line) == pytest.approx(0.076, rel=0.1)
    assert cost.at(3.5, line) == pytest.approx((cost.at(3, line) + cost.at(4, line)) / 2)
    assert cost.at(8, line) == pytest.approx(line[0] + line[1] * 8)  # never measured: the line


def test_a_longer_block_that_costs_less_than_a_shorter_one_is_preferred():
    controller = _controller(_curve_costs(), 0.8)
    prices = controller.costs.prices("draft_model")
    assert prices.verify(4) < prices.verify(3)
    assert controller.rate(3, prices) > controller.rate(2, prices)
    assert controller.best_length() >= 3


def test_run_lengths_keep_copies_that_go_on():
    """Prompt lookup on an edit: half the matches are wrong at once, the others copy to the end of the block."""
    runs = RunLengths(positions=10)
    for _ in range(20):
        runs.observe(10, 0)
        runs.observe(10, 10)
    survival = runs.survival(overall=10 / 11, k=10)
    assert survival[0] == pytest.approx(0.5, abs=0.1)  # (shrunk a little towards the overall 10/11)
    assert survival[9] > 0.4  # once the first is kept, the rest is too (geometric: (10/11)^10 = 0.39 ...)
    assert survival[9] > (10 / 11) ** 10 and survival[0] < 10 / 11  # (... and it overrates the first token)
    assert RunLengths(positions=4).survival(0.5, 3) == pytest.approx([0.5, 0.25, 0.125])  # no data: geometric
    # Blocks of 3, always kept: chained, the positions never reached are assumed to keep going too.
    short, chained = RunLengths(positions=10), RunLengths(positions=10, chained=True)
    for _ in range(20):
        short.observe(3, 3)
        chained.observe(3, 3)
    assert chained.survival(0.6, 10)[9] > 0.5 > short.survival(0.6, 10)[9]


def test_the_draft_catch_up_is_learned_from_the_first_block_and_priced():
    costs = _curve_costs(draft_per_token=0.005)
    controller = _controller(costs, 0.95)
    controller.next_length()
    controller.observe(5, [5], [5], [5], 0.025 + 0.4, 0.079, 6, behind=400)  # the draft's prefill: 1 ms a token
    assert costs.catch_up("draft_model") == pytest.approx(0.001, rel=0.05)
    fresh = _controller(costs, 0.95)
    assert fresh.best_length(remaining=1000, behind=400) > 0  # 0.4 s of prefill is repaid over 1000 tokens
    assert fresh.best_length(remaining=10, behind=400) == 0  # not over 10
    assert fresh.best_length(remaining=10, behind=0) > 0  # the draft already caught up: drafting pays


def test_a_new_request_starts_from_the_acceptance_earlier_requests_measured():
    """With the constant prior's mean (0.7) the draft's prefill of a long prompt is not repaid, so a request would
    never draft; once earlier requests measured that the pair agrees (every draft kept), a new one drafts at once."""
    costs = _curve_costs(draft_per_token=0.005)
    costs.observe_catch_up("draft_model", 400, 0.4)  # 1 ms a token
    cautious = SpeculationController(costs, "draft_model")
    assert cautious.best_length(remaining=128, behind=400) == 0
    earlier = SpeculationController(costs, "draft_model")
    for _ in range(30):
        earlier.observe(8, [8], [8], [8], 0.045, 0.08, 9)
    accepted, continued, _ = costs.priors("draft_model")
    assert accepted > 0.95 and continued > 0.95
    informed = SpeculationController(costs, "draft_model")
    assert informed.acceptance.mean == pytest.approx(accepted)
    assert informed.best_length(remaining=128, behind=400) > 0
    # The request's own rounds still decide: a few all rejected and it stops.
    for _ in range(6):
        informed.observe(5, [5], [5], [0], 0.03, 0.08, 6)
    assert informed.best_length(remaining=128) == 0
    # Prompt lookup keeps its constant prior: whether a prompt repeats itself is the prompt's.
    lookup = SpeculationController(costs, "prompt_lookup")
    for _ in range(30):
        lookup.observe(8, [8], [0], [0], 0.0, 0.04, 1)
    assert costs.priors("prompt_lookup")[:2] == (0.8, 0.5)


def test_a_probe_that_the_rest_of_the_request_cannot_repay_is_skipped():
    costs = _costs(draft=(0.005, 0.030))
    costs.observe_catch_up("draft_model", 400, 0.4)
    options = ControllerOptions(off_rounds=2, max_off_rounds=8)
    controller = SpeculationController(costs, "draft_model", options=options)
    assert [controller.next_length(remaining=1000) for _ in range(2)] == [0, 0]
    assert controller.next_length(remaining=20, behind=400) == 0  # 0.4 s of catch-up: over 5% of 20 rounds
    assert controller.probes == 0
    controller.off_left = 0
    assert controller.next_length(remaining=1000, behind=400) == options.probe_length  # 1000 rounds afford it
    assert controller.probes == 1


def test_prompt_lookup_without_a_match_costs_a_plain_round_and_drafts_from_the_start():
    """Prompt lookup's proposals are all or nothing: no match is a plain round, not a failed block."""
    costs = _curve_costs(draft_per_token=0.00001, proposer="prompt_lookup")
    controller = SpeculationController(costs, "prompt_lookup")
    assert controller.best_length() >= 3  # the priors (a match half the time, 0.8 acceptance) already pay
    for _ in range(30):  # asked 10: a match in one round of 5, then all 10 kept
        for proposed in (0, 0, 0, 0, 10):
            controller.observe(10, [10], [proposed], [proposed], 0.00001, _CPU_CURVE[1 + proposed], 1 + proposed)
    prices = costs.prices("prompt_lookup")
    assert controller.continuation.mean < 0.35  # a match in about one round of 5 (the last one matched)
    assert controller.best_length() >= 10
    assert controller.rate(10, prices) > 1.1 * controller.rate(0, prices)


def test_a_plain_round_is_measured_when_every_round_drafts():
    """Without a plain round the controller would price plain decoding by the verify line; it measures one after
    the first drafting round and again every `plain_every` drafting rounds, without taking time off."""
    costs = SharedCosts()
    options = ControllerOptions(plain_every=5)
    controller = _controller(costs, 0.95, options=options)
    lengths = []
    for _ in range(14):
        k = controller.next_length()
        lengths.append(k)
        controller.observe(k, [k], [k], [k], 0.002 * k, 0.03 + 0.002 * k if k else 0.02, 1 + k)
    assert lengths[0] > 0 and lengths[1] == 0  # the first block, then a plain round to compare it with
    assert [i for i, k in enumerate(lengths) if k == 0] == [1, 7, 13]
    assert not controller.off and controller.probes == 0
    assert costs.plain() is not None


def test_a_co_located_draft_under_load_charges_its_draft_time_to_the_others():
    """A draft on the target's device takes it from the requests waiting: under load it stops drafting where a
    remote draft, costing the same wall time but not the device, still drafts."""
    costs = _costs(verify=(0.030, 0.001), draft=(0.0, 0.004))
    remote = _controller(costs, 0.9, load=lambda: 7).best_length()
    colocated = _controller(costs, 0.9, load=lambda: 7, shares_device=True).best_length()
    assert remote > 0 and colocated == 0
    assert _controller(costs, 0.9, shares_device=True).best_length() > 0  # alone it drafts


def test_under_load_rounds_are_priced_as_rounds_alone_priced_the_packed_forward():
    """8 co-located chat clients after single-client requests (their DEBUG lines' prices): rounds measured under
    load (a plain round while the others prefill, a block packed with them) do not reprice rounds measured alone,
    and a loaded round is priced as a lone forward of its tokens and the others' (one each). There a block of the
    co-located draft costs everyone its draft time, and plain decoding wins; alone, drafting does."""
    costs = SharedCosts()
    for _ in range(20):
        for tokens in range(2, 34):
            costs.observe_verify(tokens, 0.037 + 0.003 * (tokens - 1))  # alone
        costs.observe_verify(1, 0.035, drafted=False)
        for k in range(1, 7):
            costs.observe_draft("draft_model", k, 0.003 + 0.0155 * k)
    for _ in range(200):
        costs.observe_kept("draft_model", 1.0, 2)  # chat's long sure runs, kept twice as often as predicted
    alone_prices = costs.prices("draft_model")
    for _ in range(5):  # what the first loaded rounds measured
        costs.observe_verify(1, 0.290, drafted=False, loaded=True)
        costs.observe_verify(2, 0.170, loaded=True)
    prices = costs.prices("draft_model")
    assert prices.plain(1) == pytest.approx(alone_prices.plain(1)) == pytest.approx(0.035)
    assert prices.verify(2) == pytest.approx(alone_prices.verify(2))

    def controller(**kwargs) -> SpeculationController:
        acceptance, continuation, last = (
            AcceptanceEstimate(prior_mean=m, prior_strength=1e6) for m in (0.99, 0.92, 0.68)
        )
        return SpeculationController(
            costs,
            "draft_model",
            acceptance=acceptance,
            continuation=continuation,
            last=last,
            shares_device=True,
            **kwargs,
        )

    loaded = controller(load=lambda: 7)
    assert loaded.expect(0, prices, others=7).verify_s == pytest.approx(prices.verify(8))  # 8 tokens, not 1
    proposed = sum(0.92**i for i in range(4))  # of 4 asked
    assert loaded.expect(4, prices, others=7).verify_s == pytest.approx(prices.verify(1 + proposed + 7))
    assert loaded.best_length() == 0
    alone = controller()
    assert alone.expect(1, prices).verify_s == pytest.approx(prices.verify(2))
    assert alone.best_length() > 0


def test_loaded_rounds_price_rounds_until_rounds_alone_are_measured():
    """A target that only ever ran loaded still prices rounds in seconds (its draft price is in seconds too)."""
    costs = SharedCosts()
    costs.observe_verify(1, 0.100, drafted=False, loaded=True)
    costs.observe_verify(3, 0.150, loaded=True)
    assert costs.prices("draft_model").plain(1) == pytest.approx(0.100)
    assert costs.prices("draft_model").verify(3) == pytest.approx(0.150)
    costs.observe_verify(1, 0.030, drafted=False)  # alone: replaces what loaded rounds said, and they stop repricing
    costs.observe_verify(1, 0.300, drafted=False, loaded=True)
    assert costs.prices("draft_model").plain(1) == pytest.approx(0.030)
    assert costs.prices("draft_model").verify(3) == pytest.approx(0.150)  # no round with drafts alone yet
    # A request's controller says whether others shared its round (the target's load when the round ended).
    busy = SpeculationController(costs, "draft_model", load=lambda: 7)
    busy.next_length(remaining=100)
    busy.observe(0, [0], [0], [0], 0.0, 0.500, 1)
    assert costs.prices("draft_model").plain(1) == pytest.approx(0.030)
    alone = SpeculationController(costs, "draft_model")
    alone.next_length(remaining=100)
    alone.observe(0, [0], [0], [0], 0.0, 0.040, 1)
    assert costs.prices("draft_model").plain(1) > 0.030


def _plain_rounds(controller: SpeculationController, count: int) -> None:
    for _ in range(count):
        assert controller.next_length(remaining=500) == 0 and not controller.looking_back
        controller.observe(0, [0], [0], [0], 0.0, 0.036, 1)


def test_look_backs_end_the_time_off_and_resume_drafting_where_it_would_have_paid():
    """A greedy draft model's request starts with time off; each look-back reads how many of the target's tokens
    the draft would have drafted (its hindsight) and resumes drafting where those would have paid."""
    costs = _curve_costs(draft_per_token=0.005)
    options = ControllerOptions(off_rounds=3, max_off_rounds=64)
    controller = SpeculationController(costs, "draft_model", options=options, look_back=True)
    _plain_rounds(controller, 3)  # no block on the prior: the first tokens of an answer are drafted worst
    assert controller.next_length(remaining=500) == 0 and controller.looking_back and controller.probes == 1
    controller.observe(0, [0], [0], [0], 0.02, 0.036, 1, behind=4, hindsight=(3, 0, 3))  # none would have been kept
    assert controller.off and controller.off_left >= options.off_rounds
    gaps = []
    while controller.off:  # the draft would have had all of the time off's tokens: a few look-backs resume
        gaps.append(controller.off_left)
        _plain_rounds(controller, controller.off_left)
        assert controller.next_length(remaining=500) == 0 and controller.looking_back
        checked = gaps[-1] + 1
        controller.observe(0, [0], [0], [0], 0.02, 0.036, 1, behind=checked, hindsight=(checked, checked, checked))
    assert len(gaps) <= 3 and controller.probes == 1 + len(gaps)
    assert controller.next_length(remaining=500) > 0
    # What the look-backs saw is the pair's evidence too: the next request starts from it.
    assert costs.priors("draft_model")[0] != SpeculationController(SharedCosts(), "draft_model").acceptance.mean


@pytest.mark.parametrize(
    "prompt, colocated, at_once", [(40, True, True), (400, True, False), (40, False, False)], ids=str
)
def test_a_co_located_request_drafts_from_its_first_round_unless_its_prompts_prefill_is_over_the_budget(
    prompt, colocated, at_once
):
    """Where drafting pays at the target's priors, a request with a co-located draft drafts from its first round: a
    first block the draft is unsure of costs a draft forward or two. A long prompt's prefill is what that block would
    risk: over `probe_budget` of the rest, the request starts with time off, as it does where drafting would not pay,
    and as a remote draft's request does."""
    costs = _curve_costs(draft_per_token=0.001)
    costs.observe_catch_up("draft_model", 400, 0.4)  # 1 ms a token
    priors = AcceptanceEstimate(prior_mean=0.9)  # what earlier requests measured (`SharedCosts.priors`)
    controller = SpeculationController(costs, "draft_model", acceptance=priors, shares_device=colocated, look_back=True)
    assert controller.off and controller.best_length(150, prompt) > 0  # drafting pays at the priors either way
    assert (controller.next_length(remaining=150, behind=prompt) > 0) is at_once
    assert controller.off is not at_once and controller.probes == 0
    slow = SpeculationController(_curve_costs(draft_per_token=0.05), "draft_model", shares_device=True, look_back=True)
    assert slow.next_length(remaining=150, behind=40) == 0 and slow.off  # drafting does not pay: time off


def test_a_look_back_is_skipped_when_the_rest_cannot_repay_the_catch_up_and_a_silent_one_turns_to_probes():
    costs = _curve_costs(draft_per_token=0.005)
    costs.observe_catch_up("draft_model", 400, 0.4)  # 1 ms a token
    options = ControllerOptions(off_rounds=2, max_off_rounds=64)
    controller = SpeculationController(costs, "draft_model", options=options, look_back=True)
    _plain_rounds(controller, 2)
    assert controller.next_length(remaining=20, behind=400) == 0  # 0.4 s of catch-up: over 5% of 20 rounds
    assert not controller.looking_back and controller.probes == 0
    controller.off_left = 0
    assert controller.next_length(remaining=1000, behind=3) == 0 and controller.looking_back
    # A drafter that reports no hindsight (a draft service without it): probes blocks from then on.
    controller.observe(0, [0], [0], [0], 0.02, 0.036, 1, behind=3, hindsight=(0, 0, 0))
    assert not controller.look_back and controller.off
    assert controller.next_length(remaining=1000) == options.probe_length and controller.probing


def test_a_look_back_under_load_counts_the_wait_of_those_sharing_the_draft():
    """A co-located draft's catch-up takes the device from every request waiting, a remote draft service's from
    every request drafting with it (one model thread serves them in turn): a look-back affordable alone is skipped
    when they wait, not for requests that only share the target's forwards."""
    costs = _curve_costs(draft_per_token=0.005)
    costs.observe_catch_up("draft_model", 400, 0.4)  # 1 ms a token
    options = ControllerOptions(off_rounds=2, loss_budget=None)  # alone, a co-located draft would draft at once

    def look_back_made(**kwargs) -> bool:
        controller = SpeculationController(costs, "draft_model", options=options, look_back=True, **kwargs)
        _plain_rounds(controller, 2)
        controller.next_length(remaining=300, behind=200)  # 0.2 s against 5% of 300 plain rounds (~0.5 s)
        return controller.looking_back

    assert look_back_made(shares_device=True)
    assert look_back_made(load=lambda: 7)
    assert not look_back_made(shares_device=True, load=lambda: 7)
    assert look_back_made(load=lambda: 7, draft_load=lambda: 0)  # the others decode plainly
    assert not look_back_made(load=lambda: 7, draft_load=lambda: 7)


def test_an_unmeasured_catch_up_is_free_alone_and_priced_as_the_targets_own_forward_when_shared():
    """A catch-up nobody measured (or measured too long ago, `stale_after_requests`) is free to a request alone,
    which then measures it, and priced by the target's plain line where others share the draft: a wave of
    requests sharing a draft service does not all look back on the prompt to find out its cost."""
    costs = _curve_costs(draft_per_token=0.005)
    assert costs.catch_up_line("draft_model") is None
    options = ControllerOptions(off_rounds=2)

    def look_back_made(**kwargs) -> bool:
        controller = SpeculationController(costs, "draft_model", options=options, look_back=True, **kwargs)
        _plain_rounds(controller, 2)
        controller.next_length(remaining=40, behind=60)
        return controller.looking_back

    assert look_back_made()  # alone: taken, to measure it
    assert not look_back_made(draft_load=lambda: 7)  # 8 of them would wait for each other's


def test_the_time_off_after_a_look_back_is_priced_by_the_next_one_not_by_the_prompt_the_first_caught_up_on():
    """The first look-back also pays the draft's prefill of the prompt, a one-off: the time off after it is what
    the next look-back costs (a catch-up forward's fixed cost, then the time off's tokens) within the budget."""
    costs = _curve_costs(draft_per_token=0.005)
    fixed, per_token = 0.017, 0.0008
    for tokens in (4, 16, 70, 400) * 3:
        costs.observe_catch_up("draft_model", tokens, fixed + per_token * tokens)
    options = ControllerOptions(off_rounds=10)  # twice it is above the budgeted interval (which then decides)
    controller = SpeculationController(costs, "draft_model", options=options, look_back=True)
    _plain_rounds(controller, 10)
    assert controller.next_length(remaining=500, behind=72) == 0 and controller.looking_back
    controller.observe(0, [0], [0], [0], fixed + per_token * 72, 0.036, 1, behind=72, hindsight=(3, 0, 3))
    p0, p1 = costs.plain()
    expected = math.ceil(fixed / (options.probe_budget * (p0 + p1) - per_token))
    assert abs(controller.off_period - expected) <= 1 and expected < 30  # ~59 priced by this look-back's cost


def test_look_backs_are_spaced_by_what_look_backs_cost_not_by_the_catch_up_line():
    """A look-back pays the fixed part of a call and a forward, which the catch-up line leaves to a block's `d0`:
    once two look-backs measured their own cost, look-backs that keep saying no come at twice the last time off,
    from a quarter of the interval that keeps each within the budget of the time off before it up to it."""
    costs = _curve_costs(draft_per_token=0.005)
    for k in range(1, 7):  # blocks: a fixed part of 40 ms (a remote draft's call and first forward)
        costs.observe_draft("draft_model", k, 0.040 + 0.030 * k)
    per_token, fixed = 0.001, 0.040
    options = ControllerOptions(off_rounds=4, max_off_rounds=256)

    def look_back(controller: SpeculationController, behind: int) -> int:
        """A look-back over `behind` tokens after which drafting does not pay; the time off after it."""
        assert controller.next_length(remaining=500, behind=behind) == 0 and controller.looking_back
        seconds = fixed + per_token * behind
        controller.observe(0, [0], [0], [0], seconds, 0.036, 1, behind=behind, hindsight=(behind, 0, behind))
        return controller.off_period

    def first_look_back(behind: int) -> int:
        controller = SpeculationController(costs, "draft_model", options=options, look_back=True)
        _plain_rounds(controller, options.off_rounds)
        return look_back(controller, behind)

    # Priced by the catch-up line alone (what the look-back took beyond a block's fixed part: nearly nothing
    # fixed), the next look-back would come after `off_rounds`.
    assert first_look_back(50) == options.off_rounds
    assert costs.look_back_line("draft_model") is None  # one look-back cannot tell its fixed part
    first_look_back(5)
    line = costs.look_back_line("draft_model")
    assert line is not None and line[0] == pytest.approx(fixed, rel=0.1)
    p0, p1 = costs.plain()
    budgeted = math.ceil(line[0] / (options.probe_budget * (p0 + p1) - line[1]))
    assert budgeted > 32
    controller = SpeculationController(costs, "draft_model", options=options, look_back=True)
    _plain_rounds(controller, options.off_rounds)
    gaps = [look_back(controller, options.off_rounds + 1)]
    for _ in range(5):
        _plain_rounds(controller, gaps[-1])
        gaps.append(look_back(controller, gaps[-1] + 1))
    # From a quarter of the budgeted interval (above twice `off_rounds` here), doubling, up to that interval (each
    # look-back also refits the line a little).
    quarter = math.ceil(budgeted / 4)
    assert quarter > 2 * options.off_rounds and 2 * quarter < budgeted
    assert abs(gaps[0] - quarter) <= 1 and gaps[1] == 2 * gaps[0] and all(abs(g - budgeted) <= 1 for g in gaps[2:])


def test_look_backs_that_never_resume_cost_a_request_at_most_the_budget_of_its_plain_decoding():
    """Each look-back is within the budget of the rest of the request, and those at an answer's start come sooner
    than that budget alone would space them: on a short answer they added up to several budgets (the demo's 54
    tokens: ~7% of plain decoding). What look-backs and probes cost since drafting last resumed stays within
    `probe_budget` of the whole request's plain decoding; a look-back that resumes drafting starts it again."""
    costs = _curve_costs(draft_per_token=0.040)  # a draft about as dear as its target: drafting never pays
    fixed, per_token = 0.020, 0.001
    for behind in (5, 60) * 3:
        costs.observe_look_back("draft_model", behind, fixed + per_token * behind)
    # `probe_budget`'s own bound (the loss budget, 3%, would not afford the first look-back here: see
    # `test_look_backs_and_probes_count_against_the_loss_budget_drafting_spends`).
    options = ControllerOptions(off_rounds=4, loss_budget=None)
    length, prompt = 64, 55

    def run(controller: SpeculationController, each_alone: bool = False) -> float:
        """The request's 64 tokens, never drafting: the seconds its look-backs took (`each_alone`: each one priced
        against the rest of the request only, as before the request's total bounded them)."""
        spent, behind, unseen = 0.0, prompt, 0  # unseen: the answer's tokens the draft has not checked
        for done in range(length):
            assert controller.next_length(remaining=length - done, behind=behind) == 0
            seconds = fixed + per_token * behind if controller.looking_back else 0.0
            checked = unseen if controller.looking_back else 0
            controller.observe(0, [0], [0], [0], seconds, 0.036, 1, behind=behind, hindsight=(checked, 0, checked))
            spent += seconds
            controller.explored_s *= not each_alone
            behind, unseen = (1, 1) if controller.looking_back else (behind + 1, unseen + 1)
        return spent

    spent = run(SpeculationController(costs, "draft_model", options=options, look_back=True))
    plain = costs.prices("draft_model").plain(1) * length
    assert 0 < spent <= options.probe_budget * plain
    assert run(SpeculationController(costs, "draft_model", options=options, look_back=True), each_alone=True) > (
        options.probe_budget * plain
    )
    # A look-back after which drafting pays forgets what trying cost.
    cheap = _curve_costs(draft_per_token=0.001)
    resumed = SpeculationController(cheap, "draft_model", options=options, look_back=True, explored_s=0.1)
    resumed.off_left = 0
    assert resumed.next_length(remaining=500, behind=5) == 0 and resumed.looking_back
    resumed.observe(0, [0], [0], [0], 0.03, 0.036, 1, behind=5, hindsight=(5, 5, 5))
    assert not resumed.off and resumed.explored_s == 0.0


def test_look_backs_over_a_few_tokens_each_are_priced_mostly_by_their_fixed_part():
    """An overlapped draft's session prefills the prompt apart, so its look-backs all catch up on the few tokens
    since the last one. A line through the origin put all of their cost on those tokens (~12 ms a token for a
    60 ms look-back over 5, where the draft service's prefill ran at ~2.6): no time off was long enough for the
    next look-back to stay within the budget, so each request looked back once, at its answer's start."""
    costs = SharedCosts()
    for _ in range(3):
        costs.observe_verify(1, 0.085, drafted=False)  # a target pinned to one core
    for _ in range(6):
        costs.observe_look_back("draft_model", 5, 0.060)
    line = costs.look_back_line("draft_model")
    assert line is not None and line[0] > 0.75 * 0.060 and line[1] < 0.005
    controller = SpeculationController(costs, "draft_model", look_back=True)
    assert controller._look_back_interval() <= 32  # the next look-back within a 128-token answer
    # Look-backs over many tokens and over few still tell the two parts apart.
    for tokens in (5, 60, 5, 60, 5, 60):
        costs.observe_look_back("draft_model", tokens, 0.030 + 0.002 * tokens)
    line = costs.look_back_line("draft_model")
    assert line is not None and line[1] == pytest.approx(0.002, rel=0.35)


def test_a_cost_not_measured_again_over_16_requests_is_forgotten():
    """A cost measured under a burst stops every request from drafting, so nothing would measure it again: after
    `stale_after_requests` requests without a measurement it is forgotten, and the next one starts a fresh line."""
    costs = SharedCosts(stale_after_requests=16)
    for k in (1, 2, 3, 4) * 5:
        costs.observe_draft("draft_model", k, 0.2 * k)  # 8 streams served in turn: 200 ms a token
        costs.observe_catch_up("draft_model", 10 * k, 0.1 + 0.01 * k)
        costs.observe_verify(1 + k, 0.3, drafted=True)  # each verify waits for 7 others' in the packed forward
        costs.observe_verify(1, 0.036, drafted=False)
    assert costs.prices("draft_model").verify(3) == pytest.approx(0.3, rel=0.05)
    assert _draft_block(costs, 3) == pytest.approx(0.6, rel=0.05)
    assert costs.catch_up("draft_model") > 0
    for _ in range(16):
        SpeculationController(costs, "draft_model")  # requests that measured nothing
    assert _draft_block(costs, 3) == pytest.approx(0.6, rel=0.05)  # still known
    SpeculationController(costs, "draft_model")
    assert costs.draft("draft_model", 0.03) == pytest.approx((0.0, 0.2 * 0.03))  # the prior again
    assert costs.catch_up_line("draft_model") is None and costs.catch_up("draft_model") == 0.0
    prices = costs.prices("draft_model")
    assert costs.verify() is None and prices.verify(3) == prices.plain(3)  # priced as plain until measured
    for k in (1, 2, 3):
        costs.observe_draft("draft_model", k, 0.012 * k)  # alone again: 12 ms a token, not mixed with the burst
    assert _draft_block(costs, 2) == pytest.approx(0.024, rel=0.05)  # the line through their mean


def _draft_block(costs: SharedCosts, k: int) -> float:
    d0, d1 = costs.draft("draft_model", 0.03)
    return d0 + d1 * k


def test_a_look_back_reads_acceptance_among_the_guesses_the_draft_was_sure_of():
    """A draft stops where it is unsure, so its blocks see the acceptance of its sure guesses (`Hindsight.kept /
    confident`): sure of 9 of 14 tokens and right on all 9, drafting pays (9 right of 14 would not); right on 7 of
    the 9, it does not."""
    options = ControllerOptions(off_rounds=3, max_off_rounds=64)

    def resumed(kept: int) -> bool:
        costs = _curve_costs(draft_per_token=0.005)
        controller = SpeculationController(costs, "draft_model", options=options, look_back=True)
        _plain_rounds(controller, 3)
        assert controller.next_length(remaining=500) == 0 and controller.looking_back
        controller.observe(0, [0], [0], [0], 0.02, 0.036, 1, behind=14, hindsight=(14, kept, 9))
        return not controller.off

    assert resumed(9)
    assert not resumed(7)


def test_a_draft_model_always_proposes_its_first_token_and_goes_on_after_sure_ones():
    """Asked for `k`, a draft model drafts its first token whatever its confidence and goes on after each sure one
    (`c`): a draft that is never sure still makes every round a block of one draft, its last, kept with the last
    draft's acceptance."""
    costs = _curve_costs(draft_per_token=0.001)
    never_sure = AcceptanceEstimate(prior_mean=0.001, prior_strength=1e6)
    right = AcceptanceEstimate(prior_mean=0.999, prior_strength=1e6)
    half = AcceptanceEstimate(prior_mean=0.5, prior_strength=1e6)
    controller = SpeculationController(costs, "draft_model", acceptance=right, continuation=never_sure, last=half)
    prices = costs.prices("draft_model")
    d0, d1 = prices.draft
    one_draft = 1.5 / (d0 + d1 + prices.verify(2))  # the target's token and half a draft, a block of 2
    assert controller.rate(1, prices) == pytest.approx(one_draft, rel=0.01)
    assert controller.rate(5, prices) == pytest.approx(one_draft, rel=0.01)
    # Its blocks are evidence on going on after the first draft only: asked 5, proposing 1 is one stop.
    fresh = SpeculationController(costs, "draft_model")
    before = fresh.continuation.mean
    fresh.observe(1, [1], [1], [1], 0.01, 0.07, 2)  # asked 1: nothing to go on after
    assert fresh.continuation.mean == before
    for _ in range(5):
        fresh.observe(5, [5], [1], [1], 0.01, 0.07, 2)
    assert fresh.continuation.mean < 0.5 * before


def test_the_draft_a_drafter_stopped_after_is_counted_apart_from_the_sure_ones_before_it():
    """A draft model stops after a draft it is unsure of, and that last draft is rejected far more often than the
    sure ones before it. Blocks that keep their 4 sure drafts and lose the unsure fifth leave the sure drafts'
    acceptance near 1 (where a look-back, reading kept among sure guesses, puts it too) and the last draft's near 0,
    and the model predicts the 4 drafts a block keeps. One acceptance for all five (0.8) predicted ~2, and each
    block dragged the acceptance a look-back had measured down by up to a tenth."""
    costs = _curve_costs(draft_per_token=0.005)
    controller = SpeculationController(costs, "draft_model")
    for _ in range(20):
        controller.observe(8, [8], [5], [4], 0.025, 0.07, 6)
    assert controller.acceptance.mean > 0.95 and controller.last.mean < 0.15
    assert controller._kept(8) == pytest.approx(4.0, rel=0.15)
    acceptance, _, last = costs.priors("draft_model")  # what the next request starts from
    assert acceptance > 0.9 and last < 0.2
    # A block the length cut short has no last draft of its own: its drafts all count as sure.
    last_before, acceptance_before = controller.last.mean, controller.acceptance.mean
    controller.observe(3, [3], [3], [2], 0.015, 0.06, 4)
    assert controller.last.mean == last_before and controller.acceptance.mean < acceptance_before


def test_an_unmeasured_draft_costs_at_least_the_forward_its_catch_up_measured():
    """Before any block, a look-back has measured the draft's forward (its catch-up): each drafted token is such a
    forward, so a draft 10x slower than the target is not taken for the prior's fraction of a verify forward."""
    costs = SharedCosts()
    for _ in range(3):
        costs.observe_verify(1, 0.002, drafted=False)  # a ~2 ms target
    assert costs.draft("draft_model", 0.002) == pytest.approx((0.0, 0.2 * 0.002))  # nothing measured: the prior
    costs.observe_catch_up("draft_model", 20, 0.024)  # a 20 ms forward over the prompt
    assert costs.draft("draft_model", 0.002)[1] == pytest.approx(0.024 / 20, rel=0.01)
    controller = SpeculationController(costs, "draft_model", acceptance=AcceptanceEstimate(prior_mean=0.35))
    assert controller.best_length(remaining=70) == 0
    assert costs.draft("prompt_lookup", 0.002) == (0.0, 0.0)  # prompt lookup: free until measured


def test_drafts_kept_beyond_the_models_prediction_raise_its_factor_which_never_drops_below_one():
    """The model multiplies per-token rates as if each token were a coin of its own; a draft model's long runs are
    kept more often than that. The target measures kept over predicted drafts and scales the model by it: a pair
    the model priced at break-even drafts once its blocks kept twice what it predicted. Blocks that keep less
    leave the factor at 1 (their acceptance already says so), so one rejected block cannot price drafting out."""
    costs = _costs(draft=(0.0, 0.016))
    assert costs.kept_factor("draft_model") == 1.0
    controller = _controller(costs, 0.5)
    assert controller.best_length() == 0  # the product of its rates: drafting does not pay
    assert controller._kept(8) < 1.0
    for _ in range(4):  # the blocks it drafts keep all 8 drafts
        controller.observe(8, [8], [8], [8], 0.1, 0.05, 9)
    assert costs.kept_factor("draft_model") == pytest.approx(2.0)  # the upper bound
    assert costs.prices("draft_model").kept_factor == pytest.approx(2.0)
    assert controller.best_length() > 0
    other = SharedCosts()
    other.observe_kept("draft_model", 1.5, 0)  # a first block rejected
    assert other.kept_factor("draft_model") == 1.0


def test_the_first_block_after_a_look_back_measures_the_draft():
    """A look-back caught the draft up, so the block after it costs what drafting costs: it is learned as a draft
    price (before, only a block after a block was, and a request that looked back between single blocks never
    measured the draft and kept an inflated prior)."""
    costs = _curve_costs(draft_per_token=0.005)
    controller = SpeculationController(costs, "draft_model", options=ControllerOptions(off_rounds=1), look_back=True)
    _plain_rounds(controller, 1)
    assert controller.next_length(remaining=500) == 0 and controller.looking_back
    controller.observe(0, [0], [0], [0], 0.02, 0.036, 1, behind=40, hindsight=(3, 3, 3))
    before = costs._drafts["draft_model"].observations
    k = controller.next_length(remaining=500)
    assert k > 0
    controller.observe(k, [k], [k], [k], 0.005 * k, 0.05, k + 1, behind=2)
    assert costs._drafts["draft_model"].observations == before + 1


@pytest.mark.parametrize("shares_device", [True, False])
def test_a_co_located_block_after_a_round_measuring_plain_decoding_still_prices_the_draft(shares_device):
    """A fresh target measures a plain round right after its first block (`plain_due`). A co-located draft's next
    block takes that round's token along in its first forward: it prices the draft (counted as a catch-up, no block
    of a fresh target did, and the draft stayed priced at what catch-ups said of a forward). A remote draft's is a
    catch-up still."""
    costs = SharedCosts()
    controller = _controller(costs, 0.95, shares_device=shares_device)
    k = controller.next_length()
    assert k > 0
    # The first block caught the draft up on the prompt.
    controller.observe(k, [k], [k], [k], 0.002 * k + 0.02, 0.03 + 0.002 * k, 1 + k, behind=40)
    assert controller.next_length() == 0  # the round measuring plain decoding
    controller.observe(0, [0], [0], [0], 0.0, 0.02, 1)
    k = controller.next_length()
    assert k > 0
    controller.observe(k, [k], [k], [k], 0.002 * k, 0.03 + 0.002 * k, 1 + k, behind=2)
    assert costs.draft_blocks("draft_model") == (1 if shares_device else 0)


def _slow_first_blocks(blocks: int) -> SharedCosts:
    """A target whose draft's forward (its catch-ups) costs 5 ms a token, and whose first `blocks` blocks cost 40 ms
    a drafted token (a cold draft)."""
    costs = SharedCosts()
    for _ in range(10):
        for tokens, seconds in _CPU_CURVE.items():
            costs.observe_verify(tokens, seconds, drafted=tokens > 1)
    costs.observe_catch_up("draft_model", 40, 0.2)
    for _ in range(blocks):
        costs.observe_draft("draft_model", 3, 0.120)
    return costs


@pytest.mark.parametrize("blocks", [1, 4])
def test_a_draft_price_from_too_few_blocks_is_measured_again_where_it_alone_keeps_drafting_out(blocks):
    """Look-backs and probes do not measure the draft's price (their drafter catches up first): a price from one
    slow block would keep a request off drafting for good. Where the draft's forward says drafting pays, the block
    after the look-back measures the price again; a price measured from `SURE_DRAFT_BLOCKS` blocks stands."""
    costs = _slow_first_blocks(blocks)
    assert costs.forward_price("draft_model") == pytest.approx(0.005) and costs.draft_blocks("draft_model") == blocks
    controller = SpeculationController(costs, "draft_model", options=ControllerOptions(off_rounds=1), look_back=True)
    _plain_rounds(controller, 1)
    assert controller.next_length(remaining=500) == 0 and controller.looking_back
    controller.observe(0, [0], [0], [0], 0.2, 0.036, 1, behind=40, hindsight=(20, 20, 20))  # every guess kept
    assert controller.best_length(remaining=500) == 0  # at the measured price drafting does not pay
    if blocks >= 4:  # SURE_DRAFT_BLOCKS: the price stands
        assert controller.off and controller.next_length(remaining=500) == 0
        return
    assert not controller.off
    k = controller.next_length(remaining=500)
    assert k > 0
    controller.observe(k, [k], [k], [k], 0.005 * k, _CPU_CURVE.get(k + 1, 0.15), k + 1)
    assert costs.draft_blocks("draft_model") == blocks + 1


def test_a_probe_re_measures_a_doubtful_draft_price_too():
    """A sampling request probes instead of looking back; a probe's block pays a catch-up, so it measures no price
    either: where the forward says drafting pays, drafting resumes after it."""
    costs = _slow_first_blocks(1)
    options = ControllerOptions(off_rounds=1, probe_length=3)
    controller = _controller(costs, 0.95, options=options)
    assert controller.next_length(remaining=500) == 0 and controller.off  # the measured price: plain decoding
    assert controller.next_length(remaining=500) == 3 and controller.probing
    controller.observe(3, [3], [3], [3], 0.025, 0.097, 4, behind=2)  # 5 ms a token: the price was wrong
    assert not controller.off and controller.next_length(remaining=500) > 0


def test_drafting_goes_on_near_break_even_where_it_would_not_start():
    """Hysteresis: a block needs `margin` over plain decoding to start drafting and only `keep_margin` to go on, so
    estimates hovering at the break-even point do not stop and resume drafting (each stop a time off) every block.
    (`loss_budget=None`: alone, the rounds would decide, `test_drafting_alone_goes_on_by_its_rounds...`.)"""
    costs = _costs()
    by_estimates = ControllerOptions(loss_budget=None)

    def edge(controller: SpeculationController) -> float:  # the best block's expected rate over plain decoding's
        prices = controller._prices()
        return max(controller.rate(k, prices) for k in range(1, 33)) / controller.rate(0, prices)

    def pinned(controller: SpeculationController, ratio: float) -> SpeculationController:
        """The controller with the acceptance at which its best block is expected `ratio` of plain's rate."""
        low, high = 0.05, 0.99
        for _ in range(40):
            mid = (low + high) / 2
            controller.acceptance = AcceptanceEstimate(prior_mean=mid, prior_strength=1e6)
            low, high = (mid, high) if edge(controller) < ratio else (low, mid)
        controller.acceptance = AcceptanceEstimate(prior_mean=high, prior_strength=1e6)
        assert edge(controller) == pytest.approx(ratio, abs=1e-3)
        return controller

    def after_a_block(options: ControllerOptions = by_estimates) -> SpeculationController:
        controller = _controller(costs, 0.5, options=options)
        controller.observe(2, [2], [2], [1], 0.010 * 2, 0.030 + 0.002 * 3, 3)  # on the measured lines
        return controller

    fresh = pinned(_controller(costs, 0.5, options=by_estimates), 1.01)  # 1% faster than plain: within the 2% margin
    assert fresh.next_length() == 0 and fresh.off  # does not start
    going = pinned(after_a_block(), 1.01)
    assert going.next_length() > 0 and not going.off  # goes on
    slower = pinned(after_a_block(), 0.99)
    assert slower.next_length() == 0 and slower.off  # stops where plain decoding is expected faster
    strict = pinned(after_a_block(ControllerOptions(keep_margin=0.02, loss_budget=None)), 1.01)
    assert strict.next_length() == 0  # without the hysteresis it would stop


def test_drafting_alone_goes_on_by_its_rounds_within_the_loss_budget():
    """A co-located request alone on the target drafts from its first round and goes on by what its rounds gain or
    lose, asking for the longest block (the drafter ends it where it is unsure), where its estimates say plain decoding
    wins: until the rounds have lost `loss_budget` of the request's plain decoding (gains refunding up to that much).
    With another request on the target, the estimates decide."""
    budget = 0.03 * 0.032 * 100  # of 100 plain rounds

    def alone_and_drafting(**kwargs) -> SpeculationController:
        # Costs of its own (a plain round 32 ms, a drafted token 10 ms): a target measures a plain round every
        # `plain_every` rounds with drafts, which would fall among the rounds below.
        controller = _controller(_costs(), 0.3, shares_device=True, look_back=True, **kwargs)
        k = controller.next_length(remaining=100, behind=10)
        controller.observe(k, [k], [1], [0], 0.5, 0.034, 2, behind=10)  # the prompt's catch-up: not counted
        return controller

    def losing_round(controller: SpeculationController) -> int:  # one token in 42 ms, 10 ms over a plain round
        k = controller.next_length(remaining=100, behind=1)
        if k:
            controller.observe(k, [k], [1], [0], 0.008, 0.034, 2, behind=1)
        return k

    controller = alone_and_drafting()
    assert controller.best_length(100) == 0  # the estimates: plain decoding wins
    assert controller.excess_s == 0.0 and not controller.off
    lengths = [losing_round(controller) for _ in range(11)]
    assert lengths == [32] * 10 + [0] and controller.off  # 10 ms a round: past the budget after the tenth
    assert controller.excess_s == pytest.approx(0.100) and controller.excess_s > budget

    # Rounds that keep a draft lose too (two tokens in 76 ms, 12 ms over two plain rounds); the drafter then lacks
    # both tokens the round emitted (`behind` 2), and such rounds count as well.
    keeping = alone_and_drafting()
    lengths = []
    for _ in range(10):
        lengths.append(keeping.next_length(remaining=100, behind=2))
        if lengths[-1]:
            keeping.observe(lengths[-1], [lengths[-1]], [2], [1], 0.016, 0.060, 3, behind=2)
    assert lengths == [32] * 9 + [0] and keeping.excess_s == pytest.approx(0.108)

    refunded = alone_and_drafting()
    k = refunded.next_length(remaining=100, behind=1)
    refunded.observe(k, [k], [19], [19], 0.19, 0.11, 20, behind=1)  # 20 tokens in 0.3 s, 0.64 s of plain rounds
    assert refunded.excess_s == pytest.approx(-budget)  # gains bank no more than the budget
    assert [losing_round(refunded) for _ in range(21)] == [32] * 20 + [0]  # twice the budget to lose

    loaded = alone_and_drafting(load=lambda: 1)
    assert losing_round(loaded) == 0 and loaded.off  # under load, the estimates decide


def test_look_backs_and_probes_count_against_the_loss_budget_drafting_spends():
    """What a draft model's request loses to speculation is bounded by one loss budget: a look-back's wait counts
    with the drafting rounds' losses, and once they have cost the budget no look-back or probe follows. Each
    look-back was within its own budget, so a request that had lost its budget drafting looked back and drafted
    again (a pinned overlapped code edit: 0.89x of plain greedy)."""
    length = 100
    plain_s = 0.032  # `_costs()`: a round without drafts
    budget = 0.03 * plain_s * length
    wait, loss = 0.05, 0.010  # a look-back's catch-up; a drafting round's seconds over plain decoding of its token

    def run(controller: SpeculationController) -> tuple[list[str], list[float]]:
        """The request, round by round: what each round was, and the ledger after it."""
        kinds, ledger, behind = [], [], 5
        for done in range(length):
            k = controller.next_length(remaining=length - done, behind=behind)
            if controller.looking_back:
                kinds.append("look-back")
                controller.observe(0, [0], [0], [0], wait, plain_s, 1, behind=behind, hindsight=(behind,) * 3)
            elif k:
                kinds.append("draft")
                controller.observe(k, [k], [1], [0], loss, plain_s, 2, behind=behind)
            else:
                kinds.append("plain")
                controller.observe(0, [0], [0], [0], 0.0, plain_s, 1)
            behind = 1 if kinds[-1] != "plain" else behind + 1
            ledger.append(controller.excess_s)
        return kinds, ledger

    # A remote draft whose estimates say drafting pays (a look-back resumes it) and whose rounds lose: after the first
    # look-back's wait, its rounds may lose what is left of the budget, and nothing follows them.
    kinds, ledger = run(_controller(_costs(), 0.9, look_back=True))
    assert kinds[:5] == ["plain"] * 4 + ["look-back"] and ledger[4] == pytest.approx(wait)
    over = next(i for i, x in enumerate(ledger) if x > budget)
    assert kinds[5 : over + 1] == ["draft"] * (math.floor((budget - wait) / loss) + 1)
    assert kinds[over + 1 :] == ["plain"] * (length - over - 1)  # no look-back, probe or block once it is spent
    assert ledger[-1] <= budget + loss + 1e-9  # at most one round's loss past the budget

    # Without a loss budget, look-backs go on resuming drafting for as long as their own budget allows.
    unbounded = run(_controller(_costs(), 0.9, look_back=True, options=ControllerOptions(loss_budget=None)))[0]
    assert unbounded.count("look-back") > 2 and unbounded.count("draft") > kinds.count("draft")
    # Nor does a `probe_budget` of 0 (no bound of their own) lift the loss budget's.
    free = run(_controller(_costs(), 0.9, look_back=True, options=ControllerOptions(probe_budget=0.0)))
    assert free == (kinds, ledger)


@pytest.mark.parametrize("probe_budget", [0.05, 0.0])
def test_probes_count_against_the_loss_budget_too(probe_budget):
    """A request whose drafter reports no hindsight (no look-backs) tries drafting again by probing: each probe's
    seconds over plain decoding of its tokens count in the same ledger as the drafting rounds' losses, and no probe
    takes the request past its budget, with `probe_budget` 0 (no bound of its own) too."""
    length = 400
    plain_s = 0.032  # `_costs()`: a round without drafts
    budget = 0.03 * plain_s * length

    def probes(loss_budget: float | None) -> list[tuple[int, float]]:
        """Where the request probed, and the ledger after each probe."""
        options = ControllerOptions(off_rounds=2, probe_budget=probe_budget, loss_budget=loss_budget)
        controller = _controller(_costs(draft=(0.005, 0.030)), 0.3, options=options)  # drafting never pays
        tried = []
        for done in range(length):
            probing = controller.off
            k = controller.next_length(remaining=length - done, behind=1)
            # A probe drafts at the draft's price and keeps nothing: ~0.16 s over a plain round's token.
            controller.observe(k, [k], [k], [0], 0.005 + 0.030 * k if k else 0.0, plain_s, 1 + k, behind=1)
            if k:
                assert probing
                tried.append((done, controller.excess_s))
        return tried

    bounded, unbounded = probes(0.03), probes(None)
    loss = 0.005 + 0.030 * ControllerOptions().probe_length  # one probe: its draft (its verify ran at a plain round's)
    assert [spent for _, spent in bounded] == pytest.approx([loss * (i + 1) for i in range(len(bounded))])
    assert bounded[-1][1] <= budget < bounded[-1][1] + loss  # no probe past the budget, and the next one would be
    assert [at for at, _ in bounded] == [at for at, _ in unbounded[: len(bounded)]]  # the same probes until then
    assert len(unbounded) > len(bounded)  # which only the loss budget stopped


def test_the_debug_line_names_the_best_block_even_when_plain_decoding_wins(caplog):
    """`--log-level DEBUG` says why a request drafted or not: the best block's length and expected rate beside plain
    decoding's, not the bar a block had to clear (which read as a block beating plain decoding)."""
    costs = _costs(draft=(0.0, 0.050))  # a draft dearer than a verify forward: no block pays
    controller = _controller(costs, 0.5)
    with caplog.at_level("DEBUG", logger="specwire.generation.speculation.controller"):
        assert controller.best_length(remaining=100) == 0
    line = caplog.records[-1].getMessage()
    plain = float(line.split("plain ")[1].split(" tok/s")[0])
    best_k, best_rate = line.split("best k=")[1].split(" tok/s")[0].split()
    assert line.startswith("draft_model: k=0 ") and int(best_k) >= 1 and float(best_rate) < plain, line
    # And what that rate is made of: the block's expected tokens over its draft, verify and load time.
    tokens, spent = line.split("tok/s: ")[1].split(" tokens in ")
    draft_ms, verify_ms, load_ms = (float(part.split()[0]) for part in spent.split(" + ")[:3])
    assert draft_ms > 0 and verify_ms > 0 and load_ms == 0, line
    assert float(tokens) * 1e3 / (draft_ms + verify_ms + load_ms) == pytest.approx(float(best_rate), rel=0.05), line


@pytest.mark.parametrize("proposer", ["draft_model", "prompt_lookup"])
def test_a_decision_rates_every_block_from_one_pass_exactly_as_block_by_block(proposer):
    """`best_length` computes the kept and proposed drafts of every block length in one pass (`_sums`); each rate is
    the one that block alone computes, to the bit."""
    costs = _costs(proposer=proposer)
    controller = SpeculationController(costs, proposer, rows=2, load=lambda: 3.0)
    for k, drafted, kept in ((6, [4, 6], [2, 6]), (9, [9, 3], [9, 1]), (4, [1, 4], [0, 3])):
        controller.observe(k, [k, k], drafted, kept, 0.01 * sum(drafted), 0.05, sum(drafted) + 2, hindsight=(5, 4, 3))
    prices = costs.prices(proposer)
    sums = controller._sums(32)
    for k in range(33):
        assert controller.rate(k, prices, 3.0, sums) == controller.rate(k, prices, 3.0)
