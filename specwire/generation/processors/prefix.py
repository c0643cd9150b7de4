"""Allowed-token prefixes: transformers' `prefix_allowed_tokens_fn`, in a form that travels over the wire.

A Python callable cannot be sent to a server. Its serializable form here is a list of allowed token
sequences (the generated part of a row must follow one of them): `AllowedSequences` keeps them in a
token trie and is itself a `prefix_allowed_tokens_fn` (`(batch_id, input_ids_row) -> list[int]`); the
next tokens of every sequence the row's generated tokens are a prefix of, or the EOS ids once the row
has completed a sequence (or left them all, which the mask never lets happen), so a finished row ends.
`PrefixConstrainedLogitsProcessor` applies such a function exactly as transformers 5.23 does, quirks
included (`batch_id` is `row // num_beams`; when every beam of a prompt has only `-inf` scores left on
its allowed tokens, the mask alone is returned for them, so the constraint still holds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["AllowedSequences", "PrefixConstrainedLogitsProcessor"]

# A trie node: next token -> the node after it; the key `_END` marks a node where a sequence ends.
_Node = dict[int, "_Node"]
_END = -1


class AllowedSequences:
    """
    A token trie of allowed continuations, callable as a `prefix_allowed_tokens_fn`.

    Args:
        sequences (`Sequence[Sequence[int]]`):
            The allowed generated sequences (non-empty token id lists).
        input_len (`int`):
            Prompt length in columns: a row's generated tokens start there.
        eos_token_ids (`Sequence[int]`):
            Allowed once a row completed a sequence.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], input_len: int, eos_token_ids: Sequence[int]):
        self.input_len = input_len
        self.eos = sorted(set(int(t) for t in eos_token_ids))
        self.root: _Node = {}
        for sequence in sequences:
            node = self.root
            for token in sequence:
                node = node.setdefault(int(token), {})
            node[_END] = {}

    def next_tokens(self, generated: Sequence[int]) -> list[int]:
        """The tokens allowed after `generated`: the next tokens of the sequences it is a prefix of, and
        the EOS ids where one of them ends (or when none continues it)."""
        node = self.root
        for token in generated:
            child = node.get(int(token))
            if child is None:
                return list(self.eos)
            node = child
        allowed = sorted(token for token in node if token != _END)
        if _END in node:
            allowed = sorted(set(allowed) | set(self.eos))
        return allowed

    def __call__(self, batch_id: int, input_ids: torch.Tensor) -> list[int]:
        return self.next_tokens(input_ids[self.input_len :].tolist())


class PrefixConstrainedLogitsProcessor:
    """
    transformers' `PrefixConstrainedLogitsProcessor`: only the tokens `prefix_allowed_tokens_fn` allows.

    Args:
        prefix_allowed_tokens_fn (`Callable[[int, torch.Tensor], list[int]]`):
            `(batch_id, input_ids_row) -> allowed token ids`.
        num_beams (`int`):
            Beams per prompt (`batch_id = row // num_beams`).
    """

    def __init__(self, prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]], num_beams: int):
        self.prefix_allowed_tokens_fn = prefix_allowed_tokens_fn
        self.num_beams = num_beams

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Mask every row to its allowed tokens.

        Args:
            input_ids (`torch.LongTensor` of shape `(rows, cur_len)`): prompt and generated tokens.
            scores (`torch.FloatTensor` of shape `(rows, vocab)`): next-token scores.

        Returns:
            `torch.FloatTensor` of shape `(rows, vocab)`: -inf outside the allowed tokens.
        """
        mask = torch.full_like(scores, float("-inf"))
        batch_size = input_ids.shape[0] // self.num_beams
        for batch_id in range(batch_size):
            for beam_id in range(self.num_beams):
                row = batch_id * self.num_beams + beam_id
                allowed = self.prefix_allowed_tokens_fn(batch_id, input_ids[row])
                if len(allowed) == 0:
                    raise ValueError(
                        f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {batch_id}: the "
                        "constraint is unsatisfiable"
                    )
                mask[row, allowed] = 0
        processed = scores + mask
        unsatisfiable = processed.amax(dim=-1).isneginf().view(batch_size, -1).all(dim=-1, keepdim=True)
        return torch.where(unsatisfiable.repeat_interleave(self.num_beams, dim=0), mask, processed)
