"""Constrained beam search over `batch * num_beams` rows, as transformers 4.55.4's `_constrained_beam_search`.

One forward per step; the processed log-probabilities plus each beam's score are ranked as in beam
search, then `constrained_beam_search.ConstrainedBeamScorer` mixes in the candidates that make progress
on the constraints (`force_words_ids`, `constraints`). As in 4.55.4 the recorded `scores` are the
accumulated ones (processed scores plus the beam's score). Nothing is committed before the end.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, cast

import torch

from specwire.generation.constraints import constraints_from_config
from specwire.generation.loops.constrained_beam_search import ConstrainedBeamScorer
from specwire.generation.loops.stop_codes import StopCodes, reason_names
from specwire.generation.outputs import GenerationResult, StepEvent, outputs_wanted
from specwire.generation.planning import GenerationPlan
from specwire.generation.rows import Rows
from specwire.vocabulary import FINISH_LENGTH

__all__ = ["constrained_beam_loop"]


def constrained_beam_loop(
    plan: GenerationPlan,
    rows: Rows,
    input_ids: torch.Tensor,
    processors: Any,
    stop_codes: StopCodes,
) -> Generator[StepEvent, None, GenerationResult]:
    """Constrained beam search over `rows` (`batch * num_beams`); `input_ids` are the expanded prompts."""
    config = plan.config
    return_dict, keep_scores, keep_logits = outputs_wanted(config)
    scores: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    raw_logits: tuple[torch.Tensor, ...] | None = () if keep_logits else None
    num_beams, eos = plan.num_beams, plan.eos_token_ids
    scorer = ConstrainedBeamScorer(
        constraints_from_config(config.constraints, config.force_words_ids),
        batch_size=input_ids.shape[0] // num_beams,
        num_beams=num_beams,
        length_penalty=float(config.length_penalty),
        early_stopping=config.early_stopping,
        max_length=plan.max_length,
        prompt_length=plan.input_len,
        eos_token_ids=eos,
        pad_token_id=plan.pad_token_id if plan.pad_token_id is not None else (eos[0] if eos else 0),
        track_beam_indices=bool(return_dict and config.output_scores),
    )
    track = bool(return_dict and config.output_scores)
    beam_indices: list[tuple[int, ...]] | None = [() for _ in range(input_ids.shape[0])] if track else None
    batch = scorer.batch_size
    beam_scores = torch.zeros((batch, num_beams), dtype=torch.float, device=input_ids.device)
    beam_scores[:, 1:] = -1e9
    beam_scores = beam_scores.view(-1)
    candidates = max(2, 1 + len(eos or [])) * num_beams
    out_rows = batch * int(config.num_return_sequences)

    logits = rows.prefill(input_ids)  # [batch * num_beams, V]
    step = 0
    while True:
        with torch.no_grad():
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            processed = rows.process([(processors, input_ids, log_probs)])[0]  # [batch * num_beams, V]
            accumulated = processed + beam_scores[:, None]
            if keep_logits:
                assert raw_logits is not None  # a tuple whenever keep_logits
                raw_logits += (logits,)
            if scores is not None:
                scores += (accumulated,)
            vocab_size = accumulated.shape[-1]
            top_scores, top = torch.topk(accumulated.view(batch, -1), candidates, dim=1, largest=True, sorted=True)
            beam_scores, tokens, parents = scorer.process_step(
                input_ids, top_scores, top % vocab_size, (top / vocab_size).long(), accumulated, beam_indices
            )
        input_ids = torch.cat([input_ids[parents], tokens.unsqueeze(-1)], dim=-1)
        if beam_indices is not None:
            beam_indices = [beam_indices[p] + (p,) for p in parents.tolist()]
        codes = stop_codes(input_ids, scores)  # [batch * num_beams]
        if scorer.is_done or bool((codes != 0).all()):
            break
        yield StepEvent(step=step, tokens=[[] for _ in range(out_rows)], finish_reasons=[None] * out_rows)
        step += 1
        rows.reorder(parents)
        logits = rows.decode(tokens)

    final = scorer.finalize_constrained(input_ids, beam_scores, codes, int(config.num_return_sequences), beam_indices)
    names = reason_names()
    finish = [names.get(code, FINISH_LENGTH) for code in final.reason_codes]
    generated = final.sequences[:, plan.input_len :]
    yield StepEvent(
        step=step,
        tokens=[generated[r, : final.generated[r]].tolist() for r in range(out_rows)],
        finish_reasons=cast(list[str | None], finish),
        final=True,
    )
    return GenerationResult(
        sequences=final.sequences,
        scores=scores if return_dict else None,
        logits=raw_logits if return_dict else None,
        beam_indices=final.beam_indices if return_dict else None,
        sequences_scores=final.sequences_scores if keep_scores else None,
        finish_reasons=finish,
        prompt_length=plan.input_len,
    )
