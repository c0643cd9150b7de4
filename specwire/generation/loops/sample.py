"""Greedy decoding and multinomial sampling: one token per row per step, with `generate()` semantics.

Each step processes the raw float32 logits, picks `argmax` or draws from `softmax(scores)` with the
request's generator, and, only when an EOS criterion exists, replaces the token of rows that already
finished with `pad_token_id`. The loop ends when every row finished.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from specwire.generation.loops.stop_codes import StopCodes, reason_names
from specwire.generation.outputs import GenerationResult, StepEvent, outputs_wanted
from specwire.generation.planning import GenerationPlan
from specwire.generation.rows import Rows
from specwire.generation.sampling import select_tokens
from specwire.vocabulary import FINISH_LENGTH

__all__ = ["StepStops", "sample_loop"]


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
            step_stops = StepStops.after(stop_codes(input_ids, scores), running)
            reason_codes = torch.where(step_stops.newly, step_stops.codes, reason_codes)
            running = step_stops.running

        event = step_stops.event(step, tokens, names)
        yield event
        if event.final:
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


@dataclass
class StepStops:
    """Which rows one decoding step stopped, from its `StopCodes` (all `[rows]` tensors).

    Args:
        codes: the `FinishReason` code of each row after the step, 0 for still running.
        was_running: the rows running before the step (their token counts).
        newly: the rows this step stopped.
        running: the rows still running after the step.
    """

    codes: torch.Tensor
    was_running: torch.Tensor
    newly: torch.Tensor
    running: torch.Tensor

    @classmethod
    def after(cls, codes: torch.Tensor, running: torch.Tensor) -> StepStops:
        stopped = codes != 0
        return cls(codes, running, running & stopped, running & ~stopped)

    def event(self, step: int, tokens: torch.Tensor, names: dict[int, str]) -> StepEvent:
        """The step's `StepEvent`, with one device-to-host copy for everything it needs."""
        host = torch.stack([tokens, self.was_running.long(), self.newly.long(), self.codes, self.running.long()])
        token_list, was_list, newly_list, codes_list, running_list = host.tolist()
        return StepEvent(
            step=step,
            tokens=[[token] if was else [] for token, was in zip(token_list, was_list, strict=True)],
            finish_reasons=[
                names.get(code, FINISH_LENGTH) if newly else None
                for code, newly in zip(codes_list, newly_list, strict=True)
            ],
            final=not any(running_list),
        )
