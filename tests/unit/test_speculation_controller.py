"""The adaptive speculation controller's cost model and decisions, on synthetic costs (no model)."""

from __future__ import annotations

import pytest

from specwire.generation.speculation.controller import (
    AcceptanceEstimate,
    ControllerOptions,
    LinearCost,
    SharedCosts,
    SpeculationController,
    expected_tokens,
)


def _costs(verify=(0.030, 0.002), draft=(0.0, 0.010), proposer="draft_model", samples=20) -> SharedCosts:
    """Costs measured `samples` times at several sizes, exactly on the given lines."""
    costs = SharedCosts()
    for i in range(samples):
        tokens = 1 + i % 8
        costs.observe_verify(tokens, verify[0] + verify[1] * tokens)
        k = 1 + i % 6
        costs.observe_draft(proposer, k, draft[0] + draft[1] * k)
    return costs


def _controller(costs: SharedCosts, acceptance: float, **kwargs) -> SpeculationController:
    estimate = AcceptanceEstimate(prior_mean=acceptance, prior_strength=1e6)  # pinned
    return SpeculationController(costs, "draft_model", acceptance=estimate, **kwargs)


@pytest.mark.parametrize(
    "a,k,expected", [(0.0, 0, 1.0), (0.0, 5, 1.0), (0.5, 1, 1.5), (0.5, 2, 1.75), (1.0, 4, 5.0), (0.9, 0, 1.0)]
)
def test_expected_tokens(a, k, expected):
    assert expected_tokens(a, k) == pytest.approx(expected)


def test_linear_cost_recovers_a_line_and_keeps_the_prior_with_one_size():
    cost = LinearCost()
    for x in (1, 3, 5, 9, 2, 7):
        cost.observe(x, 0.02 + 0.004 * x)
    intercept, slope = cost.fit(0.05)
    assert intercept == pytest.approx(0.02, rel=0.05) and slope == pytest.approx(0.004, rel=0.1)
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
    estimate.observe(0, 0)  # nothing drafted: no evidence
    assert estimate.mean < 0.2


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


def test_time_off_then_probes_that_back_off_then_resume():
    costs = _costs(draft=(0.005, 0.030))
    options = ControllerOptions(off_rounds=2, max_off_rounds=8, probe_length=2)
    controller = SpeculationController(costs, "draft_model", options=options)

    def round_with(acceptance_accepted: int) -> int:
        k = controller.next_length()
        drafted = [k] if k else [0]
        controller.observe(k, drafted, [min(acceptance_accepted, k)], 0.03 * k, 0.032, 1 + k)
        return k

    lengths = [round_with(0) for _ in range(30)]
    # Plain decoding at once (the draft is too slow), probes of 2, each followed by twice the time off (to 8).
    assert lengths[:3] == [0, 0, 2]
    probes = [i for i, k in enumerate(lengths) if k]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:], strict=False)]
    assert all(k == 2 for k in (lengths[i] for i in probes))
    assert gaps[:3] == [4, 8, 8]
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
    controller.observe(3, [3], [3], 5.0, 0.03, 4)  # the first block: the draft's prefill
    assert costs._drafts == {}
    controller.next_length()
    controller.observe(3, [3], [3], 0.03, 0.03, 4)
    assert costs.draft("draft_model", 0.03) == pytest.approx((0.0, 0.01), abs=1e-6)


def test_options_are_checked():
    with pytest.raises(ValueError, match="max_length"):
        ControllerOptions(max_length=0)
    with pytest.raises(ValueError, match="max_off_rounds"):
        ControllerOptions(off_rounds=8, max_off_rounds=4)
    with pytest.raises(ValueError, match="prior_mean"):
        AcceptanceEstimate(prior_mean=1.0)
