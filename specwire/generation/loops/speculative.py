"""Speculative decoding: rounds of draft, verify in one target forward, accept per row.

Each round, every row asks the drafter for up to `k` tokens (`DraftSchedule` per row, bounded by
`max_length`), the target runs `[last token, drafts...]` for all rows in one forward
(`RaggedRows.verify`), the request's processors are applied at each candidate position with that
position's own prefix, and each row accepts its longest agreeing prefix (greedy), or by rejection
sampling with the draft's probabilities (Leviathan et al., arXiv 2211.17192), or by the target's
own samples when the drafter gives none (prompt lookup while sampling). The row then gains the
accepted drafts plus one target token (the correction, or the bonus token when all were
accepted), cut at the first stopping criterion inside the block (EOS, max length, stop strings,
max time). Rows advance by different amounts; `RaggedRows` crops the KV positions every row
rejected and masks the rest, so the batch stays one forward per round.

Output equals plain decoding: greedy tokens are identical (the target's argmax decides every
token), and `scores`/`logits` hold one entry per generated position, computed from the same
prefix as in plain decoding. Rows that finished early are fed the pad token like plain decoding
feeds them, so their scores match too. When the drafter fails (unreachable, too slow, died), the
loop finishes with empty drafts, which is plain decoding, and records why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from specwire.generation.loops.generate import generate_from_plan
from specwire.generation.loops.sampling import make_generator
from specwire.generation.loops.stop_codes import StopCodes, reason_names
from specwire.generation.outputs import FINISH_LENGTH, GenerationResult, StepEvent
from specwire.generation.planning import GenerationPlan, model_limits, prepare_generation
from specwire.generation.processors import build_logits_processors
from specwire.generation.rows import RaggedRows, SpeculativeRows
from specwire.generation.speculation.acceptance import (
    greedy_accept,
    rejection_sample,
    sampled_accept_without_draft_probs,
)
from specwire.generation.speculation.drafters import Drafter, DraftFailure, Proposal
from specwire.generation.speculation.schedules import DraftSchedule
from specwire.generation.speculation.stats import RoundRecord, SpeculationStats
from specwire.generation.stopping import build_stopping_criteria

__all__ = ["iter_speculative", "speculation_blocker", "speculative_loop"]


@dataclass
class _Row:
    prompt: torch.Tensor  # [input_len] (left padded as in the batch)
    generated: list[int]
    processors: Any
    criteria: Any
    schedule: DraftSchedule
    finished: bool = False
    reason: str | None = None
    finish_length: int | None = None
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def ids(self, extra: list[int] | None = None) -> torch.Tensor:
        tail = self.generated + (extra or [])
        return torch.cat([self.prompt, self.prompt.new_tensor(tail)])[None]  # [1, len]


def speculative_loop(
    plan: GenerationPlan,
    rows: SpeculativeRows,
    input_ids: torch.Tensor,
    row_processors: list[Any],
    row_stop_codes: list[Callable[[torch.Tensor, Any], torch.Tensor]],
    generator: torch.Generator | None,
    open_drafter: Callable[[list[list[int]]], Drafter],
    stats: SpeculationStats,
    reason_names: dict[int, str],
    draft_length: int | None = None,
) -> Generator[StepEvent, None, GenerationResult]:
    """Greedy or sampling with speculative rounds (see the module docstring).

    Args:
        plan (`GenerationPlan`): the resolved generation (lengths, special tokens, sampling).
        rows (`RaggedRows`): the model-side state of the expanded rows.
        input_ids (`torch.LongTensor` of shape `(rows, input_len)`): expanded, left-padded prompts.
        row_processors (`list`): each row's logits processors (built for a batch of one).
        row_stop_codes (`list`): each row's stopping check, `(ids [1, len], scores) -> codes [1]`.
        generator (`torch.Generator`, *optional*): the request's randomness (sampling).
        open_drafter (`Callable`): opens the drafting session for the rows' tokens so far
            (prompt without padding, plus the first generated token); may raise `DraftFailure`.
        stats (`SpeculationStats`): filled in as the rounds go.
        reason_names (`dict`): finish-reason code -> name.
        draft_length (`int`, *optional*): a constant draft length (prompt lookup) instead of the
            config's `num_assistant_tokens` schedule.
    """
    config = plan.config
    keep_scores = bool(config.return_dict_in_generate and config.output_scores)
    keep_logits = bool(config.return_dict_in_generate and config.output_logits)
    num_rows, input_len = input_ids.shape
    pad_finished = plan.eos_token_ids is not None and plan.pad_token_id is not None
    pad = plan.pad_token_id if pad_finished else None

    def schedule() -> DraftSchedule:
        if draft_length is not None:
            return DraftSchedule(draft_length, "constant")
        return DraftSchedule.from_config(config)

    state = [_Row(input_ids[r], [], row_processors[r], row_stop_codes[r], schedule()) for r in range(num_rows)]
    _, mask = plan.expanded()

    def finish(row: _Row, code: int) -> str:
        row.finished, row.reason = True, reason_names.get(code, FINISH_LENGTH)
        row.finish_length = len(row.generated)
        return row.reason

    # Step 0: the first token comes from the prefill's logits, as in plain decoding.
    logits = rows.prefill(input_ids)  # [rows, V]
    tokens, reasons = [], []
    first = rows.process([(row.processors, row.ids(), logits[r : r + 1]) for r, row in enumerate(state)])
    for r, row in enumerate(state):
        scores = first[r][0]
        token = _greedy_or_sample(plan, scores, generator)
        row.generated.append(token)
        if keep_scores:
            row.scores.append(scores)
        if keep_logits:
            row.logits.append(logits[r].clone())  # not a view: it would keep every row's logits alive
        code = int(row.criteria(row.ids(), scores[None])[0])
        tokens.append([token])
        reasons.append(finish(row, code) if code else None)
    yield StepEvent(step=0, tokens=tokens, finish_reasons=reasons, final=all(r.finished for r in state))

    # The drafter holds a session (a draft-service stream, KV caches) until closed: it is closed on
    # every way out of this generator (finish, error, the caller closing it on cancel or deadline).
    drafter: Drafter | None = None
    try:
        try:
            started = time.perf_counter()
            drafter = open_drafter([_unpadded(row, mask[r]) for r, row in enumerate(state)])
            stats.draft_seconds += time.perf_counter() - started
        except DraftFailure as exc:
            stats.fallback_reason = f"draft unavailable: {exc}"

        step = 1
        while not _done(state):
            round_start_ns = time.time_ns()
            # 1. Draft lengths per row, bounded so the block (drafts + 1) fits under max_length.
            room = [plan.max_length - input_len - len(row.generated) for row in state]
            want = [
                0 if row.finished else max(min(row.schedule.num_assistant_tokens, room[r] - 1), 0)
                for r, row in enumerate(state)
            ]
            asked = max(want)
            proposal = Proposal([[] for _ in state], [None] * num_rows)
            draft_s = 0.0
            if drafter is not None and asked > 0:
                started = time.perf_counter()
                try:
                    proposal = drafter.propose(asked)
                except DraftFailure as exc:
                    stats.fallback_reason = f"draft failed mid-request: {exc}"
                    drafter = _close(drafter)
                draft_s = time.perf_counter() - started
                stats.draft_seconds += draft_s
            drafts = [list(proposal.tokens[r][: want[r]]) for r in range(num_rows)]
            # Finished rows are fed the pad token, as plain decoding feeds them (their scores stay exact).
            catch_up = max(row.finish_length for row in state) if all(row.finished for row in state) else 0
            forced = [
                [pad] * max(min(max(asked, catch_up - len(row.generated) - 1), room[r] - 1), 0)
                if row.finished and pad is not None
                else []
                for r, row in enumerate(state)
            ]
            blocks = [drafts[r] or forced[r] for r in range(num_rows)]
            k = max(len(b) for b in blocks)

            # 2. One target forward over [last token, block] for every row.
            candidates = torch.full((num_rows, k + 1), pad if pad is not None else 0, dtype=torch.long)
            valid = torch.zeros((num_rows, k + 1), dtype=torch.long)
            for r, row in enumerate(state):
                block = [row.generated[-1], *blocks[r]]
                candidates[r, : len(block)] = torch.tensor(block)
                valid[r, : len(block)] = 1
            started = time.perf_counter()
            logits = rows.verify(candidates, valid)  # [rows, k + 1, V]

            # 3. Processors at every position with its own prefix (all rows and positions in one call),
            # acceptance, and the stopping cut.
            processed = rows.process(
                [
                    (row.processors, row.ids(blocks[r][:j]), logits[r : r + 1, j])
                    for r, row in enumerate(state)
                    for j in range(len(blocks[r]) + 1)
                ]
            )
            emitted_per_row, accepted_per_row, events = [], [], []
            offset = 0
            for r, row in enumerate(state):
                block = blocks[r]
                scores = torch.cat(processed[offset : offset + len(block) + 1])  # [len(block) + 1, V]
                offset += len(block) + 1
                if row.finished:
                    emitted, n_acc = (
                        [*block, pad if pad is not None else _greedy_or_sample(plan, scores[-1], generator)],
                        0,
                    )
                else:
                    emitted, n_acc = _accept(plan, block, proposal.probs[r], scores, generator)
                start = len(row.generated)
                was_finished = row.finished
                if not was_finished:
                    for j in range(1, len(emitted) + 1):
                        code = int(row.criteria(row.ids(emitted[:j]), scores[j - 1 : j])[0])
                        if code:
                            emitted, n_acc = emitted[:j], min(n_acc, j - 1)
                            row.generated += emitted
                            finish(row, code)
                            break
                    else:
                        row.generated += emitted
                else:
                    row.generated += emitted
                # Kept only when asked for, and copied: a view would keep the round's whole block alive
                # (a request otherwise holds ~2 x (k + 1) x vocab floats per round until it ends).
                if keep_scores:
                    row.scores += list(scores[: len(emitted)].clone())
                if keep_logits:
                    row.logits += list(logits[r, : len(emitted)].clone())
                emitted_per_row.append(emitted)
                accepted_per_row.append(min(n_acc, len(drafts[r])))
                # What the caller sees: real tokens up to the finish, and the reason once.
                end = row.finish_length if row.finish_length is not None else len(row.generated)
                events.append(
                    (
                        emitted[: max(end - start, 0)] if not was_finished else [],
                        row.reason if row.finished and not was_finished else None,
                    )
                )
            verify_s = time.perf_counter() - started
            stats.verify_seconds += verify_s

            # 4. Forget what was not kept: slots after the accepted drafts (the last emitted token is
            # the next round's input, not yet in the cache).
            kept = [len(e) for e in emitted_per_row]
            rows.discard(
                torch.tensor([k + 1 - n for n in kept]),
                torch.tensor([len(blocks[r]) + 1 - kept[r] for r in range(num_rows)]),
            )

            # 5. Schedules, statistics and the drafter's feedback.
            drafted_now = sum(len(d) for d in drafts)
            for r, row in enumerate(state):
                if drafts[r]:
                    row.schedule.update(accepted_per_row[r], len(drafts[r]))
                    for position in range(accepted_per_row[r]):
                        if position == len(stats.accepted_by_position):
                            stats.accepted_by_position.append(0)
                        stats.accepted_by_position[position] += 1
            if drafted_now:
                accepted_now = sum(accepted_per_row)
                stats.rounds += 1
                stats.drafted_tokens += drafted_now
                stats.accepted_tokens += accepted_now
                stats.round_log.append(
                    RoundRecord(
                        num_rows,
                        asked,
                        drafted_now,
                        accepted_now,
                        draft_s,
                        verify_s,
                        round_start_ns,
                        time.time_ns(),
                        sum(1 for d in drafts if d),
                    )
                )
            if drafter is not None:
                appended = [emitted_per_row[r][accepted_per_row[r] :] for r in range(num_rows)]
                try:
                    drafter.feedback(accepted_per_row, appended, [row.finished for row in state])
                except DraftFailure as exc:
                    stats.fallback_reason = f"draft failed mid-request: {exc}"
                    drafter = _close(drafter)

            yield StepEvent(
                step=step,
                tokens=[e[0] for e in events],
                finish_reasons=[e[1] for e in events],
                final=_done(state),
            )
            step += 1
        return _result(plan, state, input_ids, keep_scores, keep_logits, pad)
    finally:
        if drafter is not None:
            _close(drafter)


def _accept(plan, block, draft_probs, scores, generator) -> tuple[list[int], int]:
    """Acceptance for one row: (emitted tokens, accepted drafts)."""
    k = len(block)
    drafts = torch.tensor([block], dtype=torch.long, device=scores.device)  # [1, k]
    lengths = torch.tensor([k])  # only read on the host (`_check_drafts`): it stays on the CPU
    if not plan.do_sample:
        result = greedy_accept(drafts, lengths, scores[None])
    elif draft_probs is not None and k:
        q = draft_probs[:k].to(scores.device)[None]
        result = rejection_sample(drafts, lengths, q, scores.softmax(-1)[None], generator)
    else:
        result = sampled_accept_without_draft_probs(drafts, lengths, scores.softmax(-1)[None], generator)
    n = int(result.num_emitted[0])
    return result.emitted[0, :n].tolist(), int(result.num_accepted[0])


def _greedy_or_sample(plan, scores: torch.Tensor, generator) -> int:
    if plan.do_sample:
        return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
    return int(scores.argmax(-1))


def _unpadded(row: _Row, mask: torch.Tensor | None) -> list[int]:
    prompt = row.prompt if mask is None else row.prompt[mask.bool()]
    return prompt.tolist() + row.generated


def _done(state: list[_Row]) -> bool:
    """Plain decoding stops when every row finished; later-finishing rows define the length."""
    if not all(row.finished for row in state):
        return False
    length = max(row.finish_length for row in state)
    return all(len(row.generated) >= length for row in state)


def _close(drafter: Drafter) -> None:
    try:
        drafter.close()
    except Exception:  # noqa: BLE001 - a broken drafter must not break the request
        pass
    return None


def _result(plan, state, input_ids, keep_scores, keep_logits, pad) -> GenerationResult:
    length = max(row.finish_length for row in state)
    sequences = torch.stack([torch.cat([row.prompt, row.prompt.new_tensor(row.generated[:length])]) for row in state])
    scores = logits = None
    if keep_scores:
        scores = tuple(torch.stack([row.scores[t] for row in state]) for t in range(length))
    if keep_logits:
        logits = tuple(torch.stack([row.logits[t] for row in state]) for t in range(length))
    if not plan.config.return_dict_in_generate:
        scores = logits = None
    return GenerationResult(
        sequences=sequences,
        scores=scores,
        logits=logits,
        finish_reasons=[row.reason or FINISH_LENGTH for row in state],
        prompt_length=input_ids.shape[1],
    )


def speculation_blocker(plan: GenerationPlan) -> str:
    """Why this generation cannot speculate ("" when it can); it then runs plain decoding."""
    config = plan.config
    if plan.num_beams > 1:
        return "beam search runs without speculation (plain beam search)"
    if not config.use_cache:
        return "speculation needs use_cache=True"
    if config.guidance_scale is not None and config.guidance_scale != 1:
        return "classifier-free guidance (guidance_scale) needs one target step at a time"
    return ""


def iter_speculative(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: Any,
    open_drafter: Callable[[list[list[int]], Any], Drafter],
    stats: SpeculationStats,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
    draft_length: int | None = None,
    rows_factory: Callable[..., SpeculativeRows] | None = None,
) -> Generator[StepEvent, None, GenerationResult]:
    """`iter_generate` with speculative rounds when the request allows it, else plain decoding.

    Same arguments and result as `specwire.generation.loops.generate.iter_generate`, plus:

    Args:
        open_drafter (`Callable[[list[list[int]], GenerationConfig], Drafter]`): opens the drafting
            session for the rows (prompt tokens without padding) and the resolved config; may raise
            `DraftFailure`, which falls back to plain decoding.
        stats (`SpeculationStats`): receives the request's speculation statistics and fallback reason.
        draft_length (`int`, *optional*): constant draft length (prompt lookup) instead of the schedule.
        rows_factory (`Callable`, *optional*): builds the model-side state instead of `RaggedRows`
            (a `SpeculativeRows`); passed on to plain decoding.
    """
    plan = prepare_generation(
        model, input_ids, attention_mask, config=config, max_position_embeddings=max_position_embeddings
    )
    blocker = speculation_blocker(plan)
    if blocker:
        stats.fallback_reason = blocker
        return generate_from_plan(
            model,
            plan,
            tokenizer=tokenizer,
            generator=generator,
            negative_prompt_ids=negative_prompt_ids,
            negative_prompt_attention_mask=negative_prompt_attention_mask,
            max_position_embeddings=max_position_embeddings,
            rows_factory=rows_factory,
        )
    config = plan.config
    plan.require_tokenizer(tokenizer)
    expanded, mask = plan.expanded()
    rows = (rows_factory or RaggedRows)(
        model,
        attention_mask=mask,
        prompt_length=plan.input_len,
        rows=expanded.shape[0],
        use_cache=True,
        prefill_chunk_size=getattr(config, "prefill_chunk_size", None),
    )
    row_processors, row_stops = _per_row_steps(model, plan, rows, tokenizer, max_position_embeddings)
    if plan.do_sample and generator is None:
        generator = make_generator(getattr(config, "seed", None), expanded.device)
    return speculative_loop(
        plan,
        rows,
        expanded,
        row_processors,
        row_stops,
        generator,
        lambda tokens: open_drafter(tokens, config),
        stats,
        reason_names(),
        draft_length,
    )


def _per_row_steps(
    model: Any, plan: GenerationPlan, rows: SpeculativeRows, tokenizer: Any, max_position_embeddings: int | None
) -> tuple[list[Any], list[StopCodes]]:
    """Each row's processors and stopping criteria, built for a batch of one (rows advance apart)."""
    config = plan.config
    vocab_size, max_position_embeddings = model_limits(model, max_position_embeddings)
    pad_lengths = rows.padding_lengths
    row_processors, row_stops = [], []
    for r in range(plan.input_ids.shape[0] * plan.expand):
        prompt = plan.input_ids[r // plan.expand : r // plan.expand + 1]
        row_processors.append(
            build_logits_processors(
                config,
                input_len=plan.input_len,
                vocab_size=vocab_size,
                eos_token_ids=plan.eos_token_ids,
                num_beams=1,
                prompt_ids=prompt,
                prompt_pad_lengths=None if pad_lengths is None else pad_lengths[r : r + 1],
                model=model,
            )
        )
        criteria = build_stopping_criteria(
            config,
            max_length=plan.max_length,
            eos_token_ids=plan.eos_token_ids,
            tokenizer=tokenizer,
            max_position_embeddings=max_position_embeddings,
        )
        row_stops.append(StopCodes(criteria, plan.eos_token_ids, plan.input_ids.device))
    return row_processors, row_stops
