"""Scoring token sequences for a watermark: transformers' green-list detector, and SynthID's mean g-value.

Green list (`WatermarkingConfig`): `WatermarkDetector`'s computation, row by row. A leading
`bos_token_id` is dropped; every window of `n = context_width + 1` tokens (`context_width` with
`"selfhash"`, whose window includes the scored token) scores its last token as green when it lies in
the green list its context seeds; `z = (green - ratio * scored) / sqrt(scored * ratio * (1 - ratio))`,
`p = 0.5 * erfc(z / sqrt(2))` (one-sided), `prediction = z > z_threshold`, `confidence = 1 - p`.
With `ignore_repeated_ngrams` each distinct window counts once. transformers scores a rectangular
batch and refuses one whose rows disagree on the leading BOS; rows here are scored one by one, so a
row's numbers are those of `WatermarkDetector` on that row alone.

SynthID (`SynthIDTextWatermarkingConfig`): transformers' `SynthIDTextWatermarkDetector` feeds the
g-values to a trained Bayesian classifier, which a service does not have. The score here is the
unweighted mean g-value over the row's scored n-grams: `compute_g_values` gives `[ngrams, depth]`
coin flips (one n-gram per token from the `ngram_len`-th on), the mask keeps n-grams whose context was
not seen before in the row (`compute_context_repetition_mask`) and that end before the row's first EOS
(`compute_eos_token_mask`), and `mean_score = sum(g * mask) / (depth * sum(mask))`. Unwatermarked text
scores about 0.5; watermarked text more (transformers' `expected_mean_g_value` gives the uniform-model
expectation for one layer, 0.5 + 0.25 * (1 - 1 / vocab_size)). It is a statistic, not a calibrated
probability.

Both need what generation used: the same config, the model's vocabulary size, and the same device type
(the green lists and the coin-flip table are drawn from device-specific generators).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specwire.deadline import remaining
from specwire.errors import DeadlineExceeded, InvalidArgument
from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.processors.factory import watermark_processor
from specwire.generation.processors.synthid import SynthIDTextWatermarkLogitsProcessor
from specwire.generation.processors.watermark import WatermarkLogitsProcessor

__all__ = ["WatermarkScore", "detect_watermark"]


@dataclass(frozen=True)
class WatermarkScore:
    """One row's detection result (green-list fields are `None` for SynthID, `mean_score` the reverse).

    Args:
        num_tokens_scored (`int`): tokens (n-gram windows) scored; SynthID: n-grams left after the masks.
        num_green_tokens (`int`, *optional*): scored tokens in their green list.
        green_fraction (`float`, *optional*): `num_green_tokens / num_tokens_scored`.
        z_score (`float`, *optional*): standard deviations above the green count expected without watermark.
        p_value (`float`, *optional*): one-sided p-value of `z_score` under the no-watermark hypothesis.
        prediction (`bool`, *optional*): `z_score > z_threshold`.
        confidence (`float`, *optional*): `1 - p_value`.
        mean_score (`float`, *optional*): SynthID mean g-value (NaN when no n-gram is left to score).
    """

    num_tokens_scored: int
    num_green_tokens: int | None = None
    green_fraction: float | None = None
    z_score: float | None = None
    p_value: float | None = None
    prediction: bool | None = None
    confidence: float | None = None
    mean_score: float | None = None


def detect_watermark(
    rows: Sequence[Sequence[int]],
    watermarking_config: Mapping[str, Any],
    *,
    vocab_size: int,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    device: str | torch.device = "cpu",
    z_threshold: float = 3.0,
    ignore_repeated_ngrams: bool = False,
) -> list[WatermarkScore]:
    """Score each row for the watermark `watermarking_config` describes (see the module docstring).

    Args:
        rows (`Sequence[Sequence[int]]`):
            Token ids, one sequence per row (ideally the generated part only, as transformers advises).
        watermarking_config (`Mapping[str, Any]`):
            The generation's `watermarking_config` dict (green-list or SynthID), already validated.
        vocab_size (`int`):
            The model's vocabulary size; ids must lie below it.
        bos_token_id (`int`, *optional*):
            Dropped from the start of a row (green list only, as `WatermarkDetector` does).
        eos_token_id (`int`, *optional*):
            SynthID only: n-grams from the first EOS on are not scored.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`):
            The device type generation ran on.
        z_threshold (`float`, *optional*, defaults to 3.0):
            Green list: `prediction` is `z_score > z_threshold`.
        ignore_repeated_ngrams (`bool`, *optional*, defaults to `False`):
            Green list: count each distinct window once.

    Returns:
        `list[WatermarkScore]`: one per row.

    Raises:
        `InvalidGenerationArgument`: a row is empty, too short to score, or holds ids outside the vocabulary
            (field `rows[i]`).
    """
    for i, row in enumerate(rows):
        bad = next((t for t in row if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidGenerationArgument.for_field(
                f"rows[{i}].token_ids", bad, f"token ids must lie in [0, {vocab_size}) (the model's vocabulary)"
            )
    processor = watermark_processor(dict(watermarking_config), vocab_size, device)
    if isinstance(processor, SynthIDTextWatermarkLogitsProcessor):
        return [_synthid_row(i, row, processor, eos_token_id) for i, row in enumerate(rows)]
    ratio = float(watermarking_config.get("greenlist_ratio", 0.25))
    # Whether a window's last token is green depends on the window only: shared by the rows, so each
    # distinct window costs one `randperm(vocab_size)` per request (transformers keeps an LRU of 128).
    green_of: dict[tuple[int, ...], bool] = {}
    return [
        _green_list_row(i, row, processor, ratio, bos_token_id, device, z_threshold, ignore_repeated_ngrams, green_of)
        for i, row in enumerate(rows)
    ]


def _too_short(i: int, row: Sequence[int], need: int, why: str) -> InvalidArgument:
    return InvalidGenerationArgument.for_field(
        f"rows[{i}]",
        f"{len(row)} tokens",
        f"at least {need} tokens are needed to score one ({why}): send a longer text",
    )


def _green_list_row(
    i: int,
    row: Sequence[int],
    processor: WatermarkLogitsProcessor,
    ratio: float,
    bos_token_id: int | None,
    device: str | torch.device,
    z_threshold: float,
    ignore_repeated_ngrams: bool,
    green_of: dict[tuple[int, ...], bool],
) -> WatermarkScore:
    ids = list(row[1:]) if row and bos_token_id is not None and row[0] == bos_token_id else list(row)
    width = processor.context_width
    if len(ids) - width < 1:
        raise _too_short(i, row, width + 1, f"context_width={width}, after a leading BOS is dropped")
    selfhash = processor.seeding_scheme == "selfhash"
    n = width + 1 - int(selfhash)
    counts = collections.Counter(tuple(ids[j : j + n]) for j in range(len(ids) - n + 1))
    for ngram in counts:
        if ngram in green_of:
            continue
        # One green list per distinct window (a randperm of the vocabulary): a long request can take
        # minutes, so it stops when its caller stops waiting (the pool thread runs in the call's context).
        if remaining() == 0.0:
            raise DeadlineExceeded(f"rows[{i}]: the caller's deadline passed while scoring the watermark")
        prefix = torch.tensor(ngram if selfhash else ngram[:-1], dtype=torch.long, device=device)
        green_of[ngram] = bool((processor.greenlist_ids(prefix) == ngram[-1]).any())
    if ignore_repeated_ngrams:
        scored, green = len(counts), sum(green_of[g] for g in counts)
    else:
        scored, green = sum(counts.values()), sum(freq * green_of[g] for g, freq in counts.items())
    z = (green - ratio * scored) / math.sqrt(scored * ratio * (1 - ratio))
    # The tail as transformers computes it: torch's float64 erfc.
    p = float(0.5 * torch.special.erfc(torch.tensor(z / math.sqrt(2), dtype=torch.float64)))
    return WatermarkScore(
        num_tokens_scored=scored,
        num_green_tokens=green,
        green_fraction=green / scored,
        z_score=z,
        p_value=p,
        prediction=z > z_threshold,
        confidence=1 - p,
    )


def _synthid_row(
    i: int, row: Sequence[int], processor: SynthIDTextWatermarkLogitsProcessor, eos_token_id: int | None
) -> WatermarkScore:
    n = processor.ngram_len
    if len(row) < n:
        raise _too_short(i, row, n, f"ngram_len={n}")
    ids = torch.tensor([list(row)], dtype=torch.long, device=processor.device)  # [1, len]
    g_values = processor.compute_g_values(ids)  # [1, ngrams, depth]
    mask = (
        processor.compute_context_repetition_mask(ids) & processor.compute_eos_token_mask(ids, eos_token_id)[:, n - 1 :]
    )  # [1, ngrams]
    scored = int(mask.sum())
    depth = g_values.shape[2]
    mean = float((g_values * mask[..., None]).sum()) / (depth * scored) if scored else math.nan
    return WatermarkScore(num_tokens_scored=scored, mean_score=mean)
