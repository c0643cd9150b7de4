"""Length rules on the EOS token(s): minimum lengths, and forced BOS / EOS at fixed positions."""

from __future__ import annotations

import numbers

import torch

from .base import token_id_list, vocab_mask


def _check_count(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"`{name}` has to be a non-negative integer, but is {value!r}.")


class MinLengthLogitsProcessor:
    r"""Forbids EOS while the row is shorter than `min_length` tokens (prompt included).

    Args:
        min_length (`int`):
            Minimum total length; below it every EOS score is `-inf`.
        eos_token_id (`int`, `list[int]` or `torch.Tensor`):
            The end-of-sequence id(s).
    """

    def __init__(self, min_length: int, eos_token_id: int | list[int] | torch.Tensor):
        _check_count(min_length, "min_length")
        self.min_length = int(min_length)
        self.eos_token_id = torch.tensor(token_id_list(eos_token_id, "eos_token_id"), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] >= self.min_length:
            return scores
        eos = vocab_mask(self.eos_token_id, scores.shape[-1], scores.device)  # [vocab]
        return torch.where(eos, -float("inf"), scores)


class MinNewTokensLengthLogitsProcessor:
    r"""Forbids EOS until `min_new_tokens` tokens have been generated after the prompt.

    Args:
        prompt_length_to_skip (`int`):
            The prompt length.
        min_new_tokens (`int`):
            Minimum number of new tokens before EOS is allowed.
        eos_token_id (`int`, `list[int]` or `torch.Tensor`):
            The end-of-sequence id(s).
    """

    def __init__(self, prompt_length_to_skip: int, min_new_tokens: int, eos_token_id: int | list[int] | torch.Tensor):
        _check_count(prompt_length_to_skip, "prompt_length_to_skip")
        _check_count(min_new_tokens, "min_new_tokens")
        self.prompt_length_to_skip = int(prompt_length_to_skip)
        self.min_new_tokens = int(min_new_tokens)
        self.eos_token_id = torch.tensor(token_id_list(eos_token_id, "eos_token_id"), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] - self.prompt_length_to_skip >= self.min_new_tokens:
            return scores
        eos = vocab_mask(self.eos_token_id, scores.shape[-1], scores.device)  # [vocab]
        return torch.where(eos, -float("inf"), scores)


class ForcedBOSTokenLogitsProcessor:
    r"""Forces `bos_token_id` as the first generated token when the row holds exactly one token.

    Meant for encoder-decoder models (the decoder starts with one start token); for a decoder-only
    model it only acts on a one-token prompt, as in transformers.

    Args:
        bos_token_id (`int`):
            The id to force.
    """

    def __init__(self, bos_token_id: int):
        ids = token_id_list(bos_token_id, "forced_bos_token_id")
        if len(ids) != 1:
            raise ValueError(f"`forced_bos_token_id` has to be a single token id, but is {bos_token_id!r}.")
        self.bos_token_id = ids[0]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != 1:
            return scores
        forced = torch.full_like(scores, -float("inf"))  # [rows, vocab]
        forced[:, self.bos_token_id] = 0
        return forced


class ForcedEOSTokenLogitsProcessor:
    r"""Forces an EOS id when the row reaches `max_length - 1` tokens, so the last token is EOS.

    Args:
        max_length (`int`):
            The maximum total length.
        eos_token_id (`int`, `list[int]` or `torch.Tensor`):
            The id(s) to force; with several, all get score 0 and the rest `-inf`.
    """

    def __init__(self, max_length: int, eos_token_id: int | list[int] | torch.Tensor):
        _check_count(max_length, "max_length")
        self.max_length = int(max_length)
        self.eos_token_id = torch.tensor(token_id_list(eos_token_id, "forced_eos_token_id"), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] != self.max_length - 1:
            return scores
        forced = torch.full_like(scores, -float("inf"))  # [rows, vocab]
        forced[:, self.eos_token_id.to(scores.device)] = 0
        return forced
