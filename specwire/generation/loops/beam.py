"""Beam search and beam-sample with `generate()` semantics, over `batch * num_beams` rows.

Processors act on `log_softmax(logits)`; the vectorised `BeamSearch` (`beam_search.py`) picks the
beams, and the rows are reordered to their parents every step. Nothing is committed until the search
ends: the step events carry empty token lists, and one last event carries every returned hypothesis.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, cast

import torch

from specwire.generation.loops.beam_search import BeamSearch
from specwire.generation.loops.beam_search import StopCodes as BeamStopCodes
from specwire.generation.loops.stop_codes import StopCodes, reason_names
from specwire.generation.outputs import GenerationResult, StepEvent, outputs_wanted
from specwire.generation.planning import GenerationPlan
from specwire.generation.rows import Rows
from specwire.vocabulary import FINISH_LENGTH

__all__ = ["beam_loop"]


def _beam_fill_value(eos: list[int] | None, pad: int | None) -> int:
    # transformers computes `pad_token_id or eos_token_id[0]` on a tensor pad id: pad id 0 is falsy there,
    # so it fills with eos[0]; without EOS ids it fills with -1 even when a pad id exists.
    if eos is None:
        return -1
    return pad if pad else eos[0]


def beam_loop(
    plan: GenerationPlan,
    rows: Rows,
    input_ids: torch.Tensor,
    processors: Any,
    stop_codes: StopCodes,
    generator: torch.Generator | None,
) -> Generator[StepEvent, None, GenerationResult]:
    """Beam search and beam-sample over `rows` (`batch * num_beams`)."""
    config = plan.config
    _, keep_scores, keep_logits = outputs_wanted(config)
    scores: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    raw_logits: tuple[torch.Tensor, ...] | None = () if keep_logits else None
    search = BeamSearch(
        input_ids,
        num_beams=plan.num_beams,
        max_length=plan.max_length,
        num_eos=len(plan.eos_token_ids or []),
        length_penalty=float(config.length_penalty),
        early_stopping=config.early_stopping,
        do_sample=plan.do_sample,
        fill_value=_beam_fill_value(plan.eos_token_ids, plan.pad_token_id),
    )
    out_rows = search.batch_size * int(config.num_return_sequences)

    logits = rows.prefill(input_ids)  # [batch * num_beams, V]
    sequences = input_ids
    step = 0
    while True:
        with torch.no_grad():
            log_probs = torch.log_softmax(logits, dim=-1)
            log_probs = rows.process([(processors, sequences, log_probs)])[0]  # [batch * num_beams, V]
            if keep_logits:
                assert raw_logits is not None  # a tuple whenever keep_logits
                raw_logits += (logits,)
            if keep_scores:
                assert scores is not None  # a tuple whenever keep_scores
                scores += (log_probs,)
            # The criteria see the scores recorded so far, as in transformers.
            parents = search.step(  # [batch * num_beams] parent row of every new running row
                log_probs,
                cast(BeamStopCodes, lambda candidates, recorded=scores: stop_codes(candidates, recorded)),
                generator,
            )
        if search.done:
            break
        yield StepEvent(step=step, tokens=[[] for _ in range(out_rows)], finish_reasons=[None] * out_rows)
        step += 1
        rows.reorder(parents)
        sequences = search.running_sequences()
        logits = rows.decode(search.last_tokens())

    event, result = _finish(plan, search, step, scores, raw_logits)
    yield event
    return result


def _finish(
    plan: GenerationPlan,
    search: BeamSearch,
    step: int,
    scores: tuple[torch.Tensor, ...] | None,
    raw_logits: tuple[torch.Tensor, ...] | None,
) -> tuple[StepEvent, GenerationResult]:
    """The last event (every returned hypothesis' tokens and finish reason) and the result."""
    config = plan.config
    return_dict, keep_scores, _ = outputs_wanted(config)
    names = reason_names()
    nrs = int(config.num_return_sequences)
    out_rows = search.batch_size * nrs
    final = search.finalize(nrs)
    finish = [names.get(code, FINISH_LENGTH) for code in final.reason_codes.tolist()]
    prompt_length = plan.input_len
    generated = final.sequences[:, prompt_length:]
    used = (final.beam_indices != -1).sum(dim=1).tolist()
    event = StepEvent(
        step=step,
        tokens=[generated[r, : used[r]].tolist() for r in range(out_rows)],
        finish_reasons=cast(list[str | None], finish),  # every hypothesis has its reason
        final=True,
    )
    result = GenerationResult(
        sequences=final.sequences,
        scores=scores if return_dict else None,
        logits=raw_logits if return_dict else None,
        beam_indices=final.beam_indices if return_dict else None,
        sequences_scores=final.sequences_scores if keep_scores else None,
        finish_reasons=finish,
        prompt_length=prompt_length,
    )
    return event, result
