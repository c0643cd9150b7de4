"""Token suppression: always (`suppress_tokens`) or only at the first generated position."""

from __future__ import annotations

import torch

from .base import token_id_list, vocab_mask


class SuppressTokensLogitsProcessor:
    r"""Sets the listed tokens to `-inf` at every step.

    Args:
        suppress_tokens (`list[int]`):
            Token ids to suppress; ids outside the vocabulary are ignored.
    """

    def __init__(self, suppress_tokens: list[int]):
        self.suppress_tokens = torch.tensor(token_id_list(list(suppress_tokens), "suppress_tokens"), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = vocab_mask(self.suppress_tokens, scores.shape[-1], scores.device)  # [vocab]
        return torch.where(mask, -float("inf"), scores)


class SuppressTokensAtBeginLogitsProcessor:
    r"""Sets the listed tokens to `-inf` only when the row length equals `begin_index` (the first new token).

    Args:
        begin_suppress_tokens (`list[int]`):
            Token ids to suppress at the first generated position.
        begin_index (`int`):
            Row length at which generation begins (the prompt length, plus one when a BOS token is
            forced after a one-token prompt).
    """

    def __init__(self, begin_suppress_tokens: list[int], begin_index: int):
        self.begin_suppress_tokens = torch.tensor(
            token_id_list(list(begin_suppress_tokens), "begin_suppress_tokens"), dtype=torch.long
        )
        self.begin_index = begin_index

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.begin_index:
            return scores
        mask = vocab_mask(self.begin_suppress_tokens, scores.shape[-1], scores.device)  # [vocab]
        return torch.where(mask, -float("inf"), scores)
