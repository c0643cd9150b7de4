"""The structured-output mask: each row's scores limited to the tokens its grammar allows next.

State is keyed by the row's generated tokens, not by its position in the batch. A matcher for a
prefix is the matcher of a shorter cached prefix (usually the prefix one token shorter) copied and
advanced; so beams that swap parents, finished rows, and speculative verification calling the list
once per candidate position each find their own state without any hook in the loops, and the
processor keeps the contract of the others (a pure function of `input_ids` and `scores`). Copying a
matcher costs ~0.5 us and advancing it a few microseconds (llguidance).

A row whose grammar is complete gets a mask with only the EOS ids (llguidance allows EOS exactly when
the grammar accepts), so it ends with finish reason `eos`. A prefix the grammar rejects with a token
its mask forbade (only a finished row fed pad tokens, a beam already at -inf, or a drafted token past
the first forbidden one reaches one) is left unmasked: its scores are never used. A token the mask
*allowed* and the matcher then refuses is the library contradicting itself: `StructuredOutputFailed`
(INTERNAL, naming llguidance and the spec) ends the request, never a row that goes on unconstrained.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from specwire.errors import SpecwireError, short_value

from .grammars import CompiledGrammar

__all__ = ["StructuredOutputFailed", "StructuredOutputLogitsProcessor"]

# How many tokens back a prefix looks for a cached ancestor before replaying from the start state.
_MAX_WALK_BACK = 64
# Prefix states kept per request: rows x (draft length + 1) in one round, plus the previous round's.
_MAX_STATES = 1024
_REJECTED = object()

log = logging.getLogger(__name__)


class StructuredOutputFailed(SpecwireError):
    """llguidance refused a token its own mask allowed: the request ends (INTERNAL) rather than its row
    going on unconstrained."""

    code = "INTERNAL"


class StructuredOutputLogitsProcessor:
    """
    Masks every row's scores to the tokens its structured-output grammar allows next.

    Args:
        grammar (`CompiledGrammar`):
            The request's compiled spec (`compile_structured_output`).
        input_len (`int`):
            Prompt length in columns: the row's generated tokens start there.
    """

    def __init__(self, grammar: CompiledGrammar, input_len: int):
        self.grammar = grammar
        self.input_len = input_len
        self._states: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._states[()] = grammar.start()
        self._shifts = torch.arange(32, dtype=torch.int32)

    def _matcher(self, generated: tuple[int, ...]) -> Any:
        """The matcher after `generated`, or `_REJECTED` when the grammar refuses that prefix."""
        states = self._states
        found = states.get(generated)
        if found is not None:
            states.move_to_end(generated)
            return found
        start, parent = 0, None
        for back in range(1, min(len(generated), _MAX_WALK_BACK) + 1):
            parent = states.get(generated[:-back])
            if parent is not None:
                start = len(generated) - back
                break
        if parent is None:
            parent = self.grammar.start()
            start = 0
        if parent is _REJECTED:
            matcher = _REJECTED
        else:
            matcher = parent.deep_copy()
            # One token at a time: llguidance 1.9's `consume_tokens([eos])` refuses the EOS on a matcher
            # whose grammar is complete (stopped), where `consume_token(eos)` accepts it.
            tokens = generated[start:]
            for i, token in enumerate(tokens):
                if not matcher.consume_token(token):
                    self._check_refusal(parent, tokens[:i], token, start + i, matcher)
                    matcher = _REJECTED
                    break
        states[generated] = matcher
        if len(states) > _MAX_STATES:
            states.popitem(last=False)
        return matcher

    def _check_refusal(self, parent: Any, before: tuple[int, ...], token: int, position: int, refused: Any) -> None:
        """Raises `StructuredOutputFailed` when the matcher refused `token` although its mask allowed it
        (the state after `parent` and `before`); a token the mask forbade is an ordinary rejection."""
        matcher = parent.deep_copy()
        for earlier in before:
            matcher.consume_token(earlier)
        if not 0 <= token < self.grammar.vocab_size:
            return
        words = torch.zeros(self.grammar.words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        if not (int(words[token // 32]) >> (token % 32)) & 1:
            return
        spec = self.grammar.spec
        log.error("llguidance refused token %d its own mask allowed (%s): %r", token, spec.field, spec.value)
        raise StructuredOutputFailed(
            f"llguidance refused token {token} at generated position {position}, which its own mask allowed, "
            f"for {spec.field}={short_value(spec.value)!r} ({refused.get_error() or 'no error message'}); the "
            "request ends rather than go on unconstrained: a bug in llguidance or in specwire's use of it, "
            "please report it with the spec"
        )

    def allowed_prefix_length(self, ids: torch.Tensor, draft: list[int]) -> int:
        """
        How many leading tokens of `draft` the grammar allows after `ids` (speculation cuts the draft there).

        Args:
            ids (`torch.LongTensor` of shape `(cur_len,)`): the row's prompt and generated tokens.
            draft (`list[int]`): the drafted tokens.

        Returns:
            `int`: the length of the longest allowed prefix of `draft`.
        """
        matcher = self._matcher(tuple(ids[self.input_len :].tolist()))
        if matcher is _REJECTED or not draft:
            return 0
        return int(matcher.validate_tokens(draft))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Mask each row (see the module docstring).

        Args:
            input_ids (`torch.LongTensor` of shape `(rows, cur_len)`): prompt and generated tokens.
            scores (`torch.FloatTensor` of shape `(rows, vocab)`): next-token scores.

        Returns:
            `torch.FloatTensor` of shape `(rows, vocab)`: the scores, -inf where the grammar forbids.
        """
        rows = input_ids.shape[0]
        bitmask = torch.full((rows, self.grammar.words), -1, dtype=torch.int32)  # -1: every token allowed
        generated = input_ids[:, self.input_len :].tolist()
        for r in range(rows):
            matcher = self._matcher(tuple(generated[r]))
            if matcher is not _REJECTED:
                row = bitmask[r]
                matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        allowed = ((bitmask.unsqueeze(-1) >> self._shifts) & 1).reshape(rows, -1)[:, : scores.shape[-1]]  # [rows, V]
        return scores.masked_fill(allowed.to(scores.device) == 0, float("-inf"))
