"""The hypotheses bookkeeping of diverse (group) beam search, with transformers 4.55.4's exact scoring.

transformers 5 moved group beam search out of `generate()`; 4.55.4 is the last release that ran it in
core (`_group_beam_search` with `BeamSearchScorer` and `BeamHypotheses`), and its outputs are the
contract (tests/parity/goldens/v4_group_beam_search.json). Its rules differ from the vectorised beam
search of `beam_search.py`, so they live here:

- A *group* is `group_size = num_beams // num_beam_groups` consecutive beams of one prompt; each
  (prompt, group) keeps its own `group_size` finished hypotheses and its own done flag.
- Per group and step, the best `max(2, 1 + n_eos) * group_size` candidates are walked in order: an EOS
  candidate among the first `group_size` becomes a finished hypothesis scored
  `score / generated_len ** length_penalty` (Python floats, as there); the first `group_size` others
  are the group's next beams. A finished (prompt, group) keeps feeding `pad_token_id` with score 0.
- A (prompt, group) is done once it holds `group_size` hypotheses and, depending on `early_stopping`,
  no running beam can beat the worst of them (`True`: at once; `False`: at the current length;
  `"never"`: at `max_length` when `length_penalty > 0`).
- At the end the running beams of groups not done are added as hypotheses; the best
  `num_return_sequences` of all groups of a prompt are returned, padded with `pad_token_id` and one
  `eos_token_id[0]` after a shorter hypothesis, cut at `max_length`.

Beam indices are kept as transformers keeps them: group-local row indices (`batch * group_size` rows
per group), listed group after group, and looked up at the end by batch-major row, so with several
prompts they are those 4.55.4 returns, not the rows that produced the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specwire.vocabulary import FinishReason

__all__ = ["GroupBeamOutput", "GroupBeamScorer"]


# A finished hypothesis: (score, tokens, beam indices, finish reason code).
_Hypothesis = tuple[float, torch.Tensor, tuple[int, ...] | None, int]


@dataclass
class _Hypotheses:
    """The finished hypotheses of one (prompt, group): transformers 4.55.4's `BeamHypotheses`."""

    size: int
    length_penalty: float
    early_stopping: bool | str
    max_length: int
    beams: list[_Hypothesis] = field(default_factory=list)
    worst_score: float = 1e9

    def add(
        self,
        tokens: torch.Tensor,
        sum_logprobs: float,
        beam_indices: tuple[int, ...] | None,
        generated_len: int,
        reason: int,
    ) -> None:
        score = sum_logprobs / (generated_len**self.length_penalty)
        if len(self.beams) < self.size or score > self.worst_score:
            self.beams.append((score, tokens, beam_indices, reason))
            if len(self.beams) > self.size:
                ranked = sorted((s, i) for i, (s, _, _, _) in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs: float, cur_len: int, prompt_length: int) -> bool:
        if len(self.beams) < self.size:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping is False or self.length_penalty <= 0.0:
            best = best_sum_logprobs / (cur_len - prompt_length) ** self.length_penalty
        else:  # "never" with a positive length penalty: the longest hypothesis is the best case
            best = best_sum_logprobs / (self.max_length - prompt_length) ** self.length_penalty
        return bool(self.worst_score >= best)


@dataclass
class GroupBeamOutput:
    """
    The returned hypotheses of a finished group beam search.

    Args:
        sequences (`torch.LongTensor` of shape `(batch * num_return_sequences, length)`):
            Prompt and hypothesis tokens, padded as transformers 4.55.4 pads them.
        sequences_scores (`torch.FloatTensor` of shape `(batch * num_return_sequences,)`):
            Length-penalised scores.
        beam_indices (`torch.LongTensor` of shape `(batch * num_return_sequences, length)`, *optional*):
            4.55.4's beam indices (see the module docstring), `-1` after the end; `None` when not tracked.
        generated (`list[int]`):
            Generated tokens of each returned row (an EOS hypothesis' appended `eos_token_id[0]` included).
        reason_codes (`list[int]`):
            `FinishReason` code of each hypothesis.
    """

    sequences: torch.Tensor
    sequences_scores: torch.Tensor
    beam_indices: torch.Tensor | None
    generated: list[int]
    reason_codes: list[int]


class GroupBeamScorer:
    """
    transformers 4.55.4's `BeamSearchScorer` with `num_beam_groups > 1`.

    Args:
        batch_size (`int`): prompts.
        num_beams (`int`): beams per prompt.
        num_beam_groups (`int`): groups per prompt (divides `num_beams`).
        length_penalty (`float`): exponent of the generated length dividing finished scores.
        early_stopping (`bool` or `"never"`): transformers' `early_stopping`.
        max_length (`int`): total length limit.
        prompt_length (`int`): prompt columns.
        eos_token_ids (`list[int]`, *optional*): EOS ids.
        pad_token_id (`int`): fed to finished groups and used to pad the returned rows.
        track_beam_indices (`bool`): keep beam indices (transformers does with `output_scores`).
    """

    def __init__(
        self,
        *,
        batch_size: int,
        num_beams: int,
        num_beam_groups: int,
        length_penalty: float,
        early_stopping: bool | str,
        max_length: int,
        prompt_length: int,
        eos_token_ids: list[int] | None,
        pad_token_id: int,
        track_beam_indices: bool,
    ):
        self.batch_size = batch_size
        self.num_beams = num_beams
        self.num_groups = num_beam_groups
        self.group_size = num_beams // num_beam_groups
        self.max_length = max_length
        self.prompt_length = prompt_length
        self.eos = set(eos_token_ids or [])
        self.eos_first = eos_token_ids[0] if eos_token_ids else None
        self.pad_token_id = pad_token_id
        self.hypotheses = [
            _Hypotheses(self.group_size, length_penalty, early_stopping, max_length)
            for _ in range(batch_size * num_beam_groups)
        ]
        self.done = [False] * (batch_size * num_beam_groups)
        rows = batch_size * self.group_size
        self.beam_indices: list[list[tuple[int, ...]]] | None = (
            [[() for _ in range(rows)] for _ in range(num_beam_groups)] if track_beam_indices else None
        )

    @property
    def is_done(self) -> bool:
        """Every (prompt, group) is done."""
        return all(self.done)

    def group_rows(self, group: int) -> list[int]:
        """The model rows of `group` for every prompt, prompt after prompt."""
        start = group * self.group_size
        return [b * self.num_beams + start + i for b in range(self.batch_size) for i in range(self.group_size)]

    def process(
        self,
        group: int,
        group_ids: torch.Tensor,
        scores: torch.Tensor,
        tokens: torch.Tensor,
        parents: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        One group's step.

        Args:
            group (`int`): the group.
            group_ids (`torch.LongTensor` of shape `(batch * group_size, cur_len)`): its rows' tokens.
            scores, tokens, parents (`torch.Tensor` of shape `(batch, K)`): the best candidates' accumulated
                scores, tokens and group-local parent beams, best first.

        Returns:
            `(next scores, next tokens, next group-local rows)`, each of shape `(batch * group_size,)`.
        """
        size = self.group_size
        cur_len = group_ids.shape[-1] + 1
        next_scores = torch.zeros((self.batch_size, size), dtype=scores.dtype, device=scores.device)
        next_tokens = torch.zeros((self.batch_size, size), dtype=tokens.dtype, device=tokens.device)
        next_rows = torch.zeros((self.batch_size, size), dtype=parents.dtype, device=parents.device)
        indices = self.beam_indices[group] if self.beam_indices is not None else None
        # 4.55.4 looks up a finished hypothesis' history in the list of every group's rows by its group-local
        # row, so for groups after the first it reads the first group's: kept, it is in the contract.
        flat = sum(self.beam_indices, []) if self.beam_indices is not None else None
        for b in range(self.batch_size):
            slot = b * self.num_groups + group
            if self.done[slot]:
                next_tokens[b, :] = self.pad_token_id
                continue
            kept = 0
            ranked = zip(tokens[b].tolist(), scores[b], parents[b].tolist(), strict=True)
            for rank, (token, score, parent) in enumerate(ranked):
                row = b * size + parent
                if token in self.eos:
                    if rank >= size:
                        continue
                    beam_index = flat[row] + (row,) if flat is not None else None
                    self.hypotheses[slot].add(
                        group_ids[row].clone(), score.item(), beam_index, cur_len - self.prompt_length, FinishReason.EOS
                    )
                else:
                    next_scores[b, kept], next_tokens[b, kept], next_rows[b, kept] = score, token, row
                    kept += 1
                if kept == size:
                    break
            self.done[slot] = self.done[slot] or self.hypotheses[slot].is_done(
                scores[b].max().item(), cur_len, self.prompt_length
            )
        rows = next_rows.view(-1)
        if indices is not None:
            self.beam_indices[group] = [indices[r] + (r,) for r in rows.tolist()]  # type: ignore[index]
        return next_scores.view(-1), next_tokens.view(-1), rows

    def finalize(
        self, input_ids: torch.Tensor, beam_scores: torch.Tensor, end_codes: torch.Tensor, num_return_sequences: int
    ) -> GroupBeamOutput:
        """
        The best `num_return_sequences` hypotheses per prompt.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch * num_beams, cur_len)`): the running beams.
            beam_scores (`torch.FloatTensor` of shape `(batch * num_beams,)`): their scores.
            end_codes (`torch.LongTensor` of shape `(batch * num_beams,)`): why each running beam stopped
                (0 counts as reaching the length limit).
            num_return_sequences (`int`): hypotheses per prompt.

        Returns:
            `GroupBeamOutput`
        """
        flat_indices = sum(self.beam_indices, []) if self.beam_indices is not None else None
        for slot, hypotheses in enumerate(self.hypotheses):
            if self.done[slot]:
                continue
            for i in range(self.group_size):
                row = slot * self.group_size + i
                tokens = input_ids[row]
                reason = int(end_codes[row]) or FinishReason.LENGTH
                beam_index = flat_indices[row] if flat_indices is not None else None
                hypotheses.add(
                    tokens, beam_scores[row].item(), beam_index, tokens.shape[-1] - self.prompt_length, reason
                )
        best: list[_Hypothesis] = []
        for b in range(self.batch_size):
            groups = self.hypotheses[b * self.num_groups : (b + 1) * self.num_groups]
            ranked = sorted((h for hyps in groups for h in hyps.beams), key=lambda h: h[0])
            best.extend(ranked.pop() for _ in range(num_return_sequences))
        return self._pack(input_ids, best)

    def _pack(self, input_ids: torch.Tensor, best: list[_Hypothesis]) -> GroupBeamOutput:
        """The returned rows, padded and cut as `BeamSearchScorer.finalize` does."""
        lengths = [int(h[1].shape[-1]) for h in best]
        width = min(max(lengths) + 1, self.max_length)
        sequences = input_ids.new_full((len(best), width), self.pad_token_id)
        indices = input_ids.new_full((len(best), width), -1) if self.beam_indices is not None else None
        for i, (_, tokens, beam_index, _) in enumerate(best):
            sequences[i, : lengths[i]] = tokens
            if indices is not None and beam_index is not None:
                indices[i, : len(beam_index)] = torch.tensor(beam_index, dtype=indices.dtype)
            if lengths[i] < width and self.eos_first is not None:
                sequences[i, lengths[i]] = self.eos_first
        return GroupBeamOutput(
            sequences=sequences,
            sequences_scores=torch.tensor([h[0] for h in best], dtype=torch.float32, device=input_ids.device),
            beam_indices=indices,
            # An EOS hypothesis is stored without its EOS; the returned row shows `eos_token_id[0]` after it.
            generated=[
                n - self.prompt_length + int(n < width and h[3] == FinishReason.EOS)
                for n, h in zip(lengths, best, strict=True)
            ],
            reason_codes=[int(h[3]) for h in best],
        )
