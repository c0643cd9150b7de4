"""Numerical clean-up: replacing inf/nan, and renormalising to log-probabilities."""

from __future__ import annotations

import torch


class InfNanRemoveLogitsProcessor:
    r"""Replaces NaN by 0 and +/-inf by the dtype's largest / smallest finite value, so sampling works."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        info = torch.finfo(scores.dtype)
        cleaned = torch.where(torch.isnan(scores), 0.0, scores)
        cleaned = torch.where(scores == float("inf"), info.max, cleaned)
        return torch.where(scores == -float("inf"), info.min, cleaned)


class LogitNormalization:
    r"""`log_softmax` over the vocabulary; the factory always puts it last (`renormalize_logits=True`)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.log_softmax(dim=-1)
