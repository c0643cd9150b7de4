"""Drafting ahead: a draft model drafts round n+1 while the target verifies round n.

After answering a block `P` for a row, `OverlappingModelDrafter.draft_ahead` assumes the target
accepts all of `P` and appends the draft's own greedy next token `g` as its bonus token, and drafts
the next block `A` after `prefix + P + g`. When the feedback confirms both assumptions (every token of
`P` accepted, appended exactly `[g]`), the next proposal is `A`, cut to the length asked or extended
by drafting on; otherwise `A` is discarded (the cache rolls back as after any round) and the draft
proceeds from the real prefix as serial drafting does. Drafting ahead gives way at every forward: it
stops when the feedback arrives (`should_stop`) and what it drafted so far is kept.

Why the proposals stay lossless (arXiv 2211.17192 needs each draft token drawn from the draft's
`q(. | prefix, earlier draft tokens)`, with that `q` returned, independently of the target's coins):

- `g` is chosen by the draft alone (an argmax, no randomness drawn) and `A` is drawn from
  `q(. | prefix + P + g, earlier tokens of A)` with the draft's own generator, before the target's
  outcome is known, so it depends on nothing the target drew. `A` is used only when the real prefix
  *is* `prefix + P + g`: given that event, `A` is distributed exactly as drafting after the real
  prefix would have drawn it, and its returned `q` rows are the ones its tokens were drawn from.
  When the guess is wrong the block describes another prefix and is never used.
- Stronger: the proposals are *the same tokens* serial drafting draws. Sampling rows share one
  generator, drawn in row order; `A` is reused only when the generator's state where `A` started
  equals its state where serial drafting would start that row's block, and the generator is then set
  to its state after the tokens reused (`states`). A discarded block puts the generator back where it
  was before drafting ahead. So a seed gives the same output with or without overlap, whatever the
  timing (how far drafting ahead got before the feedback arrived).

Greedy requests need none of this for losslessness (the target's output does not depend on the
drafts), only for speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specwire.generation.sampling import greedy_tokens
from specwire.generation.speculation.drafters import ModelDrafter, Proposal

__all__ = ["AHEAD_HIT", "AHEAD_MISS", "AHEAD_NONE", "OverlappingModelDrafter"]

AHEAD_NONE = 0  # no block drafted ahead to use or discard for the row
AHEAD_HIT = 1  # the proposal came from the block drafted ahead
AHEAD_MISS = 2  # the block drafted ahead was discarded


@dataclass
class _Ahead:
    """One row's block drafted ahead, and what it assumed."""

    block: list[int]  # the proposal it assumed fully accepted (P)
    guess: int  # the bonus token it assumed (g)
    start_state: torch.Tensor | None  # the generator's state before drafting A (sampling)
    tokens: list[int] = field(default_factory=list)  # A
    probs: list[torch.Tensor] = field(default_factory=list)  # q of each token of A
    states: list[torch.Tensor] = field(default_factory=list)  # generator state after each token of A
    ended: bool = False  # A ended by itself (EOS, confidence): drafting on would stop there too
    guess_ends: bool = False  # g is an EOS: the row ends with it, nothing to draft after


class OverlappingModelDrafter(ModelDrafter):
    """A `ModelDrafter` that drafts the next block ahead between rounds (`draft_ahead`).

    Same arguments as `ModelDrafter`. `outcomes` says, per row, what became of the block drafted ahead
    for the last proposal (`AHEAD_NONE`, `AHEAD_HIT`, `AHEAD_MISS`).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ahead: list[_Ahead | None] = [None] * len(self.rows)
        self.confirmed: list[_Ahead | None] = [None] * len(self.rows)  # hits awaiting the next propose
        self.outcomes: list[int] = [AHEAD_NONE] * len(self.rows)
        self.last_asked = 0

    def propose(self, num_tokens: int) -> Proposal:
        self.last_asked = num_tokens
        if num_tokens <= 0:  # a look-back drafts nothing: the blocks drafted ahead are not used
            self.confirmed = [None] * len(self.rows)
        if not any(self.confirmed):
            return super().propose(num_tokens)
        return self._propose_reusing(num_tokens)

    @torch.inference_mode()
    def _propose_reusing(self, num_tokens: int) -> Proposal:
        tokens: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for i, row in enumerate(self.rows):
            ahead, self.confirmed[i] = self.confirmed[i], None
            drafted: list[int] = []
            row_probs: list[torch.Tensor] = []
            if self.finished[i]:
                pass
            elif ahead is not None and self._starts_where_serial_would(ahead):
                self.outcomes[i] = AHEAD_HIT
                drafted, row_probs = self._reuse(i, ahead, num_tokens)
            else:
                if ahead is not None:  # right guess, but drawn from another point of the random stream
                    self.outcomes[i] = AHEAD_MISS
                drafted, row_probs, _ = self._extend(i, row.tokens, num_tokens)
            row.drafted = drafted
            tokens.append(drafted)
            probs.append(self._stacked(row_probs))
        return Proposal(tokens, probs, self._hindsight())

    def _starts_where_serial_would(self, ahead: _Ahead) -> bool:
        if self.generator is None or ahead.start_state is None:
            return True
        return torch.equal(self.generator.get_state(), ahead.start_state)

    def _reuse(self, i: int, ahead: _Ahead, num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Row `i`'s proposal from its confirmed block: cut to `num_tokens`, or extended by drafting on."""
        row = self.rows[i]
        used = min(num_tokens, len(ahead.tokens))
        drafted, row_probs = ahead.tokens[:used], ahead.probs[:used]
        if self.generator is not None:
            # Where serial drafting's generator would be after drawing these tokens.
            state = ahead.states[used - 1] if used else ahead.start_state
            if state is not None:
                self.generator.set_state(state)
        # The cache may hold tokens of the block beyond the ones used: keep what the proposal implies.
        self._crop(row, len(row.tokens) + max(used - 1, 0))
        if used < num_tokens and not ahead.ended:
            more, more_probs, _ = self._extend(i, row.tokens + drafted, num_tokens - used)
            drafted, row_probs = drafted + more, row_probs + more_probs
        return drafted, row_probs

    @torch.inference_mode()
    def draft_ahead(self, should_stop: Any) -> None:
        """Draft every row's next block as if the target accepts all of the last proposal and appends
        the draft's greedy next token; stops as soon as `should_stop()` is true (between forwards).

        Args:
            should_stop (`Callable[[], bool]`): the feedback arrived, or other work waits for the thread.
        """
        if self.last_asked <= 0:
            return  # the target decodes without drafts for now: nothing to hide
        for i, row in enumerate(self.rows):
            if should_stop():
                return
            block = row.drafted
            if self.finished[i] or self.ahead[i] is not None or (block and block[-1] in self.eos):
                continue  # a block ending in EOS ends the row when accepted
            base = row.tokens + block
            guess = int(greedy_tokens(self._processed(i, base)))
            ahead = _Ahead(block, guess, self.generator.get_state() if self.generator is not None else None)
            ahead.guess_ends = guess in self.eos
            if not ahead.guess_ends:
                ahead.tokens, ahead.probs, ahead.ended = self._extend(
                    i, [*base, guess], self.last_asked, should_stop, ahead.states
                )
            self.ahead[i] = ahead

    def feedback(self, num_accepted: list[int], appended: list[list[int]], finished: list[bool]) -> None:
        self.outcomes = [AHEAD_NONE] * len(self.rows)
        blocks = [a for a in self.ahead if a is not None]
        for i, (n, extra) in enumerate(zip(num_accepted, appended, strict=True)):
            ahead, self.ahead[i] = self.ahead[i], None
            row = self.rows[i]
            if ahead is None or finished[i] or self.finished[i]:
                self._feedback_row(i, n, extra, finished[i])
            elif n == len(ahead.block) and list(extra) == [ahead.guess] and row.drafted == ahead.block:
                row.tokens += ahead.block + [ahead.guess]
                row.checked_from = len(row.tokens)
                row.drafted = []
                self.confirmed[i] = ahead  # used (cut or extended) by the next propose
            else:
                self.outcomes[i] = AHEAD_MISS
                self._feedback_row(i, n, extra, finished[i])
        if self.generator is not None and blocks and blocks[0].start_state is not None:
            # The first block drafted ahead started where the last proposal left the generator, which is
            # where serial drafting starts the next one: every draw made ahead is taken back, and the
            # blocks reused set the generator past their own tokens (`_reuse`).
            self.generator.set_state(blocks[0].start_state)
