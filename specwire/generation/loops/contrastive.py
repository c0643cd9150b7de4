"""Contrastive search (arXiv 2202.06417), as transformers 4.55.4's `_contrastive_search`.

Each step, the processed logits of every row give the `top_k` most probable next tokens. All of them
run in one forward (the cache repeated `top_k` times per row), and the one with the best
`(1 - penalty_alpha) * probability - penalty_alpha * degeneration penalty` is kept, where the
degeneration penalty is the largest cosine similarity between the candidate's last-layer hidden state
and those of the row's earlier positions (padding excluded). The kept candidate's cache row, hidden
state and logits carry on; the others are dropped.

transformers 5 moved contrastive search to a Hub `custom_generate` repository; 4.55.4 is the last
release with it in core and its outputs are the contract (tests/parity/goldens). One token per row per
step, so it streams like greedy search. It needs the hidden states of every forward and a cache it can
repeat and select from, which `RowBatch` offers: it runs in the target's sequential lane.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from specwire.generation.loops.sample import StepStops
from specwire.generation.loops.stop_codes import StopCodes, reason_names
from specwire.generation.outputs import GenerationResult, StepEvent, outputs_wanted
from specwire.generation.planning import GenerationPlan
from specwire.generation.rows import RowBatch
from specwire.vocabulary import FINISH_LENGTH

__all__ = ["contrastive_loop", "rank_candidates"]


def rank_candidates(
    context_hidden: torch.Tensor,
    next_hidden: torch.Tensor,
    top_k_probs: torch.Tensor,
    context_mask: torch.Tensor,
    alpha: float,
    top_k: int,
) -> torch.Tensor:
    """
    The candidate each row keeps: the best contrastive score (transformers 4.55.4's `_ranking_fast`).

    Args:
        context_hidden (`torch.FloatTensor` of shape `(rows * top_k, positions, hidden)`):
            Last-layer hidden states of every earlier position, repeated per candidate.
        next_hidden (`torch.FloatTensor` of shape `(rows * top_k, 1, hidden)`):
            Each candidate's last-layer hidden state.
        top_k_probs (`torch.FloatTensor` of shape `(rows, top_k)`):
            The candidates' probabilities.
        context_mask (`torch.LongTensor` of shape `(rows * top_k, positions)`):
            0 on padding, which never counts as similar.
        alpha (`float`):
            `penalty_alpha`.
        top_k (`int`):
            Candidates per row.

    Returns:
        `torch.LongTensor` of shape `(rows,)`: the kept candidate of each row.
    """
    norm_context = context_hidden / context_hidden.norm(dim=2, keepdim=True)
    norm_next = next_hidden / next_hidden.norm(dim=2, keepdim=True)
    cosine = torch.matmul(norm_context, norm_next.transpose(1, 2)).squeeze(-1)  # [rows * top_k, positions]
    mask = context_mask.to(dtype=cosine.dtype)
    cosine = cosine + (1 - mask) * torch.finfo(cosine.dtype).min
    degeneration_penalty, _ = torch.max(cosine, dim=-1)  # [rows * top_k]
    score = (1.0 - alpha) * top_k_probs.view(-1) - alpha * degeneration_penalty
    return torch.stack(torch.split(score, top_k)).max(dim=-1)[1]


def contrastive_loop(
    plan: GenerationPlan,
    rows: RowBatch,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    processors: Any,
    stop_codes: StopCodes,
) -> Generator[StepEvent, None, GenerationResult]:
    """Contrastive search over `rows` (a `RowBatch` keeping hidden states, one row per prompt)."""
    config = plan.config
    return_dict, keep_scores, keep_logits = outputs_wanted(config)
    names = reason_names()
    scores: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    raw_logits: tuple[torch.Tensor, ...] | None = () if keep_logits else None
    top_k, alpha = int(config.top_k), float(config.penalty_alpha)
    num_rows = input_ids.shape[0]
    device = input_ids.device
    running = torch.ones(num_rows, dtype=torch.bool, device=device)
    reason_codes = torch.zeros(num_rows, dtype=torch.long, device=device)
    pad_finished = plan.eos_token_ids is not None and plan.pad_token_id is not None
    pad = torch.tensor(plan.pad_token_id if pad_finished else 0, device=device)
    repeat = torch.arange(num_rows, device=device).repeat_interleave(top_k)  # [rows * top_k]
    offsets = torch.arange(num_rows, device=device) * top_k

    logits = rows.prefill(input_ids)  # [rows, V]
    context = rows.hidden_states.pop()[-1]  # [rows, prompt, hidden]
    context_mask = attention_mask.to(device).repeat_interleave(top_k, dim=0)
    step = 0
    while True:
        with torch.no_grad():
            processed = rows.process([(processors, input_ids, logits)])[0]  # [rows, V]
            top_k_probs, top_k_ids = torch.topk(torch.softmax(processed, dim=-1), dim=-1, k=top_k)
            if keep_logits:
                assert raw_logits is not None  # a tuple whenever keep_logits
                raw_logits += (logits,)
            if keep_scores:
                assert scores is not None  # a tuple whenever keep_scores
                scores += (processed,)
            rows.reorder(repeat)
            candidate_logits = rows.decode(top_k_ids.view(-1))  # [rows * top_k, V]
            next_hidden = rows.hidden_states.pop()[-1]  # [rows * top_k, 1, hidden]
            context_hidden = context.repeat_interleave(top_k, dim=0)
            selected = rank_candidates(context_hidden, next_hidden, top_k_probs, context_mask, alpha, top_k)
            context_mask = torch.cat([context_mask, context_mask.new_ones((context_mask.shape[0], 1))], dim=-1)
            kept = selected.to(device) + offsets  # [rows] rows of the candidate batch
            tokens = top_k_ids[torch.arange(num_rows, device=device), selected]
            context = torch.cat([context, next_hidden[kept]], dim=1)
            rows.reorder(kept)
            logits = candidate_logits[kept]
            if pad_finished:
                tokens = torch.where(running, tokens, pad)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
            step_stops = StepStops.after(stop_codes(input_ids, scores), running)
            reason_codes = torch.where(step_stops.newly, step_stops.codes, reason_codes)
            running = step_stops.running

        event = step_stops.event(step, tokens, names)
        yield event
        if event.final:
            break
        step += 1

    finish = [names.get(code, FINISH_LENGTH) for code in reason_codes.tolist()]
    return GenerationResult(
        sequences=input_ids,
        scores=scores if return_dict else None,
        logits=raw_logits if return_dict else None,
        finish_reasons=finish,
        prompt_length=plan.input_len,
    )
