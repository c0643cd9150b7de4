"""What the decoding loop hands back: per-step events, the final result, and transition scores.

Field names follow transformers' `GenerateDecoderOnlyOutput` / `GenerateBeamDecoderOnlyOutput`
(`sequences`, `scores`, `logits`, `beam_indices`, `sequences_scores`), so code written against
`model.generate(..., return_dict_in_generate=True)` reads our results unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepEvent:
    """
    What one decoding step added to each output row.

    For greedy and sampling, the output rows are the expanded rows (`batch * num_return_sequences`), and
    `tokens[row]` holds the token appended in this step while the row was still running. Tokens appended
    after a row finished (the pad filler, or free-running tokens when no EOS criterion exists) are part of
    `GenerationResult.sequences` but are not reported here.

    Beam search commits nothing until it ends: its per-step events carry empty token lists, and one last
    event (`final=True`) carries each returned hypothesis' generated tokens and finish reason.

    Args:
        step (`int`):
            Index of the decoding step (0 = the token chosen from the prefill's logits).
        tokens (`list[list[int]]`):
            Per output row, the tokens appended in this step.
        finish_reasons (`list[str | None]`):
            Per output row, the finish reason if the row finished in this step, else `None`.
        final (`bool`, *optional*, defaults to `False`):
            `True` for the event that ends the generation of every row (beam search's summary event).
    """

    step: int
    tokens: list[list[int]]
    finish_reasons: list[str | None]
    final: bool = False

    @property
    def finished(self) -> list[bool]:
        """Per output row, whether it finished in this step."""
        return [reason is not None for reason in self.finish_reasons]


@dataclass
class GenerationResult:
    """
    The result of a generation, with transformers' output field names.

    Args:
        sequences (`torch.LongTensor` of shape `(batch_size * num_return_sequences, sequence_length)`):
            Prompt plus generated tokens; rows that finished early are padded (see `StepEvent` and the loops in
            `specwire.generation.loops`).
        scores (`tuple(torch.Tensor)`, *optional*):
            Processed scores per step, each `(rows, vocab_size)`; rows is `batch * num_return_sequences` for
            greedy/sampling and `batch * num_beams` for beam search (processed log-probabilities, before the
            beam's running score is added). Set only with `return_dict_in_generate` and `output_scores`.
        logits (`tuple(torch.Tensor)`, *optional*):
            Raw float32 logits per step, same shapes as `scores`. Set only with `return_dict_in_generate` and
            `output_logits`.
        beam_indices (`torch.IntTensor` of shape `(batch * num_return_sequences, generated)`, *optional*):
            Beam search only, with `return_dict_in_generate`: for each generated token, the row
            (`item * num_beams + beam`) whose scores produced it; `-1` after the hypothesis ended.
        sequences_scores (`torch.FloatTensor` of shape `(batch_size * num_return_sequences,)`, *optional*):
            Beam search only, with `return_dict_in_generate` and `output_scores`: the length-penalised sum of
            the hypothesis' processed log-probabilities.
        finish_reasons (`list[str]`):
            Per output row: `"eos"`, `"length"`, `"stop_string"` or `"time"`; for beam search, the reason of
            the returned hypothesis.
        prompt_length (`int`):
            Number of prompt positions at the start of every row of `sequences` (padding included).
        attentions (`tuple(tuple(torch.FloatTensor))`, *optional*):
            With `output_attentions` and `return_dict_in_generate`: per step, per layer,
            `[rows, heads, query, key]` (the first step holds the prompt), transformers' layout (beam
            search: every step's running beams).
        hidden_states (`tuple(tuple(torch.FloatTensor))`, *optional*):
            With `output_hidden_states` and `return_dict_in_generate`: per step, per layer (the
            embeddings first), `[rows, query, hidden]`.
    """

    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    beam_indices: torch.Tensor | None = None
    sequences_scores: torch.Tensor | None = None
    finish_reasons: list[str] = field(default_factory=list)
    prompt_length: int = 0
    attentions: tuple[tuple[torch.Tensor, ...], ...] | None = None
    hidden_states: tuple[tuple[torch.Tensor, ...], ...] | None = None

    @property
    def generated_tokens(self) -> torch.Tensor:
        """`sequences` without the prompt: `(rows, sequence_length - prompt_length)`."""
        return self.sequences[:, self.prompt_length :]


def compute_transition_scores(
    sequences: torch.Tensor,
    scores: tuple[torch.Tensor, ...],
    beam_indices: torch.Tensor | None = None,
    normalize_logits: bool = False,
) -> torch.Tensor:
    """
    The score of each generated token at the step that produced it (transformers'
    `GenerationMixin.compute_transition_scores`).

    For greedy and sampling this is the processed score of the chosen token. For beam search, pass
    `beam_indices`: token `t` of a returned row is looked up in the scores row of the beam that produced
    it; positions after the hypothesis ended are `0`. With `normalize_logits=False`,
    `transition_scores.sum(-1) / generated_length ** length_penalty` equals `sequences_scores`.

    Args:
        sequences (`torch.LongTensor` of shape `(rows, sequence_length)`):
            Generated sequences (prompt included).
        scores (`tuple(torch.Tensor)`):
            Per-step scores, each `(score_rows, vocab_size)`.
        beam_indices (`torch.Tensor` of shape `(rows, generated_length)`, *optional*):
            Which scores row produced each token; `-1` marks positions after the end. Defaults to row `i` for
            output row `i` at every step (greedy/sampling).
        normalize_logits (`bool`, *optional*, defaults to `False`):
            Apply `log_softmax` over the vocabulary to every step's scores first.

    Returns:
        `torch.FloatTensor` of shape `(rows, generated_length)`.
    """
    num_steps = len(scores)
    if num_steps == 0:
        return sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)
    vocab_size = scores[0].shape[-1]
    if beam_indices is None:
        # Greedy/sampling: output row i was produced by scores row i at every step.
        beam_indices = torch.arange(scores[0].shape[0], device=sequences.device).view(-1, 1).expand(-1, num_steps)

    # [steps, score_rows, vocab] -> [score_rows * vocab, steps]: one flat column per step, so a single gather
    # picks (row, token) pairs for every step at once.
    stacked = torch.stack(scores)  # [steps, score_rows, vocab]
    if normalize_logits:
        stacked = torch.log_softmax(stacked, dim=-1)
    flat = stacked.reshape(num_steps, -1).transpose(0, 1)  # [score_rows * vocab, steps]

    # The returned hypotheses may be shorter than the number of steps (beam search keeps looking after the
    # best hypothesis ended): only the longest one's length matters.
    ended = beam_indices < 0  # [rows, steps]
    longest = int((~ended).long().sum(-1).max())
    rows_of = beam_indices[:, :longest].clone().long()
    ended = ended[:, :longest]
    rows_of[ended] = 0  # any valid row; masked to 0 below

    generated = sequences[:, sequences.shape[-1] - longest :]  # [rows, longest]
    flat_index = generated + rows_of * vocab_size
    transition = flat.gather(0, flat_index)  # [rows, longest]
    transition[ended] = 0
    return transition


def outputs_wanted(config: Any) -> tuple[bool, bool, bool]:
    """(return_dict, keep scores, keep logits), as transformers' flags combine.

    Args:
        config (`GenerationConfig`):
            The resolved config (`return_dict_in_generate`, `output_scores`, `output_logits`).
    """
    return_dict = bool(config.return_dict_in_generate)
    return return_dict, return_dict and bool(config.output_scores), return_dict and bool(config.output_logits)


__all__ = [
    "GenerationResult",
    "StepEvent",
    "compute_transition_scores",
    "outputs_wanted",
]
