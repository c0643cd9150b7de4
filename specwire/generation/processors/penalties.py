"""Penalties that depend on what the row (or its prompt) already contains, and the EOS length decay."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .base import token_id_list


def _check_penalty(penalty: float, name: str) -> None:
    # transformers rejects ints here (`2` instead of `2.0`); we keep that so configs behave the same.
    if isinstance(penalty, bool) or not isinstance(penalty, float) or not penalty > 0:
        raise ValueError(
            f"`{name}` has to be a strictly positive float, but is {penalty!r}. Pass a float such as 1.2 "
            "(1.0 disables it)."
        )


def _presence_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[rows, vocab]` mask of the ids present in each row; ids >= vocab (the discard marker) are dropped."""
    rows = ids.shape[0]
    # One spare column absorbs out-of-vocabulary ids and the "ignored position" marker.
    mask = torch.zeros((rows, vocab_size + 1), dtype=torch.bool, device=ids.device)
    mask.scatter_(1, ids.clamp(max=vocab_size), True)
    return mask[:, :vocab_size]


class RepetitionPenaltyLogitsProcessor:
    r"""Penalises every token already present in the row, once per distinct token (CTRL, arXiv 1909.05858).

    A score `s` of a present token becomes `s * penalty` if `s < 0` and `s / penalty` otherwise, so
    `penalty > 1` discourages repetition and `penalty < 1` encourages it.

    Args:
        penalty (`float`):
            Strictly positive; 1.0 is a no-op.
        prompt_ignore_length (`int` or `torch.LongTensor` of shape `(rows,)`, *optional*):
            Leading positions not to penalise: an `int` for every row, or one count per row (the
            left-padding length of each row, so pad tokens are not penalised). Defaults to none.
    """

    def __init__(self, penalty: float, prompt_ignore_length: int | torch.Tensor | None = None):
        _check_penalty(penalty, "repetition_penalty")
        if isinstance(prompt_ignore_length, torch.Tensor):
            if prompt_ignore_length.dim() != 1:
                raise ValueError(
                    "`prompt_ignore_length` must be a 1-D tensor with one count per row, but has shape "
                    f"{tuple(prompt_ignore_length.shape)}."
                )
        elif prompt_ignore_length is not None and (
            not isinstance(prompt_ignore_length, numbers.Integral) or prompt_ignore_length < 0
        ):
            raise ValueError(
                f"`prompt_ignore_length` has to be a non-negative integer or a 1-D tensor, but is "
                f"{prompt_ignore_length!r}."
            )
        self.penalty = penalty
        self.prompt_ignore_length = prompt_ignore_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        ids = input_ids  # [rows, cur_len]
        ignore = self.prompt_ignore_length
        if isinstance(ignore, torch.Tensor):
            if ignore.shape[0] != ids.shape[0]:
                raise ValueError(
                    f"`prompt_ignore_length` has {ignore.shape[0]} rows but `input_ids` has {ids.shape[0]}: "
                    "give one count per processed row (after expanding for beams / returned sequences)."
                )
            positions = torch.arange(ids.shape[1], device=ids.device)  # [cur_len]
            # Ignored positions get the id `vocab`, which lands in the discarded spare column.
            ids = ids.masked_fill(positions[None, :] < ignore.to(ids.device)[:, None], vocab)
        elif ignore is not None:
            ids = ids[:, int(ignore) :]
        present = _presence_mask(ids, vocab)  # [rows, vocab]
        penalised = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(present, penalised, scores)


class EncoderRepetitionPenaltyLogitsProcessor:
    r"""Hallucination penalty: tokens present in the encoder input (the prompt, for decoder-only models).

    The penalty is inverted (`1 / penalty` is applied like a repetition penalty), so `penalty > 1`
    *boosts* tokens from the source text and `penalty < 1` discourages them.

    Args:
        penalty (`float`):
            Strictly positive; 1.0 is a no-op.
        encoder_input_ids (`torch.LongTensor` of shape `(batch, src_len)`):
            The source ids; rows are repeated to match `rows` when the scores hold several
            hypotheses per batch item (`rows = batch * k`, hypotheses of one item adjacent).
    """

    def __init__(self, penalty: float, encoder_input_ids: torch.Tensor):
        _check_penalty(penalty, "encoder_repetition_penalty")
        if encoder_input_ids.dim() != 2:
            raise ValueError(
                f"`encoder_input_ids` must be 2-D `[batch, src_len]`, but has shape {tuple(encoder_input_ids.shape)}."
            )
        # transformers stores the inverse and applies it as a repetition penalty; same float ops here.
        self.penalty = 1 / penalty
        self.encoder_input_ids = encoder_input_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows, vocab = scores.shape
        source = self.encoder_input_ids.to(scores.device)  # [batch, src_len]
        if rows > source.shape[0]:
            source = source.repeat_interleave(rows // source.shape[0], dim=0)  # [rows, src_len]
        present = _presence_mask(source, vocab)  # [rows, vocab]
        penalised = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(present, penalised, scores)


def _check_ngram_size(size: int, name: str) -> None:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size <= 0:
        raise ValueError(f"`{name}` has to be a strictly positive integer (0 disables it), but is {size!r}.")


def _ban(scores: torch.Tensor, candidates: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """Set `scores[r, candidates[r, w]] = -inf` where `hit[r, w]`; `candidates`, `hit`: `[rows, windows]`."""
    vocab = scores.shape[-1]
    banned = torch.zeros((scores.shape[0], vocab + 1), dtype=torch.bool, device=scores.device)
    banned.scatter_(1, torch.where(hit, candidates.clamp(max=vocab), vocab), True)
    return scores.masked_fill(banned[:, :vocab], -float("inf"))


class NoRepeatNGramLogitsProcessor:
    r"""Forbids any n-gram from occurring twice in a row (prompt included), as in fairseq.

    The last `ngram_size - 1` tokens are looked up among every earlier window of the row; each
    token that completed such a window is banned (`-inf`).

    Args:
        ngram_size (`int`):
            Strictly positive n-gram length.
    """

    def __init__(self, ngram_size: int):
        _check_ngram_size(ngram_size, "no_repeat_ngram_size")
        self.ngram_size = int(ngram_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n = self.ngram_size
        cur_len = input_ids.shape[-1]
        if cur_len < n:
            return scores
        windows = input_ids.unfold(1, n, 1)  # [rows, cur_len - n + 1, n]
        context = input_ids[:, cur_len - n + 1 :]  # [rows, n - 1]
        hit = (windows[..., :-1] == context[:, None, :]).all(dim=-1)  # [rows, windows]
        return _ban(scores, windows[..., -1], hit)


class EncoderNoRepeatNGramLogitsProcessor:
    r"""Forbids n-grams of the encoder input (the prompt, for decoder-only models) from being repeated.

    Args:
        encoder_ngram_size (`int`):
            Strictly positive n-gram length.
        encoder_input_ids (`torch.LongTensor` of shape `(batch, src_len)` or `(src_len,)`):
            The source ids. Row `r` of the scores uses source row `r // (rows // batch)`.
    """

    def __init__(self, encoder_ngram_size: int, encoder_input_ids: torch.Tensor):
        _check_ngram_size(encoder_ngram_size, "encoder_no_repeat_ngram_size")
        self.ngram_size = int(encoder_ngram_size)
        if encoder_input_ids.dim() == 1:
            encoder_input_ids = encoder_input_ids.unsqueeze(0)
        self.batch_size = encoder_input_ids.shape[0]
        n = self.ngram_size
        # Source windows are fixed for the whole generation: build them once.
        if encoder_input_ids.shape[1] >= n:
            self._windows: torch.Tensor | None = encoder_input_ids.unfold(1, n, 1)  # [batch, windows, n]
        else:
            self._windows = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n = self.ngram_size
        cur_len = input_ids.shape[-1]
        # With fewer than n-1 tokens no source n-gram can be completed yet.
        if self._windows is None or cur_len < n - 1:
            return scores
        rows = scores.shape[0]
        per_item = rows // self.batch_size
        item = torch.arange(rows, device=scores.device) // per_item  # [rows]
        windows = self._windows.to(scores.device)[item]  # [rows, windows, n]
        context = input_ids[:, cur_len - n + 1 :].to(scores.device)  # [rows, n - 1]
        hit = (windows[..., :-1] == context[:, None, :]).all(dim=-1)  # [rows, windows]
        return _ban(scores, windows[..., -1], hit)


class ExponentialDecayLengthPenalty:
    r"""Raises the EOS scores exponentially once `start_index` new tokens have been generated.

    At length `cur_len > start = start_index + input_len`, each EOS score `s` gets
    `|s| * (decay_factor ** (cur_len - start) - 1)` added (nothing for non-finite `s`).

    Args:
        exponential_decay_length_penalty (`tuple[int, float]`):
            `(start_index, decay_factor)`; a factor > 1 makes EOS more likely over time.
        eos_token_id (`int`, `list[int]` or `torch.Tensor`):
            The end-of-sequence id(s).
        input_ids_seq_length (`int`):
            The prompt length (`input_len`).
    """

    # Declared here: mypy reads everything after the `numbers.Real` isinstance checks in `__init__` as
    # unreachable (typeshed does not register `float` as `numbers.Real`).
    regulation_start: float
    regulation_factor: float
    eos_token_id: torch.Tensor

    def __init__(
        self,
        exponential_decay_length_penalty: Sequence[float],
        eos_token_id: int | list[int] | torch.Tensor,
        input_ids_seq_length: int,
    ):
        value = exponential_decay_length_penalty
        if (
            not isinstance(value, Sequence)
            or len(value) != 2
            or not isinstance(value[0], numbers.Real)
            or not isinstance(value[1], numbers.Real)
        ):
            raise ValueError(
                "`exponential_decay_length_penalty` has to be a pair `(start_index, decay_factor)`, e.g. "
                f"(10, 1.05), but is {value!r}."
            )
        self.regulation_start = value[0] + input_ids_seq_length
        self.regulation_factor = value[1]
        self.eos_token_id = torch.tensor(token_id_list(eos_token_id, "eos_token_id"), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cur_len = input_ids.shape[-1]
        if not cur_len > self.regulation_start:
            return scores
        eos = self.eos_token_id.to(scores.device)
        eos_scores = scores[:, eos]  # [rows, n_eos]
        boost = eos_scores.abs() * (self.regulation_factor ** (cur_len - self.regulation_start) - 1)
        boost = boost.masked_fill(~torch.isfinite(eos_scores), 0.0)
        # A full-width addend (zeros elsewhere) keeps the float results identical to transformers'.
        addend = torch.zeros_like(scores)  # [rows, vocab]
        addend[:, eos] = boost
        return scores + addend
