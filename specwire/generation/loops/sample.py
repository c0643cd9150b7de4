"""Greedy decoding and multinomial sampling: one token per row per step, with `generate()` semantics.

Each step processes the raw float32 logits, picks `argmax` or draws from `softmax(scores)` with the
request's generator, and, only when an EOS criterion exists, replaces the token of rows that already
finished with `pad_token_id`. The loop ends when every row finished.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from specwire.generation.loops.sampling import select_tokens
from specwire.generation.loops.stop_codes import StopCodes, reason_names
from specwire.generation.outputs import GenerationResult, StepEvent, outputs_wanted
from specwire.generation.planning import GenerationPlan
from specwire.generation.rows import Rows
from specwire.vocabulary import FINISH_LENGTH

__all__ = ["sample_loop"]


def sample_loop(
    plan: GenerationPlan,
    rows: Rows,
    input_ids: torch.Tensor,
    processors: Any,
    stop_codes: StopCodes,
    generator: torch.Generator | None,
    contrast: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Generator[StepEvent, None, GenerationResult]:
    """Greedy and multinomial sampling over `rows` (one row per returned sequence); `contrast` turns each
    step's logits into the ones the processors see (DoLa, `loops.dola`), `output_logits` keeping the raw ones."""
    config = plan.config
    return_dict, keep_scores, keep_logits = outputs_wanted(config)
    names = reason_names()
    scores: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    raw_logits: tuple[torch.Tensor, ...] | None = () if keep_logits else None
    num_rows = input_ids.shape[0]
    device = input_ids.device
    running = torch.ones(num_rows, dtype=torch.bool, device=device)
    reason_codes = torch.zeros(num_rows, dtype=torch.long, device=device)
    # Only an EOS criterion turns finished rows into padding (transformers' `has_eos_stopping_criteria`).
    pad_finished = plan.eos_token_ids is not None and plan.pad_token_id is not None
    pad = torch.tensor(plan.pad_token_id if pad_finished else 0, device=device)

    logits = rows.prefill(input_ids)  # [rows, V]
    step = 0
    while True:
        with torch.no_grad():
            scored = logits if contrast is None else contrast(logits)
            next_scores = rows.process([(processors, input_ids, scored)])[0]  # [rows, V]
            if keep_scores:
                assert scores is not None  # a tuple whenever keep_scores
                scores += (next_scores,)
            if keep_logits:
                assert raw_logits is not None  # a tuple whenever keep_logits
                raw_logits += (logits,)
            tokens = select_tokens(next_scores, do_sample=plan.do_sample, generator=generator)  # [rows]
            if pad_finished:
                tokens = torch.where(running, tokens, pad)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
            codes = stop_codes(input_ids, scores)  # [rows] FinishReason codes, 0 = running
            stopped = codes != 0
            newly = running & stopped
            reason_codes = torch.where(newly, codes, reason_codes)
            was_running = running
            running = running & ~stopped

        # One device-to-host copy per step for everything the event needs.
        host = torch.stack([tokens, was_running.long(), newly.long(), codes, running.long()]).tolist()
        token_list, was_list, newly_list, codes_list, running_list = host
        done = not any(running_list)
        yield StepEvent(
            step=step,
            tokens=[[token_list[r]] if was_list[r] else [] for r in range(num_rows)],
            finish_reasons=[
                names.get(codes_list[r], FINISH_LENGTH) if newly_list[r] else None for r in range(num_rows)
            ],
            final=done,
        )
        if done:
            break
        step += 1
        logits = rows.decode(tokens)

    finish = [names.get(code, FINISH_LENGTH) for code in reason_codes.tolist()]
    return GenerationResult(
        sequences=input_ids,
        scores=scores if return_dict else None,
        logits=raw_logits if return_dict else None,
        finish_reasons=finish,
        prompt_length=plan.input_len,
    )
