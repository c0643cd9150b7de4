"""The logits-processor protocol, the list that chains processors, and small shared helpers.

A processor maps `(input_ids [rows, cur_len], scores [rows, vocab])` to new scores `[rows, vocab]`.
`rows` is whatever the caller batches: requests, beams, returned sequences, or one row per candidate
prefix during speculative verification. Processors never modify `scores` in place and keep no
per-step state (the unbatched classifier-free guidance processor is the one exception, as in
transformers), so calling one on `candidate_ids[:, :cur_len + i]` for several `i` is safe.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class LogitsProcessor(Protocol):
    """Anything that turns next-token scores into processed scores.

    `*Processor` classes may change the argmax; `*Warper` classes only reshape the sampling distribution
    (transformers' naming).
    """

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Process one step.

        Args:
            input_ids (`torch.LongTensor` of shape `(rows, cur_len)`):
                The tokens so far (prompt and generated), one row per hypothesis.
            scores (`torch.FloatTensor` of shape `(rows, vocab)`):
                Next-token logits (sampling, greedy) or log-probabilities (beam search).

        Returns:
            `torch.FloatTensor` of shape `(rows, vocab)`: the processed scores (a new tensor).
        """
        ...


class LogitsProcessorList(list[Any]):
    """A list of processors applied in order; calling it runs the chain.

    Unlike transformers' list, no signature introspection happens per step: every processor takes
    exactly `(input_ids, scores)`, resolved once when the list is built.
    """

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Apply every processor in list order.

        Args:
            input_ids (`torch.LongTensor` of shape `(rows, cur_len)`):
                The tokens so far.
            scores (`torch.FloatTensor` of shape `(rows, vocab)`):
                Next-token scores.

        Returns:
            `torch.FloatTensor` of shape `(rows, vocab)`: the processed scores.
        """
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


def token_id_list(value: int | Sequence[int] | torch.Tensor, name: str) -> list[int]:
    """Normalise one or several token ids to a list of non-negative Python ints.

    Args:
        value (`int`, `Sequence[int]` or `torch.Tensor`):
            A single id, a list of ids or an integer tensor.
        name (`str`):
            The argument's name, used in the error message.

    Returns:
        `list[int]`: the ids.

    Raises:
        ValueError: if an id is not a non-negative integer.
    """
    if isinstance(value, torch.Tensor):
        if torch.is_floating_point(value):
            raise ValueError(f"`{name}` has to hold integer token ids, but is a float tensor {value}.")
        items: Iterable[Any] = value.reshape(-1).tolist()
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        items = [value]
    elif isinstance(value, Sequence) and not isinstance(value, str):
        items = value
    else:
        raise ValueError(f"`{name}` has to be a token id or a list of token ids, but is {value!r}.")
    ids = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, numbers.Integral) or item < 0:
            raise ValueError(
                f"`{name}` has to contain non-negative integer token ids, but contains {item!r} (in {value!r})."
            )
        ids.append(int(item))
    return ids


def vocab_mask(ids: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Boolean mask `[vocab]` that is True at `ids`; ids outside the vocabulary are ignored.

    Args:
        ids (`torch.Tensor`):
            1-D tensor of token ids.
        vocab_size (`int`):
            Width of the mask.
        device (`torch.device`):
            Where to build it.

    Returns:
        `torch.BoolTensor` of shape `(vocab,)`.
    """
    return torch.isin(torch.arange(vocab_size, device=device), ids.to(device))
