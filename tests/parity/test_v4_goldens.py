"""Parity of the v4 decoding modes with transformers 4.55.4, against committed golden outputs.

transformers 5 moved group beam search (and contrastive search, DoLa, constrained beam search) out of
`generate()`; 4.55.4 is the last release that ran them in core. `scripts/make_v4_goldens.py` ran its
`generate()` on the tiny Llama these tests build (same config and seed) and wrote
tests/parity/goldens/v4_<mode>.json; this suite never installs the old release. Token ids, beam
indices must be equal; sequence scores and the processed scores (the best entries of every step and
row, as the goldens keep them) within 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specwire.generation.config import GenerationConfig, merge
from specwire.generation.loops.generate import generate, iter_generate

GOLDENS = Path(__file__).parent / "goldens"
ATOL = 1e-4


def _golden(mode: str) -> dict:
    return json.loads((GOLDENS / f"v4_{mode}.json").read_text())


GROUP_BEAM = _golden("group_beam_search")
CONTRASTIVE = _golden("contrastive_search")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny Llama through our loader; the goldens were computed on the same weights."""
    from specwire.models import load_model

    return load_model(str(tiny_model_dir), progress=False)


def test_goldens_were_made_on_the_tiny_model_the_tests_build(tiny):
    with torch.no_grad():
        checksum = float(sum(p.double().abs().sum() for p in tiny.model.parameters()))
    assert checksum == pytest.approx(GROUP_BEAM["weights_checksum"], rel=1e-9), (
        "tests/tiny_models.py builds other weights than the goldens were made on: run scripts/make_v4_goldens.py"
    )
    assert GROUP_BEAM["transformers"] == "4.55.4"


def run_case(lm, golden: dict, case: dict):
    """specwire's `generate()` on the case's prompt and resolved kwargs, with the outputs the goldens keep."""
    prompt = golden["prompts"][case["prompt"]]
    request = GenerationConfig.from_dict(
        {**case["resolved_kwargs"], "return_dict_in_generate": True, "output_scores": True}
    )
    config = merge(request, lm.generation_config)
    input_ids, mask = torch.tensor(prompt["input_ids"]), torch.tensor(prompt["attention_mask"])
    return generate(lm.model, input_ids, mask, config=config)


def assert_matches(ours, expected: dict) -> None:
    """Ids and beam indices equal; sequence scores and processed scores within `ATOL`."""
    assert ours.sequences.tolist() == expected["sequences"]
    if "beam_indices" in expected:
        assert ours.beam_indices is not None
        assert ours.beam_indices.tolist() == expected["beam_indices"]
    if "sequences_scores" in expected:
        assert ours.sequences_scores is not None
        torch.testing.assert_close(ours.sequences_scores, torch.tensor(expected["sequences_scores"]), atol=ATOL, rtol=0)
    assert ours.scores is not None and len(ours.scores) == len(expected["scores"])
    for step, (mine, theirs) in enumerate(zip(ours.scores, expected["scores"], strict=True)):
        assert mine.shape[0] == len(theirs), f"step {step}: {mine.shape[0]} rows, expected {len(theirs)}"
        for row, summary in enumerate(theirs):
            values = mine[row].float()
            # The golden entries, read at the golden ids (robust to ties in the order of equal values).
            at_ids = values[torch.tensor(summary["ids"])]
            torch.testing.assert_close(at_ids, torch.tensor(summary["values"]), atol=ATOL, rtol=0)
            best = torch.topk(values, len(summary["values"])).values
            torch.testing.assert_close(best, torch.tensor(summary["values"]), atol=ATOL, rtol=0)
            assert int(torch.isfinite(values).sum()) == summary["finite"], f"step {step} row {row}"


@pytest.mark.parametrize("case", GROUP_BEAM["cases"], ids=[c["name"] for c in GROUP_BEAM["cases"]])
def test_group_beam_search_matches_transformers_4_55(tiny, case):
    ours = run_case(tiny, GROUP_BEAM, case)
    assert_matches(ours, case["expected"])
    returned = len(case["expected"]["sequences"])
    assert len(ours.finish_reasons) == returned


def test_group_beam_search_finish_reasons(tiny):
    """Hypotheses that ended on an EOS id say "eos" (4.55.4 returns them with `eos_token_id[0]` after their
    tokens); those the length limit cut, which hold no EOS id, say "length"."""
    case = next(c for c in GROUP_BEAM["cases"] if c["name"] == "one_beam_per_group")
    ours = run_case(tiny, GROUP_BEAM, case)
    eos = case["resolved_kwargs"]["eos_token_id"]
    prompt_length = len(GROUP_BEAM["prompts"]["single"]["input_ids"][0])
    expected = ["eos" if eos in row[prompt_length:] else "length" for row in ours.sequences.tolist()]
    assert ours.finish_reasons == expected
    assert set(expected) == {"eos", "length"}


def test_diversity_penalty_changes_the_groups(tiny):
    """A (near) zero penalty lets the second group repeat the first group's beams; 1.0 does not."""
    case = next(c for c in GROUP_BEAM["cases"] if c["name"] == "all_returned")
    ours = run_case(tiny, GROUP_BEAM, case)
    weak_kwargs = {**case["resolved_kwargs"], "diversity_penalty": 1e-6}
    weak = run_case(tiny, GROUP_BEAM, {**case, "resolved_kwargs": weak_kwargs})
    assert ours.sequences.tolist() != weak.sequences.tolist()


@pytest.mark.parametrize("case", CONTRASTIVE["cases"], ids=[c["name"] for c in CONTRASTIVE["cases"]])
def test_contrastive_search_matches_transformers_4_55(tiny, case):
    ours = run_case(tiny, CONTRASTIVE, case)
    assert_matches(ours, case["expected"])


def test_contrastive_search_streams_the_tokens_it_returns(tiny):
    """One token per row per step, as greedy search streams; the final event closes every row."""
    case = next(c for c in CONTRASTIVE["cases"] if c["name"] == "batch_left_padding")
    prompt = CONTRASTIVE["prompts"]["batch"]
    config = merge(GenerationConfig.from_dict(case["resolved_kwargs"]), tiny.generation_config)
    steps = iter_generate(
        tiny.model, torch.tensor(prompt["input_ids"]), torch.tensor(prompt["attention_mask"]), config=config
    )
    streamed = [[] for _ in prompt["input_ids"]]
    reasons = [None] * len(streamed)
    while True:
        try:
            event = next(steps)
        except StopIteration as stop:
            result = stop.value
            break
        for row, tokens in enumerate(event.tokens):
            streamed[row] += tokens
        for row, reason in enumerate(event.finish_reasons):
            reasons[row] = reason or reasons[row]
    prompt_length = len(prompt["input_ids"][0])
    for row, sequence in enumerate(case["expected"]["sequences"]):
        assert sequence[prompt_length : prompt_length + len(streamed[row])] == streamed[row]
    assert reasons == result.finish_reasons and "eos" in reasons


def test_penalty_alpha_changes_the_tokens(tiny):
    """Without the degeneration penalty contrastive search is greedy search; with it, it is not."""
    case = next(c for c in CONTRASTIVE["cases"] if c["name"] == "alpha_0_6_top_4")
    ours = run_case(tiny, CONTRASTIVE, case)
    greedy_kwargs = {k: v for k, v in case["resolved_kwargs"].items() if k not in ("penalty_alpha", "top_k")}
    greedy = run_case(tiny, CONTRASTIVE, {**case, "resolved_kwargs": greedy_kwargs})
    assert ours.sequences.tolist() != greedy.sequences.tolist()


def test_contrastive_search_is_never_speculated(tiny):
    """A target with a drafter runs contrastive search plainly: speculation would change its tokens."""
    from specwire.generation.loops.speculative import speculation_blocker
    from specwire.generation.planning import prepare_generation

    config = merge(GenerationConfig(penalty_alpha=0.6, top_k=4, max_new_tokens=4), tiny.generation_config)
    plan = prepare_generation(tiny.model, torch.tensor([[5, 6, 7]]), None, config=config)
    assert "contrastive_search" in speculation_blocker(plan)


DOLA = _golden("dola_generation")


@pytest.mark.parametrize("case", DOLA["cases"], ids=[c["name"] for c in DOLA["cases"]])
def test_dola_matches_transformers_4_55(tiny, case):
    ours = run_case(tiny, DOLA, case)
    assert_matches(ours, case["expected"])


CONSTRAINED = _golden("constrained_beam_search")


@pytest.mark.parametrize("case", CONSTRAINED["cases"], ids=[c["name"] for c in CONSTRAINED["cases"]])
def test_constrained_beam_search_matches_transformers_4_55(tiny, case):
    ours = run_case(tiny, CONSTRAINED, case)
    assert_matches(ours, case["expected"])
    assert len(ours.finish_reasons) == len(case["expected"]["sequences"])
    # 4.55.4 returns none when its first hypothesis completes no constraint (added by the fallback).
    assert (ours.beam_indices is None) == ("beam_indices" not in case["expected"])


def _contains(row: list[int], phrase: list[int]) -> bool:
    return any(row[i : i + len(phrase)] == phrase for i in range(len(row)))


def test_constrained_beam_search_forces_its_words(tiny):
    """The returned hypothesis holds the forced phrase, which plain beam search does not produce: the test
    fails if the constraints are dropped."""
    case = next(c for c in CONSTRAINED["cases"] if c["name"] == "phrasal")
    prompt_length = len(CONSTRAINED["prompts"]["single"]["input_ids"][0])
    (phrase,) = case["resolved_kwargs"]["force_words_ids"]
    ours = run_case(tiny, CONSTRAINED, case)
    assert all(_contains(row[prompt_length:], phrase) for row in ours.sequences.tolist())
    plain_kwargs = {k: v for k, v in case["resolved_kwargs"].items() if k != "force_words_ids"}
    plain = run_case(tiny, CONSTRAINED, {**case, "resolved_kwargs": plain_kwargs})
    assert not any(_contains(row[prompt_length:], phrase) for row in plain.sequences.tolist())


def test_constraints_as_plain_data_equal_force_words_ids(tiny):
    """`constraints` ({'phrasal': ...} / {'disjunctive': ...}) build the same constraints as `force_words_ids`."""
    case = next(c for c in CONSTRAINED["cases"] if c["name"] == "num_return_sequences")
    phrase, choices = case["resolved_kwargs"]["force_words_ids"]
    kwargs = {k: v for k, v in case["resolved_kwargs"].items() if k != "force_words_ids"}
    kwargs["constraints"] = [{"phrasal": phrase}, {"disjunctive": choices}]
    ours = run_case(tiny, CONSTRAINED, {**case, "resolved_kwargs": kwargs})
    assert_matches(ours, case["expected"])
