"""Watermark detection (`specwire.generation.watermark_detection`) against transformers' own computation.

Green list: the numbers of transformers' `WatermarkDetector` on the same ids. SynthID: the masked mean of
transformers' `SynthIDTextWatermarkLogitsProcessor.compute_g_values` (its detector needs a trained model);
text generated with a watermark scores as watermarked, text generated without it does not.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from specwire.deadline import CALLER_DEADLINE, set_caller_deadline
from specwire.errors import DeadlineExceeded
from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.watermark_detection import detect_watermark

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

GREEN = [
    {"greenlist_ratio": 0.25, "bias": 6.0, "seeding_scheme": "lefthash"},
    {"greenlist_ratio": 0.5, "bias": 6.0, "seeding_scheme": "selfhash", "context_width": 2, "hashing_key": 7},
]
SYNTHID = {"ngram_len": 3, "keys": [654, 400, 836, 123, 340]}


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _generate(ref, watermark, seed, **kwargs):
    torch.manual_seed(seed)
    prompt = torch.randint(3, 300, (4, 5), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = ref.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=40,
            do_sample=True,
            watermarking_config=watermark,
            **kwargs,
        )
    return out[:, prompt.shape[1] :]


@pytest.mark.parametrize("config", GREEN, ids=["lefthash", "selfhash"])
@pytest.mark.parametrize("ignore_repeated_ngrams", [False, True])
def test_green_list_scores_equal_transformers_detector(ref, config, ignore_repeated_ngrams):
    marked = _generate(ref, transformers.WatermarkingConfig(**config), 1)
    plain = _generate(ref, None, 2)
    detector = transformers.WatermarkDetector(
        ref.config, "cpu", transformers.WatermarkingConfig(**config), ignore_repeated_ngrams=ignore_repeated_ngrams
    )
    for ids, expected in ((marked, True), (plain, False)):
        theirs = detector(ids, z_threshold=2.5, return_dict=True)
        ours = detect_watermark(
            ids.tolist(),
            config,
            vocab_size=ref.config.vocab_size,
            bos_token_id=ref.config.bos_token_id,
            z_threshold=2.5,
            ignore_repeated_ngrams=ignore_repeated_ngrams,
        )
        for row, score in enumerate(ours):
            assert score.num_tokens_scored == theirs.num_tokens_scored[row]
            assert score.num_green_tokens == theirs.num_green_tokens[row]
            assert score.green_fraction == pytest.approx(theirs.green_fraction[row], abs=1e-12)
            assert score.z_score == pytest.approx(theirs.z_score[row], abs=1e-6)
            assert score.p_value == pytest.approx(theirs.p_value[row], abs=1e-6)
            assert score.confidence == pytest.approx(theirs.confidence[row], abs=1e-6)
            assert score.prediction == bool(theirs.prediction[row])
        # A strong watermark is found in every watermarked row and in no plain one.
        assert [s.prediction for s in ours] == [expected] * len(ours)


def test_green_list_drops_a_leading_bos(ref):
    config = GREEN[0]
    ids = _generate(ref, transformers.WatermarkingConfig(**config), 3)[0].tolist()
    bos = ref.config.bos_token_id
    with_bos, without = detect_watermark([[bos, *ids], ids], config, vocab_size=ref.config.vocab_size, bos_token_id=bos)
    assert with_bos == without


def _transformers_mean(processor, ids, eos):
    g = processor.compute_g_values(ids)
    mask = (
        processor.compute_context_repetition_mask(ids)
        * processor.compute_eos_token_mask(ids, eos)[:, processor.ngram_len - 1 :]
    )
    return ((g * mask[..., None]).sum(dim=(1, 2)) / (g.shape[2] * mask.sum(dim=1))).tolist()


def test_synthid_mean_score_is_the_masked_mean_g_value_and_separates_watermarked_text(ref):
    wm = transformers.SynthIDTextWatermarkingConfig(**SYNTHID)
    processor = wm.construct_processor(ref.config.vocab_size, torch.device("cpu"))
    marked, plain = _generate(ref, wm, 4), _generate(ref, None, 5)
    eos = 9  # a token the tiny model produces, so the EOS mask cuts some rows
    means = {}
    for name, ids in (("marked", marked), ("plain", plain)):
        ours = detect_watermark(ids.tolist(), SYNTHID, vocab_size=ref.config.vocab_size, eos_token_id=eos)
        expected = _transformers_mean(processor, ids, eos)
        for score, value in zip(ours, expected, strict=True):
            assert (math.isnan(score.mean_score) and math.isnan(value)) or score.mean_score == pytest.approx(value)
            assert score.z_score is None and score.prediction is None
        means[name] = [s.mean_score for s in ours if not math.isnan(s.mean_score)]
    assert sum(means["marked"]) / len(means["marked"]) > sum(means["plain"]) / len(means["plain"]) + 0.05


@pytest.mark.parametrize(
    ("rows", "config", "field"),
    [
        ([[5]], GREEN[0], "rows[0]"),  # one token: nothing left to score after its context
        ([[5, 6, 7], []], GREEN[0], "rows[1]"),
        ([[5, 6, 10**6]], GREEN[0], "rows[0].token_ids"),
        ([[5, -1, 7]], SYNTHID, "rows[0].token_ids"),
        ([[5, 6]], SYNTHID, "rows[0]"),
    ],
)
def test_rows_that_cannot_be_scored_are_refused_with_the_field(rows, config, field):
    with pytest.raises(InvalidGenerationArgument) as caught:
        detect_watermark(rows, config, vocab_size=378, bos_token_id=1)
    assert [p.field for p in caught.value.violations] == [field]


def test_scoring_stops_when_the_callers_deadline_has_passed():
    """Green lists cost one vocabulary permutation per window: a caller that stopped waiting stops it."""
    rows = [list(range(3, 200))]
    token = set_caller_deadline(0.0)
    try:
        with pytest.raises(DeadlineExceeded, match="deadline passed while scoring"):
            detect_watermark(rows, GREEN[0], vocab_size=512, bos_token_id=None, eos_token_id=None, device="cpu")
    finally:
        CALLER_DEADLINE.reset(token)
    assert detect_watermark(rows, GREEN[0], vocab_size=512, bos_token_id=None, eos_token_id=None, device="cpu")
