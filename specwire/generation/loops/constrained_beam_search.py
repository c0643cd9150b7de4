"""The bookkeeping of constrained beam search, with transformers 4.55.4's exact rules.

4.55.4's `ConstrainedBeamSearchScorer` (the last release with constrained beam search in core; its
outputs are the contract, tests/parity/goldens/v4_constrained_beam_search.json):

- Per prompt and step the best `max(2, 1 + n_eos) * num_beams` candidates are walked as in beam search;
  an EOS candidate among the first `num_beams` becomes a finished hypothesis only when its tokens
  complete every constraint.
- The `num_beams` kept candidates are then mixed with *advance* candidates: for every running beam whose
  constraints are not complete, each token that makes progress (`ConstraintListState.advance`), scored
  with that beam's accumulated score. All are ranked by bank (constraint progress) and score, and taken
  round-robin across banks (best of each bank first), so hypotheses at every level of progress survive.
- At the end the running beams completing the constraints are added; when fewer than
  `num_return_sequences` do, the others are added too (4.55.4's fallback).

Hypotheses are stored, scored and returned as in group beam search (`group_beam_search._Hypotheses` and
its packing: one group of `num_beams`).
"""

from __future__ import annotations

import torch

from specwire.generation.constraints import Constraint, ConstraintListState
from specwire.generation.loops.group_beam_search import GroupBeamOutput, GroupBeamScorer, _Hypothesis
from specwire.vocabulary import FinishReason

__all__ = ["ConstrainedBeamScorer"]


class ConstrainedBeamScorer(GroupBeamScorer):
    """
    transformers 4.55.4's `ConstrainedBeamSearchScorer`.

    Args:
        constraints (`list[PhrasalConstraint | DisjunctiveConstraint]`): the constraints.
        **kwargs: `GroupBeamScorer`'s arguments (one group).
    """

    def __init__(self, constraints: list[Constraint], **kwargs: object):
        super().__init__(num_beam_groups=1, **kwargs)  # type: ignore[arg-type]
        self.constraints = constraints

    def states(self, n: int) -> list[ConstraintListState]:
        return [ConstraintListState([c.copy() for c in self.constraints]) for _ in range(n)]

    def completes(self, tokens: list[int]) -> bool:
        state = self.states(1)[0]
        state.reset(tokens)
        return state.completed

    def process_step(
        self,
        input_ids: torch.Tensor,
        scores: torch.Tensor,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        vocab_scores: torch.Tensor,
        beam_indices: list[tuple[int, ...]] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        One step.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch * num_beams, cur_len)`): the running beams.
            scores, tokens, parents (`torch.Tensor` of shape `(batch, K)`): the best candidates' accumulated
                scores, tokens and beams (per prompt), best first.
            vocab_scores (`torch.FloatTensor` of shape `(batch * num_beams, V)`): every accumulated score.
            beam_indices (`list[tuple[int, ...]]`, *optional*): each row's beam indices so far.

        Returns:
            `(next scores, next tokens, next rows)`, each of shape `(batch * num_beams,)`, rows global.
        """
        size = self.num_beams
        cur_len = input_ids.shape[-1] + 1
        next_scores = torch.zeros((self.batch_size, size), dtype=scores.dtype, device=scores.device)
        next_tokens = torch.zeros((self.batch_size, size), dtype=tokens.dtype, device=tokens.device)
        next_rows = torch.zeros((self.batch_size, size), dtype=parents.dtype, device=parents.device)
        for b in range(self.batch_size):
            if self.done[b]:
                next_tokens[b, :] = self.pad_token_id
                continue
            kept = 0
            ranked = zip(tokens[b].tolist(), scores[b], parents[b].tolist(), strict=True)
            for rank, (token, score, parent) in enumerate(ranked):
                row = b * size + parent
                if token in self.eos:
                    if rank >= size or not self.completes(input_ids[row].tolist()):
                        continue
                    beam_index = beam_indices[row] + (row,) if beam_indices is not None else None
                    self.hypotheses[b].add(
                        input_ids[row].clone(), score.item(), beam_index, cur_len - self.prompt_length, FinishReason.EOS
                    )
                else:
                    next_scores[b, kept], next_tokens[b, kept], next_rows[b, kept] = score, token, row
                    kept += 1
                if kept == size:
                    break
            next_scores[b], next_tokens[b], next_rows[b] = self._advance(
                b, input_ids, vocab_scores, next_scores[b], next_tokens[b], next_rows[b]
            )
            self.done[b] = self.done[b] or self.hypotheses[b].is_done(
                scores[b].max().item(), cur_len, self.prompt_length
            )
        return next_scores.view(-1), next_tokens.view(-1), next_rows.view(-1)

    def _advance(
        self,
        b: int,
        input_ids: torch.Tensor,
        vocab_scores: torch.Tensor,
        beam_scores: torch.Tensor,
        beam_tokens: torch.Tensor,
        beam_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """4.55.4's `step_sentence_constraint`: the kept candidates mixed with the advance candidates."""
        size = beam_rows.shape[0]
        device = beam_rows.device
        top_states = self.states(size)
        start = b * size
        full = torch.cat((input_ids[beam_rows], beam_tokens.unsqueeze(-1)), dim=-1)
        seqs = full.tolist()
        new_states: list[ConstraintListState] = []
        new_rows: list[int] = []
        new_tokens: list[torch.Tensor] = []
        new_scores: list[torch.Tensor] = []
        for i in range(size):
            top_states[i].reset(seqs[i])
            previous = input_ids[start + i]
            state = self.states(1)[0]
            state.reset(previous.tolist())
            if state.completed:
                continue
            for token in torch.tensor(state.advance(), dtype=torch.long, device=device):
                new_state = state.copy(stateful=True)
                new_state.add(int(token))
                seq = torch.cat((previous, token.unsqueeze(0)), -1).tolist()
                if seq not in seqs:  # the same hypothesis only once
                    seqs.append(seq)
                    new_rows.append(start + i)
                    new_tokens.append(token)
                    new_scores.append(vocab_scores[start + i].take(token))
                    new_states.append(new_state)
        if not new_rows:
            return beam_scores, beam_tokens, beam_rows
        all_tokens = torch.cat((beam_tokens, torch.stack(new_tokens)), -1)
        all_scores = torch.cat((beam_scores, torch.stack(new_scores)), -1)
        banks = torch.tensor([s.get_bank() for s in top_states + new_states], device=device)
        order = (banks * 100 + all_scores).sort(descending=True).indices
        sorted_banks = banks[order].tolist()
        # Rank within its bank, then a stable sort on it: the best of every bank, then the second best, ...
        increments, counter, current = [], -1, sorted_banks[0]
        for bank in sorted_banks:
            counter = counter + 1 if bank == current else 0
            current = bank
            increments.append(counter)
        rearranged = torch.tensor(sorted(range(len(increments)), key=increments.__getitem__))
        order = order[rearranged][:size]
        rows = torch.cat((beam_rows, torch.tensor(new_rows, device=device)))
        return all_scores[order], all_tokens[order], rows[order]

    def finalize_constrained(
        self,
        input_ids: torch.Tensor,
        beam_scores: torch.Tensor,
        end_codes: torch.Tensor,
        num_return_sequences: int,
        beam_indices: list[tuple[int, ...]] | None,
    ) -> GroupBeamOutput:
        """
        The best `num_return_sequences` hypotheses per prompt (see the module docstring for the fallback).

        Args:
            input_ids (`torch.LongTensor` of shape `(batch * num_beams, cur_len)`): the running beams.
            beam_scores (`torch.FloatTensor` of shape `(batch * num_beams,)`): their scores.
            end_codes (`torch.LongTensor` of shape `(batch * num_beams,)`): why each running beam stopped.
            num_return_sequences (`int`): hypotheses per prompt.
            beam_indices (`list[tuple[int, ...]]`, *optional*): each row's beam indices.

        Returns:
            `GroupBeamOutput`
        """
        for b, hypotheses in enumerate(self.hypotheses):
            if self.done[b]:
                continue
            collected: list[int] = []
            for beam in range(self.num_beams):
                row = b * self.num_beams + beam
                if self.completes(input_ids[row].tolist()):
                    self._add_running(hypotheses, input_ids, beam_scores, end_codes, row, beam_indices)
                    collected.append(beam)
            if len(collected) < num_return_sequences:
                for beam in range(self.num_beams):
                    if beam not in collected:
                        row = b * self.num_beams + beam
                        # 4.55.4 adds these without their beam indices
                        self._add_running(hypotheses, input_ids, beam_scores, end_codes, row, None)
        best: list[_Hypothesis] = []
        for hypotheses in self.hypotheses:
            ranked = sorted(hypotheses.beams, key=lambda h: h[0])
            best.extend(ranked.pop() for _ in range(num_return_sequences))
        packed = self._pack(input_ids, best)
        if best and best[0][2] is None:
            # 4.55.4 returns no beam indices when the first returned hypothesis came from the fallback.
            packed.beam_indices = None
        return packed

    def _add_running(
        self,
        hypotheses: object,
        input_ids: torch.Tensor,
        beam_scores: torch.Tensor,
        end_codes: torch.Tensor,
        row: int,
        beam_indices: list[tuple[int, ...]] | None,
    ) -> None:
        tokens = input_ids[row]
        reason = int(end_codes[row]) or FinishReason.LENGTH
        beam_index = beam_indices[row] if beam_indices is not None else None
        hypotheses.add(  # type: ignore[attr-defined]
            tokens, beam_scores[row].item(), beam_index, tokens.shape[-1] - self.prompt_length, reason
        )
