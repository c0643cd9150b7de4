"""Per-row finish reasons: the stopping criteria's codes as the loops record and report them."""

from __future__ import annotations

from typing import Any

import torch

from specwire.generation.stopping import StoppingCriteriaList, build_stopping_criteria
from specwire.vocabulary import FINISH_REASON_NAMES, FinishReason

__all__ = ["StopCodes", "reason_names"]


def reason_names() -> dict[int, str]:
    """`FinishReason` code -> the finish-reason string results and events carry."""
    return dict(FINISH_REASON_NAMES)


class StopCodes:
    """Per-row finish reason codes from the stopping criteria, with EOS reported over length.

    `StoppingCriteriaList.finish_reasons` names the first criterion in list order, and the max-length
    criterion comes first; a row whose last token is an EOS id at the length limit is reported as "eos"
    (the model chose to stop), as TGI and vLLM report it. Which rows stop is unchanged.

    Args:
        criteria (`StoppingCriteriaList`):
            The request's stopping criteria.
        eos_token_ids (`list[int]`, *optional*):
            The EOS ids, or `None`.
        device (`torch.device`):
            The device of the sequences the codes are computed for.
    """

    def __init__(self, criteria: StoppingCriteriaList, eos_token_ids: list[int] | None, device: torch.device):
        self.criteria = criteria
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device) if eos_token_ids else None
        self._eos_ids = frozenset(eos_token_ids or ())
        # A length limit and EOS ids (a request's usual criteria) decide from the rows' length and last tokens:
        # in Python, not the dozen small tensor ops of `finish_reasons`, which were the costliest part of a
        # decoding step's own work (under load, every request's holds up the next packed forward).
        self.by_last_token = criteria.decides_by_last_token

    @classmethod
    def for_plan(
        cls, plan: Any, config: Any, tokenizer: Any, max_position_embeddings: int | None, device: torch.device
    ) -> StopCodes:
        """The codes of `plan`'s stopping criteria (transformers' own for `config`, then the plugins').

        Args:
            plan (`GenerationPlan`): the planned request (its length, EOS ids and plugin criteria).
            config (`GenerationConfig`): the config with the global defaults applied.
            tokenizer (*optional*): for stop strings.
            max_position_embeddings (`int`, *optional*): the model's context length.
            device (`torch.device`): the device of the sequences the codes are computed for.
        """
        criteria = build_stopping_criteria(
            config,
            max_length=plan.max_length,
            eos_token_ids=plan.eos_token_ids,
            tokenizer=tokenizer,
            max_position_embeddings=max_position_embeddings,
            user_criteria=plan.stopping_criteria,
        )
        return cls(criteria, plan.eos_token_ids, device)

    def __call__(self, input_ids: torch.Tensor, scores: Any) -> torch.Tensor:
        """`FinishReason` code per row `[rows]` (0 = still running) for `input_ids` `[rows, len]`."""
        if self.by_last_token and input_ids.shape[1]:
            length = input_ids.shape[1]
            by_row = [self.code(length, token) for token in input_ids[:, -1].tolist()]
            return torch.tensor(by_row, dtype=torch.long, device=input_ids.device)
        codes: torch.Tensor = self.criteria.finish_reasons(input_ids, scores).to(input_ids.device)  # [rows]
        if self.eos is not None:
            ended_on_eos = torch.isin(input_ids[:, -1], self.eos)
            codes = torch.where((codes == FinishReason.LENGTH) & ended_on_eos, int(FinishReason.EOS), codes)
        return codes

    def code(self, length: int, last_token: int) -> int:
        """The code of a row of `length` tokens ending in `last_token`, for criteria decided `by_last_token`."""
        code = self.criteria.finish_reason_by_last_token(length, last_token)
        if code == FinishReason.LENGTH and last_token in self._eos_ids:
            return int(FinishReason.EOS)
        return code
