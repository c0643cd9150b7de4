"""Diverse (group) beam search's `HammingDiversityLogitsProcessor`, with transformers 4.55.4's semantics.

Group beam search (arXiv 1610.02424) splits each prompt's `num_beams` beams into `num_beam_groups`
groups of `num_beams // num_beam_groups` that pick their tokens one group after the other within a
step. A group's scores are lowered by `diversity_penalty` times the number of times each token was
picked by the earlier groups of the same prompt at this step.

The penalty depends on the step's earlier picks, which no `(input_ids, scores)` call carries: the
group beam loop hands them over with `set_group` before each group's call. This is the one processor
with per-step state besides guidance; it is only built for group beam search.
"""

from __future__ import annotations

import torch

__all__ = ["HammingDiversityLogitsProcessor"]


class HammingDiversityLogitsProcessor:
    """Penalise the tokens the earlier groups of the same prompt picked at this step.

    Args:
        diversity_penalty (`float`):
            Subtracted from a token's score once per earlier pick; > 0.
        num_beams (`int`):
            Beams per prompt; >= 2.
        num_beam_groups (`int`):
            Groups per prompt; 2 <= num_beam_groups <= num_beams.
    """

    def __init__(self, diversity_penalty: float, num_beams: int, num_beam_groups: int):
        if not isinstance(diversity_penalty, float) or not diversity_penalty > 0.0:
            raise ValueError(
                f"`diversity_penalty` should be a float strictly larger than 0, got {diversity_penalty!r}."
            )
        if not isinstance(num_beams, int) or num_beams < 2:
            raise ValueError(f"`num_beams` should be an integer strictly larger than 1, got {num_beams!r}.")
        if not isinstance(num_beam_groups, int) or not 2 <= num_beam_groups <= num_beams:
            raise ValueError(
                f"`num_beam_groups` should be an integer between 2 and `num_beams` ({num_beams}), got "
                f"{num_beam_groups!r}."
            )
        self.diversity_penalty = diversity_penalty
        self.num_beams = num_beams
        self.group_size = num_beams // num_beam_groups
        self._current_tokens: torch.Tensor | None = None  # [batch * num_beams]
        self._group = 0

    def set_group(self, current_tokens: torch.Tensor, group: int) -> None:
        """Before a group's call: the tokens picked so far this step `[batch * num_beams]`, and the group."""
        self._current_tokens = current_tokens
        self._group = group

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Penalise the current group's rows of `scores` `[batch * num_beams, vocab]` (every row is given;
        the loop reads only the current group's)."""
        start = self._group * self.group_size
        if start == 0 or self._current_tokens is None:
            return scores
        vocab_size = scores.shape[-1]
        batch = self._current_tokens.shape[0] // self.num_beams
        picked = self._current_tokens.view(batch, self.num_beams)[:, :start]  # [batch, earlier beams]
        frequency = torch.zeros((batch, vocab_size), dtype=scores.dtype, device=scores.device)
        frequency.scatter_add_(1, picked, torch.ones_like(picked, dtype=scores.dtype))
        penalty = torch.zeros_like(scores).view(batch, self.num_beams, vocab_size)
        penalty[:, start : start + self.group_size] = self.diversity_penalty * frequency[:, None, :]
        return scores - penalty.view_as(scores)
