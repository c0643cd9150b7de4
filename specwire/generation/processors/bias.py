"""Additive biases on token sequences: `sequence_bias` and `bad_words_ids` (a bias of `-inf`)."""

from __future__ import annotations

import numbers
from typing import Any, cast

import torch

from specwire.generation.argument_errors import InvalidGenerationArgument

from .base import token_id_list


def _is_id_sequence(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and cast(int, t) >= 0 for t in value)
    )


def _normalise_sequence_bias(sequence_bias: Any) -> dict[tuple[int, ...], float]:
    """Accept `{(ids...): bias}` or `[[ids, bias], ...]` (the JSON form) and return the dict form."""
    example = "e.g. {(42,): -5.0, (10, 11): 2.0} or [[[42], -5.0], [[10, 11], 2.0]]"
    if not isinstance(sequence_bias, (dict, list)) or len(sequence_bias) == 0:
        raise ValueError(
            f"`sequence_bias` has to be a non-empty dict or list of pairs ({example}), but is {sequence_bias!r}."
        )
    pairs = sequence_bias.items() if isinstance(sequence_bias, dict) else sequence_bias
    result: dict[tuple[int, ...], float] = {}
    for pair in pairs:
        if isinstance(sequence_bias, list) and (not isinstance(pair, (list, tuple)) or len(pair) != 2):
            raise ValueError(
                f"Each element of `sequence_bias` has to be a pair [token_ids, bias] ({example}), got {pair!r}."
            )
        ids, bias = pair
        if isinstance(sequence_bias, dict) and not isinstance(ids, tuple):
            raise ValueError(f"`sequence_bias` dict keys have to be tuples of token ids ({example}), got {ids!r}.")
        if not _is_id_sequence(ids):
            raise ValueError(
                "Each token sequence in `sequence_bias` has to be a non-empty sequence of non-negative ints "
                f"({example}), got {ids!r}."
            )
        # transformers insists on floats (an int bias is rejected); so do we, so configs port both ways.
        if isinstance(bias, bool) or not isinstance(bias, float):
            raise ValueError(
                f"Each bias in `sequence_bias` has to be a float (write 2.0, not 2), got {bias!r} for {ids!r}."
            )
        result[tuple(int(t) for t in ids)] = bias
    return result


class SequenceBiasLogitsProcessor:
    r"""Adds a bias to the last token of each listed sequence when the row ends with the rest of it.

    Single-token sequences are biased at every step. A multi-token sequence `(t1, ..., tk)` adds its
    bias to `tk` when the row ends with `t1 .. t(k-1)` (skipped while the row is shorter than that
    prefix). Biases of sequences sharing a last token add up.

    Args:
        sequence_bias (`dict[tuple[int, ...], float]` or `list[list[list[int] | float]]`):
            `{(ids...): bias}` or the JSON-friendly `[[ids, bias], ...]`. Biases must be floats.
    """

    # The config field the ids came from, named when an id is past the vocabulary.
    field = "sequence_bias"

    def __init__(self, sequence_bias: dict[tuple[int, ...], float] | list[list[Any]]):
        self.sequence_bias = _normalise_sequence_bias(sequence_bias)
        # Bias tensors depend on the vocabulary width and device of the scores: built on first use.
        self._prepared: dict[
            tuple[int, torch.device], tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
        ] = {}

    def _prepare(
        self, vocab: int, device: torch.device
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        key = (vocab, device)
        if key in self._prepared:
            return self._prepared[key]
        too_large = [t for ids in self.sequence_bias for t in ids if t >= vocab]
        if too_large:
            # transformers raises a ValueError here too; ours names the field for the servers.
            raise InvalidGenerationArgument.for_field(
                self.field,
                too_large,
                f"The model vocabulary size is {vocab}, but `{self.field}` mentions the token ids {too_large}; "
                f"remove them or use ids in [0, {vocab}).",
            )
        single = torch.zeros((vocab,), dtype=torch.float, device=device)  # [vocab]
        singles = [(ids[0], b) for ids, b in self.sequence_bias.items() if len(ids) == 1]
        if singles:
            single[[t for t, _ in singles]] = torch.tensor([b for _, b in singles], device=device)
        # Group multi-token sequences by prefix length (first-seen order) so each group is one compare.
        groups: dict[int, list[tuple[tuple[int, ...], float]]] = {}
        for ids, b in self.sequence_bias.items():
            if len(ids) > 1:
                groups.setdefault(len(ids) - 1, []).append((ids, b))
        multi = [
            (
                torch.tensor([ids[:-1] for ids, _ in group], device=device),  # [n_seq, prefix_len]
                torch.tensor([ids[-1] for ids, _ in group], device=device),  # [n_seq]
                torch.tensor([b for _, b in group], dtype=torch.float, device=device),  # [n_seq]
            )
            for group in groups.values()
        ]
        self._prepared[key] = (single, multi)
        return single, multi

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        single, multi = self._prepare(scores.shape[-1], scores.device)
        bias = torch.zeros_like(scores)  # [rows, vocab]
        bias += single
        for prefixes, last_tokens, values in multi:
            prefix_len = prefixes.shape[1]
            if prefix_len > input_ids.shape[1]:
                continue
            tail = input_ids[:, None, input_ids.shape[1] - prefix_len :]  # [rows, 1, prefix_len]
            ends_with = (tail == prefixes).all(dim=-1)  # [rows, n_seq]
            bias.index_add_(1, last_tokens, torch.where(ends_with, values, 0.0).to(bias.dtype))
        return scores + bias


class NoBadWordsLogitsProcessor(SequenceBiasLogitsProcessor):
    r"""Bans token sequences: each sequence's last token gets `-inf` when the row ends with the rest of it.

    Single-token entries equal to an EOS id are dropped, so EOS can never be banned on its own
    (transformers' rule); multi-token entries containing EOS stay.

    Args:
        bad_words_ids (`list[list[int]]`):
            Non-empty list of non-empty token-id lists.
        eos_token_id (`int`, `list[int]` or `torch.Tensor`, *optional*):
            The end-of-sequence id(s).
    """

    field = "bad_words_ids"

    def __init__(self, bad_words_ids: list[list[int]], eos_token_id: int | list[int] | torch.Tensor | None = None):
        if not isinstance(bad_words_ids, list) or len(bad_words_ids) == 0:
            raise ValueError(
                "`bad_words_ids` has to be a non-empty list of token-id lists, e.g. [[42], [10, 11]], but is "
                f"{bad_words_ids!r}."
            )
        for entry in bad_words_ids:
            if not isinstance(entry, list) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in entry
            ):
                raise ValueError(
                    "Each entry of `bad_words_ids` has to be a list of non-negative token ids, e.g. [[42], [10, 11]], "
                    f"but got {entry!r}."
                )
        self.bad_words_ids = bad_words_ids
        kept = bad_words_ids
        if eos_token_id is not None:
            eos = token_id_list(eos_token_id, "eos_token_id")
            kept = [entry for entry in bad_words_ids if not (len(entry) == 1 and entry[0] in eos)]
        if not kept:
            raise ValueError(
                f"`bad_words_ids` ({bad_words_ids!r}) only lists end-of-sequence tokens, which can't be banned on "
                "their own; use `min_new_tokens` / `min_length` to delay EOS instead."
            )
        super().__init__({tuple(int(t) for t in entry): float("-inf") for entry in kept})
