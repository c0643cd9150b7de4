"""Speculative verification: which drafted tokens a target accepts, for a batch of rows.

Vocabulary (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding",
arXiv 2211.17192, and transformers' assisted generation), used with these meanings everywhere in
specwire:

- **draft tokens**: the `k` tokens a cheap proposer (a draft model, or prompt lookup) appends after
  a row's current sequence; `x_1..x_k` in the paper. A row may draft fewer than the batch's `k`
  (its *draft length*); `0` is an empty draft.
- **target**: the model whose distribution the output must follow. One target forward over the
  draft gives `k + 1` next-token distributions: `p_1..p_k` for the draft positions and `p_{k+1}`
  after the whole draft. `q_1..q_k` are the draft's own distributions.
- **accepted tokens**: the leading draft tokens the target keeps (`n` of them, `0 <= n <= k`).
- **bonus token**: when all `k` draft tokens are accepted, the extra token drawn from the target's
  distribution after the draft (`p_{k+1}`); a verification round therefore emits up to `k + 1`.
- **recovered token**: when draft token `n + 1` is rejected, the token the target emits in its
  place: in rejection sampling, drawn from the residual `normalize(max(p_{n+1} - q_{n+1}, 0))`;
  in greedy verification, the target's argmax (the "correction").
- **emitted tokens**: what a round appends to a row: the accepted tokens followed by one bonus or
  recovered token, so every row that is verified gains between 1 and `k + 1` tokens.

Every function here is vectorized over rows and lets each row accept its own number of tokens,
which transformers' `_assisted_decoding` (batch size 1 only) does not. Distributions are passed in
already processed (logits processors and warpers applied), as transformers does.

Random draws and reproducibility: the sampling functions take `generator`, either one
`torch.Generator` shared by the batch, or one per row (a seeded request brings its own). Draws are
made row by row in row order, and a row only draws what it needs: its own draft length of uniforms
first, then one multinomial (the same calls, shapes and order as transformers'
`_speculative_sampling` and its sampled "case 2"). So with per-row generators a row's tokens do not
depend on its batch neighbours, and a single-row call reproduces transformers after
`torch.manual_seed(seed)` on CPU. With one shared generator the batch is reproducible as a whole,
but a row's draws depend on the rows before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specwire.generation.sampling import greedy_tokens

__all__ = [
    "AcceptResult",
    "Generators",
    "crop_at_stops",
    "greedy_accept",
    "rejection_sample",
    "sampled_accept_without_draft_probs",
]

# One generator for the whole batch, one per row (None: torch's default generator), or None.
Generators = torch.Generator | Sequence[torch.Generator | None] | None
EnsembleWeights = float | Sequence[float | None] | None


@dataclass(frozen=True)
class AcceptResult:
    """The outcome of verifying one round of drafts, per row.

    Args:
        num_accepted (`torch.LongTensor` of shape `(rows,)`):
            Number of leading draft tokens the target accepted (`n`); at most the row's draft length.
        emitted (`torch.LongTensor` of shape `(rows, k + 1)`):
            The emitted tokens of each row (accepted tokens, then the bonus or recovered token),
            left-aligned; positions at and after `num_emitted` hold the padding id.
        num_emitted (`torch.LongTensor` of shape `(rows,)`):
            Number of valid tokens in `emitted`: `num_accepted + 1` after verification, possibly
            fewer (even 0 for rows that were not verified) after `crop_at_stops`.
    """

    num_accepted: torch.Tensor  # [rows]
    emitted: torch.Tensor  # [rows, k + 1]
    num_emitted: torch.Tensor  # [rows]

    @property
    def mask(self) -> torch.Tensor:
        """`torch.BoolTensor` of shape `(rows, k + 1)`: True where `emitted` holds a real token."""
        positions = torch.arange(self.emitted.shape[1], device=self.emitted.device)
        return positions[None, :] < self.num_emitted[:, None]

    def tokens(self) -> list[list[int]]:
        """The emitted tokens of every row as Python lists (padding dropped)."""
        return [row[:count] for row, count in zip(self.emitted.tolist(), self.num_emitted.tolist(), strict=True)]


def _check_drafts(draft_tokens: torch.Tensor, draft_lengths: torch.Tensor) -> list[int]:
    """Validate the draft block shapes and return the draft lengths as Python ints."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"`draft_tokens` must have shape [rows, k], got {tuple(draft_tokens.shape)}.")
    rows, k = draft_tokens.shape
    if draft_lengths.shape != (rows,):
        raise ValueError(f"`draft_lengths` must have shape [rows] = [{rows}], got {tuple(draft_lengths.shape)}.")
    # One host sync per round: the per-row loops below need the lengths as Python ints anyway.
    lengths = [int(v) for v in draft_lengths.tolist()]
    if any(length < 0 or length > k for length in lengths):
        raise ValueError(f"`draft_lengths` must lie in [0, k={k}], got {lengths}.")
    return lengths


def _check_target(target: torch.Tensor, rows: int, k: int, name: str) -> None:
    if target.dim() != 3 or target.shape[0] != rows or target.shape[1] != k + 1:
        raise ValueError(
            f"`{name}` must have shape [rows, k + 1, vocab] = [{rows}, {k + 1}, vocab], got {tuple(target.shape)}."
        )


def _row_generators(generator: Generators, rows: int) -> list[torch.Generator | None]:
    if generator is None or isinstance(generator, torch.Generator):
        return [generator] * rows
    generators = list(generator)
    if len(generators) != rows:
        raise ValueError(f"Got {len(generators)} generators for {rows} rows; pass one per row or a single one.")
    return generators


def _row_weights(ensemble_weight: EnsembleWeights, rows: int) -> list[float | None]:
    if ensemble_weight is None or isinstance(ensemble_weight, (int, float)):
        weights = [ensemble_weight] * rows
    else:
        weights = list(ensemble_weight)
        if len(weights) != rows:
            raise ValueError(f"Got {len(weights)} ensemble weights for {rows} rows; pass one per row or a single one.")
    for weight in weights:
        if weight is not None and not 0.0 < weight < 1.0:
            raise ValueError(
                f"`ensemble_weight` must be in the open interval (0.0, 1.0), got {weight}. "
                "Use None for standard (lossless) speculative decoding."
            )
    return [None if weight is None else float(weight) for weight in weights]


def _accept_by_equality(
    draft_tokens: torch.Tensor, lengths: list[int], selected: torch.Tensor, pad_id: int
) -> AcceptResult:
    """Keep drafts up to the first one that differs from the target's own choice at that position.

    `selected[r, i]` (`[rows, k + 1]`) is the token the target picks at position `i`; the emitted
    tokens are `selected[r, : n + 1]`, since the accepted drafts equal the target's picks and
    position `n` holds the correction (or the bonus when `n` is the draft length).
    """
    rows, k = draft_tokens.shape
    device = draft_tokens.device
    lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)  # [rows]
    in_draft = torch.arange(k, device=device)[None, :] < lengths_t[:, None]  # [rows, k]
    matches = (draft_tokens == selected[:, :k]) & in_draft  # [rows, k]
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # [rows]
    num_emitted = num_accepted + 1
    keep = torch.arange(k + 1, device=device)[None, :] < num_emitted[:, None]  # [rows, k + 1]
    emitted = torch.where(keep, selected, torch.full_like(selected, pad_id))
    return AcceptResult(num_accepted=num_accepted, emitted=emitted, num_emitted=num_emitted)


def greedy_accept(
    draft_tokens: torch.Tensor,
    draft_lengths: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    ensemble_weight: EnsembleWeights = None,
    pad_id: int = -1,
) -> AcceptResult:
    """Greedy verification: accept the leading draft tokens that equal the target's argmax.

    For each row, `n` is the number of leading draft tokens equal to the argmax of the target's
    processed scores at their position; the row emits those `n` tokens and the target's argmax at
    position `n` (the bonus token when `n` equals the row's draft length, else the correction). With
    greedy decoding this makes the output identical to plain greedy decoding of the target.

    Args:
        draft_tokens (`torch.LongTensor` of shape `(rows, k)`):
            Draft tokens; positions at and after a row's draft length are ignored (any value).
        draft_lengths (`torch.LongTensor` of shape `(rows,)`):
            Number of drafted tokens per row, in `[0, k]`.
        target_logits (`torch.FloatTensor` of shape `(rows, k + 1, vocab)`):
            Target scores after the logits processors, position `i` computed with the row's first
            `i` draft tokens appended. Only positions up to a row's draft length are read.
        draft_probs (`torch.FloatTensor` of shape `(rows, k, vocab)`, *optional*):
            The draft's processed distributions; needed only with `ensemble_weight`.
        ensemble_weight (`float` or a sequence of `float | None` per row, *optional*):
            transformers' `assistant_ensemble_weight` w in (0, 1) (DIVERSE, arXiv 2604.07622; lossy):
            at draft positions the target's choice becomes `argmax(w * p + (1 - w) * q)`, the
            bonus position still uses the target's argmax. `None` (default) is standard greedy.
        pad_id (`int`, *optional*, defaults to -1):
            Fills `emitted` after each row's emitted tokens.

    Returns:
        `AcceptResult`: `num_accepted`, `emitted` (`[rows, k + 1]`) and `num_emitted = n + 1`.
    """
    lengths = _check_drafts(draft_tokens, draft_lengths)
    rows, k = draft_tokens.shape
    _check_target(target_logits, rows, k, "target_logits")
    selected = greedy_tokens(target_logits)  # [rows, k + 1]

    weights = _row_weights(ensemble_weight, rows)
    if any(weight is not None for weight in weights) and k > 0:
        if draft_probs is None or draft_probs.shape != target_logits[:, :k].shape:
            raise ValueError("`ensemble_weight` needs `draft_probs` of shape [rows, k, vocab].")
        for row, weight in enumerate(weights):
            if weight is None or lengths[row] == 0:
                continue
            length = lengths[row]
            # Same expression as transformers so argmax ties break identically; the row's own
            # bonus position (its draft length) keeps the target's argmax.
            p = target_logits[row : row + 1, :length].softmax(dim=-1)  # [1, length, vocab]
            nu = weight * p + (1.0 - weight) * draft_probs[row : row + 1, :length]
            selected[row, :length] = nu.argmax(dim=-1)[0]
    return _accept_by_equality(draft_tokens, lengths, selected, pad_id)


def sampled_accept_without_draft_probs(
    draft_tokens: torch.Tensor,
    draft_lengths: torch.Tensor,
    target_probs: torch.Tensor,
    generator: Generators = None,
    *,
    pad_id: int = -1,
) -> AcceptResult:
    """Sampled verification of drafts that come without a distribution (prompt lookup).

    transformers' "case 2" with `do_sample=True`: the target samples a token independently at
    every position `0..draft_length` of the row, and the drafts are kept up to the first one that
    differs from the target's sample; the sample at that position is emitted after them. Each
    emitted token is a sample from the target given the tokens before it, so the output follows the
    target distribution exactly (with a lower acceptance rate than `rejection_sample`).

    Args:
        draft_tokens (`torch.LongTensor` of shape `(rows, k)`):
            Draft tokens; positions at and after a row's draft length are ignored.
        draft_lengths (`torch.LongTensor` of shape `(rows,)`):
            Number of drafted tokens per row, in `[0, k]`.
        target_probs (`torch.FloatTensor` of shape `(rows, k + 1, vocab)`):
            The target's processed next-token distributions (softmax of the processed scores).
        generator (`torch.Generator` or a sequence of them per row, *optional*):
            Source of randomness. Row `r` draws one `torch.multinomial` over its first
            `draft_length + 1` positions (transformers' exact call), rows in order.
        pad_id (`int`, *optional*, defaults to -1):
            Fills `emitted` after each row's emitted tokens.

    Returns:
        `AcceptResult` with `num_emitted = num_accepted + 1`.
    """
    lengths = _check_drafts(draft_tokens, draft_lengths)
    rows, k = draft_tokens.shape
    _check_target(target_probs, rows, k, "target_probs")
    generators = _row_generators(generator, rows)
    selected = torch.full((rows, k + 1), pad_id, dtype=torch.long, device=draft_tokens.device)  # [rows, k + 1]
    for row, (length, row_generator) in enumerate(zip(lengths, generators, strict=True)):
        # Only the row's own positions are sampled so its draws do not depend on the batch's k.
        picks = torch.multinomial(target_probs[row, : length + 1], num_samples=1, generator=row_generator)
        selected[row, : length + 1] = picks.squeeze(1)
    return _accept_by_equality(draft_tokens, lengths, selected, pad_id)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_lengths: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: Generators = None,
    *,
    ensemble_weight: EnsembleWeights = None,
    pad_id: int = -1,
) -> AcceptResult:
    """Speculative sampling (Leviathan et al., arXiv 2211.17192, Algorithm 1), row by row.

    For draft positions `i = 1..draft_length`: draw `U_i ~ Uniform[0, 1)` and accept `x_i` while
    `U_i <= p_i(x_i) / q_i(x_i)`. At the first rejection (`n < draft_length`) the recovered token is
    drawn from `normalize(max(p_{n+1} - q_{n+1}, 0))`; if every draft token is accepted, the bonus
    token is drawn from `p_{draft_length + 1}`. The emitted tokens then follow the target
    distribution exactly, whatever the draft distribution.

    The residual can only sum to zero through rounding (for normalized `p` and `q` a rejection
    implies some `p(y) > q(y)`) or with unnormalized draft probabilities; the row then falls back
    to sampling from `p_{n+1}` instead of failing on a NaN distribution (transformers does this
    only with an ensemble weight).

    Args:
        draft_tokens (`torch.LongTensor` of shape `(rows, k)`):
            Draft tokens, each drawn from the matching `draft_probs` row; positions at and after a
            row's draft length are ignored.
        draft_lengths (`torch.LongTensor` of shape `(rows,)`):
            Number of drafted tokens per row, in `[0, k]`. A row with `0` samples from `p_1`.
        draft_probs (`torch.FloatTensor` of shape `(rows, k, vocab)`):
            The draft's processed distributions `q_i` (softmax of its processed scores).
        target_probs (`torch.FloatTensor` of shape `(rows, k + 1, vocab)`):
            The target's processed distributions `p_i`, position `i` computed with the row's first
            `i` draft tokens appended.
        generator (`torch.Generator` or a sequence of them per row, *optional*):
            Source of randomness. Row by row: `torch.rand(draft_length)` uniforms, then one
            `torch.multinomial` for the recovered or bonus token.
        ensemble_weight (`float` or a sequence of `float | None` per row, *optional*):
            transformers' `assistant_ensemble_weight` w in (0, 1) (DIVERSE, arXiv 2604.07622): accept
            with ratio `1 - w + w * p/q`, which biases the output towards the draft (lossy).
            `None` (default) is the lossless rule.
        pad_id (`int`, *optional*, defaults to -1):
            Fills `emitted` after each row's emitted tokens.

    Returns:
        `AcceptResult` with `num_emitted = num_accepted + 1`.
    """
    lengths = _check_drafts(draft_tokens, draft_lengths)
    rows, k = draft_tokens.shape
    _check_target(target_probs, rows, k, "target_probs")
    if draft_probs.shape != (rows, k, target_probs.shape[-1]):
        raise ValueError(
            f"`draft_probs` must have shape [rows, k, vocab] = [{rows}, {k}, {target_probs.shape[-1]}], "
            f"got {tuple(draft_probs.shape)}."
        )
    generators = _row_generators(generator, rows)
    weights = _row_weights(ensemble_weight, rows)
    device = draft_tokens.device

    # Pad positions may hold ids outside the vocabulary; clamp only to gather, they are never read.
    index = draft_tokens.clamp(0, target_probs.shape[-1] - 1).unsqueeze(-1)  # [rows, k, 1]
    q_x = draft_probs.gather(-1, index).squeeze(-1)  # [rows, k]
    p_x = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [rows, k]
    ratio = p_x / q_x  # [rows, k]; p/0 = inf accepts, 0/0 = NaN rejects (as in transformers)
    tiny = torch.finfo(target_probs.dtype).tiny

    num_accepted = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
    last = torch.empty(rows, dtype=torch.long, device=device)  # [rows] recovered or bonus token
    for row in range(rows):
        length = lengths[row]
        accepted, last[row] = _rejection_sample_row(
            ratio[row, :length], target_probs[row], draft_probs[row], weights[row], generators[row], tiny
        )
        if accepted is not None:
            num_accepted[row] = accepted

    positions = torch.arange(k + 1, device=device)[None, :]  # [1, k + 1]
    padded_drafts = torch.cat([draft_tokens, draft_tokens.new_full((rows, 1), pad_id)], dim=1)  # [rows, k + 1]
    emitted = torch.where(positions < num_accepted[:, None], padded_drafts, torch.full_like(padded_drafts, pad_id))
    emitted = torch.where(positions == num_accepted[:, None], last[:, None], emitted)
    return AcceptResult(num_accepted=num_accepted, emitted=emitted, num_emitted=num_accepted + 1)


def _rejection_sample_row(
    ratio: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    weight: float | None,
    generator: torch.Generator | None,
    tiny: float,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One row of `rejection_sample`: its accepted count (0-d, `None` for an empty draft) and last token.

    Args:
        ratio (`torch.FloatTensor` of shape `(length,)`): `p_i(x_i) / q_i(x_i)` of the row's drafts.
        p (`torch.FloatTensor` of shape `(k + 1, vocab)`): the row's target distributions.
        q (`torch.FloatTensor` of shape `(k, vocab)`): the row's draft distributions.
        weight (`float`, *optional*): the row's ensemble weight.
        generator (`torch.Generator`, *optional*): the row's randomness.
        tiny (`float`): the smallest positive normal of the probabilities' dtype.
    """
    length = ratio.shape[0]
    if length == 0:
        # Nothing to verify: the row is a plain sampling step from p_1.
        distribution = p[:1]  # [1, vocab]
        accepted = None
    else:
        if weight is not None:
            # Scalar arithmetic as transformers does it (Python float w), so acceptances match.
            ratio = 1.0 - weight + weight * ratio
        uniforms = torch.rand(length, generator=generator, dtype=ratio.dtype, device=ratio.device)
        accepted = (uniforms <= ratio).long().cumprod(dim=0).sum()  # 0-d, no host sync
        p_next = p.index_select(0, accepted.view(1))  # [1, vocab]
        q_next = q.index_select(0, accepted.clamp(max=length - 1).view(1))  # [1, vocab]
        residual = torch.clamp(p_next - q_next, min=0)
        residual_sum = residual.sum()
        recovered = torch.where(residual_sum > tiny, residual / residual_sum, p_next)
        distribution = torch.where(accepted < length, recovered, p_next)
    return accepted, torch.multinomial(distribution, num_samples=1, generator=generator).view(())


def crop_at_stops(
    result: AcceptResult,
    stop_fn: Callable[[int], torch.Tensor],
    *,
    pad_id: int = -1,
) -> tuple[AcceptResult, torch.Tensor]:
    """Cut each row's emitted block just after the first token at which a stopping criterion fires.

    transformers 5.23 crops an accepted block only at `max_length` and the first EOS (and says so in
    a comment); evaluating the request's whole stopping criteria after every prefix of the block
    also cuts at stop strings, time limits and custom criteria, so a speculative row stops exactly
    where a plain decoding row would.

    Args:
        result (`AcceptResult`):
            The verified block; rows with `num_emitted == 0` (not verified this round) are left alone.
        stop_fn (`Callable[[int], torch.Tensor]`):
            `stop_fn(j)` is called for `j = 1, 2, ...` up to the largest `num_emitted` (stopping
            early once every row has stopped or run out of tokens). It must say, per row, whether a
            stopping criterion fires once the row's first `j` emitted tokens are appended to its
            sequence: a `torch.Tensor` of shape `(rows,)`, bool or integer finish-reason codes
            (non-zero = stop, e.g. `StoppingCriteriaList.finish_reasons`). Entries of rows that
            have fewer than `j` tokens, or that already stopped, are ignored. Typically
            `lambda j: criteria.finish_reasons(torch.cat([input_ids, emitted[:, :j].clamp(min=0)], 1),
            scores[:, j - 1])`, where `scores` holds the processed target scores of the block.
        pad_id (`int`, *optional*, defaults to -1):
            Written over the tokens that are cut.

    Returns:
        `tuple(AcceptResult, torch.Tensor)`: the cropped block (`num_emitted` = the stop
        position; `num_accepted` lowered to `num_emitted - 1` where the cut falls inside the
        accepted drafts, as transformers recounts it) and the finish code per row (`0` where no
        criterion fired, `1` for a bool `stop_fn`).
    """
    rows = result.emitted.shape[0]
    device = result.emitted.device
    num_emitted = result.num_emitted.clone()
    finish = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)  # [rows]
    longest = int(num_emitted.max()) if rows else 0
    for j in range(1, longest + 1):
        live = ~stopped & (num_emitted >= j)  # [rows]
        if not bool(live.any()):
            break
        codes = stop_fn(j).to(device)  # [rows]
        fires = live & (codes != 0)
        finish = torch.where(fires, codes.long(), finish)
        num_emitted = torch.where(fires, torch.full_like(num_emitted, j), num_emitted)
        stopped |= fires
    num_accepted = torch.where(stopped, torch.minimum(result.num_accepted, num_emitted - 1), result.num_accepted)
    positions = torch.arange(result.emitted.shape[1], device=device)[None, :]
    emitted = torch.where(positions < num_emitted[:, None], result.emitted, torch.full_like(result.emitted, pad_id))
    return AcceptResult(num_accepted=num_accepted, emitted=emitted, num_emitted=num_emitted), finish
