"""Beam search and beam-sample, vectorised over batch items, with transformers 5.23's exact scoring.

Vocabulary. A *batch item* is one prompt; it owns `num_beams` *running beams* (rows of the model
batch, `item * num_beams + beam`) and `num_beams` *finished hypotheses* slots. Each step:

1. Accumulate: `acc[item, beam * V + token] = log_probs[row, token] + running_score[row]`, where
   `log_probs` are the processed log-probabilities of the step.
2. Candidates: the best `K = max(2, 1 + n_eos) * num_beams` entries of `acc` per item (beam-sample
   draws them without replacement from `softmax(acc)` instead). `K > num_beams` keeps enough
   candidates alive when the best ones all end here.
3. Stopping criteria run on every candidate sequence (EOS, max length, stop strings, time).
4. Running beams for the next step: the best `num_beams` candidates that did not hit a criterion.
5. Finished hypotheses: candidates among the first `num_beams` of `K` that hit a criterion, scored
   `acc / generated_length ** length_penalty` (generated length counts the final token), are merged
   with the existing slots and the best `num_beams` are kept. Nothing is added once all slots are
   full under `early_stopping=True`, or once the early-stop heuristic says no running beam can win.
6. The early-stop heuristic (sticky per item) compares the best running score, divided by the best
   length it could still reach (`max_length - prompt` for `early_stopping="never"` with a positive
   `length_penalty`, else the current length), with the worst finished score.

Generation ends when no item can improve, or when every slot of every item is full under
`early_stopping=True`, or when every candidate of the step hit a criterion (e.g. `max_length`).
The returned rows are the first `num_return_sequences` slots of each item (slots stay sorted by
score), cropped to the longest returned hypothesis. Constants such as `-1e9` for "impossible" and
the order of the additions are part of the contract: they decide ties exactly as transformers does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specwire.generation.sampling import sample_without_replacement

# Score given to impossible choices (unused beams at step 0, ended candidates, blocked slots).
IMPOSSIBLE = -1.0e9

# Per-candidate stopping: (sequences [rows, cur_len + 1]) -> reason codes [rows] (0 = keep going).
StopCodes = Callable[[torch.Tensor], torch.Tensor]


def _take_beams(tensor: torch.Tensor, beam_index: torch.Tensor) -> torch.Tensor:
    """`tensor[item, beam_index[item, j], ...]` for every item and j: [B, n, ...] x [B, m] -> [B, m, ...]."""
    index = beam_index
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


@dataclass
class BeamOutput:
    """
    The returned hypotheses of a finished beam search.

    Args:
        sequences (`torch.LongTensor` of shape `(batch * num_return_sequences, prompt + generated)`):
            Prompt and hypothesis tokens; unused tail positions hold the fill value.
        sequences_scores (`torch.FloatTensor` of shape `(batch * num_return_sequences,)`):
            Length-penalised scores.
        beam_indices (`torch.IntTensor` of shape `(batch * num_return_sequences, generated)`):
            Producing row per generated token, `-1` after the end.
        reason_codes (`torch.LongTensor` of shape `(batch * num_return_sequences,)`):
            Stopping reason code of each hypothesis (0 where a slot was never filled).
    """

    sequences: torch.Tensor
    sequences_scores: torch.Tensor
    beam_indices: torch.Tensor
    reason_codes: torch.Tensor


class BeamSearch:
    """
    The state of a beam search over `batch` items, advanced one step at a time.

    The model is not called here: the decoding loop feeds each step's processed log-probabilities to
    `step`, which returns, for every running row, the row it continues (to reorder the KV cache).

    Args:
        prompt_ids (`torch.LongTensor` of shape `(batch * num_beams, prompt_length)`):
            Prompts already repeated `num_beams` times per item.
        num_beams (`int`):
            Beams per item (> 1).
        max_length (`int`):
            Total length (prompt + generated) at which every candidate is stopped.
        num_eos (`int`):
            Number of EOS ids (sizes the candidate pool).
        length_penalty (`float`):
            Exponent of the generated length dividing finished scores.
        early_stopping (`bool` or `"never"`):
            transformers' `early_stopping`.
        do_sample (`bool`):
            Beam-sample: draw candidates from `softmax(acc)` instead of taking the top ones.
        fill_value (`int`):
            Token id written in positions that were never generated.
    """

    def __init__(
        self,
        prompt_ids: torch.Tensor,
        *,
        num_beams: int,
        max_length: int,
        num_eos: int,
        length_penalty: float,
        early_stopping: bool | str,
        do_sample: bool,
        fill_value: int,
    ):
        rows, prompt_length = prompt_ids.shape
        if num_beams < 2 or rows % num_beams:
            raise ValueError(f"beam search needs num_beams >= 2 and rows divisible by it, got {num_beams} / {rows}")
        device = prompt_ids.device
        self.batch_size = rows // num_beams
        self.num_beams = num_beams
        self.prompt_length = prompt_length
        self.max_length = max_length
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.do_sample = do_sample
        self.num_candidates = max(2, 1 + num_eos) * num_beams
        self.cur_len = prompt_length
        self.done = False

        batch = self.batch_size
        # Only the first `num_beams` candidates may become finished hypotheses; the rest are spares.
        self._top_mask = torch.zeros(self.num_candidates, dtype=torch.bool, device=device)
        self._top_mask[:num_beams] = True

        self.running = torch.full((batch, num_beams, max_length), fill_value, dtype=torch.long, device=device)
        self.running[:, :, :prompt_length] = prompt_ids.view(batch, num_beams, prompt_length)
        self.finished = self.running.clone()
        # All beams of an item start identical: only beam 0 may expand at the first step, or the item would
        # pick the same token num_beams times.
        self.running_scores = torch.zeros((batch, num_beams), dtype=torch.float32, device=device)
        self.running_scores[:, 1:] = IMPOSSIBLE
        self.finished_scores = torch.full((batch, num_beams), IMPOSSIBLE, dtype=torch.float32, device=device)
        self.is_finished = torch.zeros((batch, num_beams), dtype=torch.bool, device=device)
        self.finished_reasons = torch.zeros((batch, num_beams), dtype=torch.long, device=device)
        self.improvable = torch.ones((batch, 1), dtype=torch.bool, device=device)
        generated_room = max_length - prompt_length
        self.running_beam_indices = torch.full((batch, num_beams, generated_room), -1, dtype=torch.int32, device=device)
        self.finished_beam_indices = self.running_beam_indices.clone()

    def running_sequences(self) -> torch.Tensor:
        """The running beams' tokens so far: `(batch * num_beams, cur_len)`."""
        return self.running[:, :, : self.cur_len].reshape(self.batch_size * self.num_beams, self.cur_len)

    def last_tokens(self) -> torch.Tensor:
        """The token each running beam appended last: `(batch * num_beams,)`."""
        return self.running[:, :, self.cur_len - 1].reshape(-1)

    def step(
        self, log_probs: torch.Tensor, stop_codes: StopCodes, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """
        Advances every item by one token.

        Args:
            log_probs (`torch.FloatTensor` of shape `(batch * num_beams, vocab_size)`):
                Processed log-probabilities of the step.
            stop_codes (`Callable`):
                Maps candidate sequences `(batch * K, cur_len + 1)` to stopping reason codes `(batch * K,)`,
                0 meaning "not stopped".
            generator (`torch.Generator`, *optional*):
                Randomness for beam-sample.

        Returns:
            `torch.LongTensor` of shape `(batch * num_beams,)`: for each new running row, the model row it
            continues (reorder the KV cache with it).
        """
        batch, beams, k = self.batch_size, self.num_beams, self.num_candidates
        vocab_size = log_probs.shape[-1]
        cur_len, prompt_length = self.cur_len, self.prompt_length

        accumulated = log_probs.reshape(batch, beams, vocab_size) + self.running_scores[:, :, None]
        accumulated = accumulated.reshape(batch, beams * vocab_size)  # [B, nb * V]

        # 1. Candidate continuations, across all beams of an item at once.
        if self.do_sample:
            flat_index = sample_without_replacement(accumulated, k, generator)  # [B, K]
            candidate_scores = torch.gather(accumulated, 1, flat_index)
        else:
            candidate_scores, flat_index = torch.topk(accumulated, k=k)
        parent = flat_index // vocab_size  # [B, K] beam within the item
        token = flat_index % vocab_size
        candidates = _take_beams(self.running, parent)  # [B, K, max_length]
        candidates[:, :, cur_len] = token
        candidate_beam_indices = _take_beams(self.running_beam_indices, parent)
        item_offset = torch.arange(batch, device=parent.device).view(-1, 1) * beams
        candidate_beam_indices[:, :, cur_len - prompt_length] = (parent + item_offset).to(torch.int32)

        # 2. Which candidates end here (EOS, max_length, stop string, time).
        codes = stop_codes(candidates[:, :, : cur_len + 1].reshape(batch * k, cur_len + 1)).view(batch, k)
        hits = codes != 0

        # 3. Next running beams: best candidates that can continue.
        alive_scores = candidate_scores + hits.to(torch.float32) * IMPOSSIBLE
        keep = torch.topk(alive_scores, k=beams)[1]
        self.running = _take_beams(candidates, keep)
        self.running_scores = _take_beams(alive_scores, keep)
        self.running_beam_indices = _take_beams(candidate_beam_indices, keep)

        # 4. Finished hypotheses: merge the new ones into the sorted slots.
        just_finished = hits & self._top_mask[None, :]
        ended_scores = candidate_scores / ((cur_len + 1 - prompt_length) ** self.length_penalty)
        slots_full = torch.all(self.is_finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        ended_scores += slots_full.to(torch.float32) * IMPOSSIBLE
        ended_scores += (~self.improvable).to(torch.float32) * IMPOSSIBLE
        ended_scores += (~just_finished) * IMPOSSIBLE
        merged_scores = torch.cat((self.finished_scores, ended_scores), dim=1)
        best = torch.topk(merged_scores, k=beams)[1]
        self.finished = _take_beams(torch.cat((self.finished, candidates), dim=1), best)
        self.finished_scores = _take_beams(merged_scores, best)
        self.finished_beam_indices = _take_beams(
            torch.cat((self.finished_beam_indices, candidate_beam_indices), dim=1), best
        )
        self.is_finished = _take_beams(torch.cat((self.is_finished, just_finished), dim=1), best)
        self.finished_reasons = _take_beams(torch.cat((self.finished_reasons, codes), dim=1), best)

        parent_rows = self.running_beam_indices[:, :, cur_len - prompt_length].reshape(-1).long()

        # 5. Can anything still change the result?
        self.cur_len = cur_len + 1
        self._update_improvable()
        all_slots_full = bool(torch.all(self.is_finished)) and self.early_stopping is True
        self.done = not bool(torch.any(self.improvable)) or all_slots_full or bool(torch.all(hits))
        return parent_rows

    def _update_improvable(self) -> None:
        """Early-stop heuristic: can the best running beam still beat the worst finished hypothesis?"""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_length
        else:
            best_length = self.cur_len - self.prompt_length
        best_running = self.running_scores[:, :1] / (best_length**self.length_penalty)
        worst_finished = torch.where(
            self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], IMPOSSIBLE
        )
        self.improvable = self.improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)

    def finalize(self, num_return_sequences: int) -> BeamOutput:
        """
        The best `num_return_sequences` hypotheses per item, cropped to the longest one.

        Args:
            num_return_sequences (`int`):
                Hypotheses per item (<= num_beams).

        Returns:
            `BeamOutput`
        """
        n = num_return_sequences
        rows = self.batch_size * n
        sequences = self.finished[:, :n].reshape(rows, -1)
        scores = self.finished_scores[:, :n].reshape(rows)
        beam_indices = self.finished_beam_indices[:, :n].reshape(rows, -1)
        reasons = self.finished_reasons[:, :n].reshape(rows)
        # The loop may have run past the end of every returned hypothesis; -1 marks unused positions.
        generated = int((beam_indices != -1).sum(dim=1).max()) if rows else 0
        return BeamOutput(
            sequences=sequences[:, : self.prompt_length + generated],
            sequences_scores=scores,
            beam_indices=beam_indices[:, :generated],
            reason_codes=reasons,
        )


__all__ = ["IMPOSSIBLE", "BeamOutput", "BeamSearch"]
