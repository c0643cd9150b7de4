"""Diverse (group) beam search over `batch * num_beams` rows, as transformers 4.55.4's `_group_beam_search`.

One forward per step for every row; then the groups pick their tokens one after the other (see
`group_beam_search.py` for the bookkeeping, `processors/diversity.py` for the penalty). The processors
run on every row once per group, with the Hamming penalty told which group is picking: processors are
row-wise, so a group's rows come out as transformers computes them on that group alone, and rows keep
their per-row state (padding lengths) in place. Like beam search, nothing is committed before the end.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, cast

import torch

from specwire.generation.loops.group_beam_search import GroupBeamScorer
from specwire.generation.loops.stop_codes import StopCodes, reason_names
from specwire.generation.outputs import GenerationResult, StepEvent, outputs_wanted
from specwire.generation.planning import GenerationPlan
from specwire.generation.processors.diversity import HammingDiversityLogitsProcessor
from specwire.generation.rows import Rows
from specwire.vocabulary import FINISH_LENGTH

__all__ = ["group_beam_loop"]


def group_beam_loop(
    plan: GenerationPlan,
    rows: Rows,
    input_ids: torch.Tensor,
    processors: Any,
    stop_codes: StopCodes,
) -> Generator[StepEvent, None, GenerationResult]:
    """Group beam search over `rows` (`batch * num_beams`); `input_ids` are the expanded prompts."""
    config = plan.config
    return_dict, keep_scores, keep_logits = outputs_wanted(config)
    scores: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    raw_logits: tuple[torch.Tensor, ...] | None = () if keep_logits else None
    num_beams, groups = plan.num_beams, int(config.num_beam_groups)
    eos = plan.eos_token_ids
    scorer = GroupBeamScorer(
        batch_size=input_ids.shape[0] // num_beams,
        num_beams=num_beams,
        num_beam_groups=groups,
        length_penalty=float(config.length_penalty),
        early_stopping=config.early_stopping,
        max_length=plan.max_length,
        prompt_length=plan.input_len,
        eos_token_ids=eos,
        pad_token_id=plan.pad_token_id if plan.pad_token_id is not None else (eos[0] if eos else 0),
        track_beam_indices=bool(return_dict and config.output_scores),
    )
    hamming = next((p for p in processors if isinstance(p, HammingDiversityLogitsProcessor)), None)
    batch, size = scorer.batch_size, scorer.group_size
    # The first beam of each group starts at 0, the others at -1e9, so the group's beams differ.
    beam_scores = torch.full((batch, num_beams), -1e9, dtype=torch.float, device=input_ids.device)
    beam_scores[:, ::size] = 0
    beam_scores = beam_scores.view(-1)
    candidates = max(2, 1 + len(eos or [])) * size
    out_rows = batch * int(config.num_return_sequences)

    logits = rows.prefill(input_ids)  # [batch * num_beams, V]
    step = 0
    while True:
        current_tokens = torch.zeros(batch * num_beams, dtype=input_ids.dtype, device=input_ids.device)
        reorder = torch.zeros(batch * num_beams, dtype=torch.long, device=input_ids.device)
        processed_step = torch.zeros_like(logits, dtype=torch.float32) if keep_scores else None
        if keep_logits:
            assert raw_logits is not None  # a tuple whenever keep_logits
            raw_logits += (logits,)
        next_ids = input_ids.clone()
        with torch.no_grad():
            log_probs = torch.log_softmax(logits.float(), dim=-1)  # [batch * num_beams, V]
            for group in range(groups):
                index = torch.tensor(scorer.group_rows(group), device=input_ids.device)
                if hamming is not None:
                    hamming.set_group(current_tokens, group)
                processed = rows.process([(processors, input_ids, log_probs)])[0][index]  # [batch * size, V]
                if processed_step is not None:
                    processed_step[index] = processed
                vocab_size = processed.shape[-1]
                accumulated = (processed + beam_scores[index].unsqueeze(-1)).view(batch, size * vocab_size)
                top_scores, top = torch.topk(accumulated, candidates, dim=1, largest=True, sorted=True)
                group_ids = input_ids[index]
                new_scores, new_tokens, parents = scorer.process(
                    group, group_ids, top_scores, top % vocab_size, torch.div(top, vocab_size, rounding_mode="floor")
                )
                beam_scores[index] = new_scores
                next_ids[index] = group_ids[parents]
                current_tokens[index] = new_tokens
                reorder[index] = (
                    num_beams * torch.div(parents, size, rounding_mode="floor") + group * size + parents % size
                )
        if scores is not None and processed_step is not None:
            scores += (processed_step,)
        input_ids = torch.cat([next_ids, current_tokens.unsqueeze(-1)], dim=-1)
        codes = stop_codes(input_ids, scores)  # [batch * num_beams]
        if scorer.is_done or bool((codes != 0).all()):
            break
        yield StepEvent(step=step, tokens=[[] for _ in range(out_rows)], finish_reasons=[None] * out_rows)
        step += 1
        rows.reorder(reorder)
        logits = rows.decode(current_tokens)

    final = scorer.finalize(input_ids, beam_scores, codes, int(config.num_return_sequences))
    names = reason_names()
    finish = [names.get(code, FINISH_LENGTH) for code in final.reason_codes]
    generated = final.sequences[:, plan.input_len :]
    event = StepEvent(
        step=step,
        tokens=[generated[r, : final.generated[r]].tolist() for r in range(out_rows)],
        finish_reasons=cast(list[str | None], finish),
        final=True,
    )
    yield event
    return GenerationResult(
        sequences=final.sequences,
        scores=scores if return_dict else None,
        logits=raw_logits if return_dict else None,
        beam_indices=final.beam_indices if return_dict else None,
        sequences_scores=final.sequences_scores if keep_scores else None,
        finish_reasons=finish,
        prompt_length=plan.input_len,
    )
