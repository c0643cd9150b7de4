"""The steps of a speculative round, for one request: draft, verify, accept, commit.

`SpeculativeRun` holds one request's rows (their tokens, processors, stopping criteria and draft
schedules), its drafter session and its statistics; `loops.speculative.speculative_loop` drives it:
`first_step`, `open_drafter`, then `round` until `done` (with `drafts_from_the_prompt`: `open_drafter`,
`first_round`, then the rounds). See `loops.speculative` for the algorithm.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from specwire.generation.loops.stop_codes import StopCodes
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.planning import GenerationPlan
from specwire.generation.rows import SpeculativeRows
from specwire.generation.sampling import greedy_tokens
from specwire.generation.speculation.acceptance import (
    AcceptResult,
    crop_at_stops,
    greedy_accept,
    rejection_sample,
    sampled_accept_without_draft_probs,
)
from specwire.generation.speculation.controller import (
    DECIDED_BY_CONTROLLER,
    DECIDED_BY_SCHEDULE,
    SpeculationController,
)
from specwire.generation.speculation.drafters import Drafter, DraftFailure, Hindsight, Proposal
from specwire.generation.speculation.schedules import DraftSchedule
from specwire.generation.speculation.stats import SpeculationStats
from specwire.vocabulary import FINISH_LENGTH

__all__ = ["SpeculativeRun", "accept_blocks"]


@dataclass
class _Row:
    prompt: torch.Tensor  # [input_len] (left padded as in the batch)
    generated: list[int]
    processors: Any
    criteria: StopCodes
    schedule: DraftSchedule
    finished: bool = False
    reason: str | None = None
    finish_length: int | None = None
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    # `ids()` as a tensor, kept between calls. The row's processors and criteria read it at every position of
    # every round; rebuilt from the list each time, it was the costliest Python of a round without drafts, and
    # under load every request's round holds up the next packed forward. `generated` only grows (appended to,
    # never cut); when it grew by the `extra` of the last call (a plain round's criteria check the token it
    # then emits), that call's tensor is reused.
    _ids: torch.Tensor | None = field(default=None, repr=False)
    _last: tuple[list[int], torch.Tensor] | None = field(default=None, repr=False)  # extra on `_ids`, its ids

    def ids(self, extra: list[int] | None = None) -> torch.Tensor:
        """The prompt, the generated tokens and `extra`, `[1, len]` (not to be written to: it may be shared)."""
        if self._ids is None:
            self._ids = torch.cat([self.prompt, self.prompt.new_tensor(self.generated)])[None]
        else:
            new = self.generated[self._ids.shape[1] - self.prompt.shape[0] :]
            if new:
                last, self._last = self._last, None
                if last is not None and last[0] == new:
                    self._ids = last[1]
                else:
                    self._ids = torch.cat([self._ids, self.prompt.new_tensor(new)[None]], dim=1)
        if not extra:
            return self._ids
        ids = torch.cat([self._ids, self.prompt.new_tensor(extra)[None]], dim=1)  # [1, len + extra]
        self._last = (list(extra), ids)
        return ids

    def stop_code(self, extra: list[int], scores: torch.Tensor) -> int:
        """The row's finish code (0: running) once it emitted `extra` after its tokens, `scores` the last one's."""
        last = extra[-1] if extra else self.generated[-1] if self.generated else None
        if self.criteria.by_last_token and last is not None:  # no `ids()` tensor to build
            return self.criteria.code(self.prompt.shape[0] + len(self.generated) + len(extra), last)
        return int(self.criteria(self.ids(extra), scores)[0])


@dataclass
class _Block:
    """One round's candidates: what each row drafted and what the target verifies after its last token.

    Args:
        asked (`int`): the draft length the drafter was asked for (the longest a row wants).
        drafts (`list[list[int]]`): per row, its draft tokens (cut to what the row wants).
        probs (`list[torch.Tensor | None]`): per row, the draft's probabilities of them.
        blocks (`list[list[int]]`): per row, the drafts, or the pad filler of a finished row.
        draft_s (`float`): seconds spent drafting.
        proposed (`bool`): whether the drafter was asked at all.
        want (`list[int]`): per row, the draft length it asked for.
        hindsight (`Hindsight`, *optional*): the drafter's, summed over the rows (`Proposal.hindsight`).
        ahead_hit (`bool`, *optional*, defaults to `False`): the drafts were drafted ahead (`Proposal.ahead_hit`).
    """

    asked: int
    drafts: list[list[int]]
    probs: list[torch.Tensor | None]
    blocks: list[list[int]]
    draft_s: float
    proposed: bool = False
    want: list[int] = field(default_factory=list)
    hindsight: Hindsight | None = None
    ahead_hit: bool = False

    @property
    def k(self) -> int:
        return max(len(block) for block in self.blocks)


@dataclass
class _Outcome:
    """What one round gave every row: `emitted` tokens, of which `accepted` were drafts, and a finish code."""

    emitted: list[list[int]]
    accepted: list[int]
    codes: list[int]


class SpeculativeRun:
    """
    One request's speculative rounds: its rows, the drafter session and the statistics.

    Args:
        plan (`GenerationPlan`): the resolved generation.
        rows (`SpeculativeRows`): the model-side state of the expanded rows.
        input_ids (`torch.LongTensor` of shape `(rows, input_len)`): expanded, left-padded prompts.
        row_processors (`list`): each row's logits processors (built for a batch of one).
        row_stop_codes (`list[StopCodes]`): each row's stopping check, `(ids [1, len], scores) -> codes [1]`.
        generator (`torch.Generator`, *optional*): the request's randomness (sampling).
        stats (`SpeculationStats`): filled in as the rounds go.
        reason_names (`dict`): finish-reason code -> name.
        draft_length (`int`, *optional*): a constant draft length instead of the config's schedule.
        controller (`SpeculationController`, *optional*): chooses every round's draft length instead
            (the request names no schedule); `draft_length` and the config's schedule are then unused.
    """

    def __init__(
        self,
        plan: GenerationPlan,
        rows: SpeculativeRows,
        input_ids: torch.Tensor,
        row_processors: list[Any],
        row_stop_codes: Sequence[StopCodes],
        generator: torch.Generator | None,
        stats: SpeculationStats,
        reason_names: dict[int, str],
        draft_length: int | None,
        controller: SpeculationController | None = None,
    ):
        config = plan.config
        self.plan = plan
        self.rows = rows
        self.input_ids = input_ids
        self.generator = generator
        self.stats = stats
        self.reason_names = reason_names
        self.keep_scores = bool(config.return_dict_in_generate and config.output_scores)
        self.keep_logits = bool(config.return_dict_in_generate and config.output_logits)
        self.input_len = input_ids.shape[1]
        pad_finished = plan.eos_token_ids is not None and plan.pad_token_id is not None
        self.pad = plan.pad_token_id if pad_finished else None
        self.drafter: Drafter | None = None
        self.controller = controller
        stats.decided_by = DECIDED_BY_SCHEDULE if controller is None else DECIDED_BY_CONTROLLER
        if controller is not None:
            controller.rows = input_ids.shape[0]
        self._time_off = False  # this round's length is the controller's time off (no draft)
        # Per row, the tokens of its context (prompt without padding + generated) the drafter has seen: it
        # catches up on the rest at its next `propose` (the draft model's prefill; the controller prices it).
        self._prompt_lengths = [0] * input_ids.shape[0]
        self._seen = [0] * input_ids.shape[0]
        self._behind = 0  # this round's tokens the drafter had not seen
        self._prefilling = False  # the drafter catches up on the prompt on its own (`open_drafter(prefill=True)`)

        # Every row has its own draft schedule (schedule state never leaks between requests or rows).
        def schedule() -> DraftSchedule:
            if draft_length is not None:
                return DraftSchedule(draft_length, "constant")
            return DraftSchedule.from_config(config)

        self.state = [
            _Row(input_ids[r], [], row_processors[r], row_stop_codes[r], schedule()) for r in range(input_ids.shape[0])
        ]

    def _finish(self, row: _Row, code: int) -> str:
        row.finished, row.reason = True, self.reason_names.get(code, FINISH_LENGTH)
        row.finish_length = len(row.generated)
        return row.reason

    def done(self) -> bool:
        """Plain decoding stops when every row finished; later-finishing rows define the length."""
        if not all(row.finished for row in self.state):
            return False
        length = max(cast(int, row.finish_length) for row in self.state)  # set: every row finished
        return all(len(row.generated) >= length for row in self.state)

    @property
    def drafts_from_the_prompt(self) -> bool:
        """Whether the first token comes from a round drafted after the prompt, as in transformers.

        transformers' assisted generation drafts from the prompt, so its first token is already a
        verified block. Lossless acceptance gives the same tokens either way, and specwire takes the
        first token from the prefill (the drafter then starts with it); with `assistant_ensemble_weight`
        the block boundaries change the tokens, so the first round is drafted from the prompt too.
        """
        # MTP and DFlash draft from the target's hidden states, so transformers' first round drafts nothing: its
        # first token is the prefill's with or without an ensemble weight.
        config = self.plan.config
        from_hidden_states = config.use_mtp or config.speculation_type == "dflash"
        return config.assistant_ensemble_weight is not None and not from_hidden_states

    def _draft_cap(self, room: int) -> int:
        """The most drafts a row with `room` tokens left before `max_length` verifies this round.

        Drafts and the bonus token fit under `max_length` (`room - 1`), as transformers caps a draft model's. Its MTP
        and DFlash generators draft whole blocks uncapped instead and the loop crops the accepted tokens at
        `max_length`, so their last token before it is a draft position (which only the ensemble weight tells
        apart): they may draft `room` (DFlash none when `room` is 1, its generator's early exit).
        """
        config = self.plan.config
        if config.use_mtp:
            return room
        if config.speculation_type == "dflash":
            return room if room > 1 else 0
        return room - 1

    def first_step(self) -> StepEvent:
        """The prefill and the first token of every row, as plain decoding picks it (a drafter opened before it
        hears of the first tokens as a round that accepted no drafts)."""
        event = self._first_from(self.rows.prefill(self.input_ids))
        self._feedback(_Outcome(event.tokens, [0] * len(event.tokens), [0] * len(event.tokens)))
        return event

    def first_round(self) -> StepEvent:
        """The prefill and a round drafted from the prompt (`drafts_from_the_prompt`).

        The prefill's logits score the first draft position; the verify forward runs the drafts alone
        (`[d_1, .., d_k]`, the prompt's last token is already in the cache), giving the other positions.
        Unless every row drafted, the first token is taken from the prefill as in `first_step` and the
        drafter is told that none of its drafts was kept.
        """
        start_ns = time.time_ns()
        first = self.rows.prefill(self.input_ids)  # [rows, V]
        block = self._draft()
        if self.drafter is None or not all(block.blocks):
            event = self._first_from(first)
            if self.drafter is not None and any(block.drafts):
                tokens = [list(t) for t in event.tokens]
                self._feedback(_Outcome(tokens, [0] * len(tokens), [0] * len(tokens)))
            return event
        candidates = torch.zeros((len(self.state), block.k), dtype=torch.long)
        valid = torch.zeros((len(self.state), block.k), dtype=torch.long)
        for r, drafted in enumerate(block.blocks):
            candidates[r, : len(drafted)] = torch.tensor(drafted)
            valid[r, : len(drafted)] = 1
        started = time.perf_counter()
        verified = self.rows.verify(candidates, valid)  # [rows, k, V]
        logits = torch.cat([first[:, None].to(verified.dtype), verified], dim=1)  # [rows, k + 1, V]
        return self._settle(0, block, logits, started, start_ns)

    def _first_from(self, logits: torch.Tensor) -> StepEvent:
        """The first token of every row from the prefill's logits `[rows, V]`, as plain decoding picks it."""
        tokens, reasons = [], []
        first = self.rows.process([(row.processors, row.ids(), logits[r : r + 1]) for r, row in enumerate(self.state)])
        for r, row in enumerate(self.state):
            scores = first[r][0]
            token = _greedy_or_sample(self.plan, scores, self.generator)
            row.generated.append(token)
            if self.keep_scores:
                row.scores.append(scores)
            if self.keep_logits:
                row.logits.append(logits[r].clone())  # not a view: it would keep every row's logits alive
            code = row.stop_code([], scores[None])
            tokens.append([token])
            reasons.append(self._finish(row, code) if code else None)
        return StepEvent(step=0, tokens=tokens, finish_reasons=reasons, final=all(r.finished for r in self.state))

    def open_drafter(self, open_drafter: Callable[[list[list[int]]], Drafter], prefill: bool = False) -> None:
        """Opens the drafting session; without one the rounds run with empty drafts (plain decoding).

        With `prefill`, before `first_step` (the session opens on the prompt alone), a drafter that can catch up on
        its own (`RemoteDrafter.prefill`: a draft service, on its own device) starts on the prompt at once; the
        prompt counts as seen once it is done (`_lengths`), so the controller prices a look-back by the tokens
        after it."""
        _, mask = self.plan.expanded()
        try:
            started = time.perf_counter()
            contexts = [_unpadded(row, mask[r]) for r, row in enumerate(self.state)]
            self._prompt_lengths = [len(c) - len(row.generated) for c, row in zip(contexts, self.state, strict=True)]
            self.drafter = open_drafter(contexts)
            start_prefill = getattr(self.drafter, "prefill", None) if prefill else None
            if start_prefill is not None:
                start_prefill()
                self._prefilling = True
            self.stats.draft_seconds += time.perf_counter() - started
        except DraftFailure as exc:
            self.stats.fallback_reason = f"draft unavailable: {exc}"

    def _drafter_failed(self, exc: DraftFailure) -> None:
        self.stats.fallback_reason = f"draft failed mid-request: {exc}"
        _close(cast(Drafter, self.drafter))  # the open drafter raised the failure
        self.drafter = None

    def close_drafter(self) -> None:
        if self.drafter is not None:
            _close(self.drafter)
            self.drafter = None

    def round(self, step: int) -> StepEvent:
        """One speculative round: draft, verify, accept, commit."""
        start_ns = time.time_ns()
        block = self._draft()
        candidates, valid = self._candidates(block)
        started = time.perf_counter()
        logits = self.rows.verify(candidates, valid)  # [rows, k + 1, V]
        return self._settle(step, block, logits, started, start_ns)

    def _settle(self, step: int, block: _Block, logits: torch.Tensor, started: float, start_ns: int) -> StepEvent:
        """Accept and commit a verified block (`logits` `[rows, k + 1, V]`), then the bookkeeping.

        The cache holds the verified slots; what the rows did not keep is discarded so that the last
        emitted token (the next round's input) is the first one not in the cache.
        """
        scores = self._process(block, logits)
        outcome = self._accept(block, scores)
        events = self._commit(outcome, scores, logits)
        verify_s = time.perf_counter() - started
        self.stats.verify_seconds += verify_s
        self._discard(block, outcome)
        for r, row in enumerate(self.state):
            if block.drafts[r]:
                row.schedule.update(outcome.accepted[r], len(block.drafts[r]))
        self._observe(block, outcome, events, verify_s)
        self.stats.observe_round(
            [len(d) for d in block.drafts],
            outcome.accepted,
            asked=block.asked,
            draft_s=block.draft_s,
            verify_s=verify_s,
            start_ns=start_ns,
            end_ns=time.time_ns(),
        )
        self._feedback(outcome)
        return StepEvent(
            step=step, tokens=[e[0] for e in events], finish_reasons=[e[1] for e in events], final=self.done()
        )

    def _observe(
        self, block: _Block, outcome: _Outcome, events: list[tuple[list[int], str | None]], verify_s: float
    ) -> None:
        """The controller and the statistics learn what the round asked, cost and gave."""
        self.stats.record_length(block.asked if block.proposed else 0)  # 0 too once the drafter failed
        if self.controller is None:
            return
        if self._time_off:
            self.stats.tokens_without_draft += sum(len(tokens) for tokens, _ in events)
        self.controller.observe(
            block.asked if block.proposed else 0,
            block.want,
            [len(d) for d in block.drafts],
            outcome.accepted,
            block.draft_s,
            verify_s,
            sum(len(b) + 1 for b in block.blocks),
            self._behind if block.proposed else 0,
            block.hindsight,
            block.ahead_hit,
        )
        self.stats.probes = self.controller.probes

    def _lengths(self, room: list[int]) -> list[int]:
        """Each row's draft length this round: the controller's choice, or the row's schedule."""
        chosen = None
        running = [r for r, row in enumerate(self.state) if not row.finished]
        if self._prefilling and getattr(self.drafter, "prefilled", True):
            self._seen, self._prefilling = list(self._prompt_lengths), False
        self._behind = sum(self._prompt_lengths[r] + len(self.state[r].generated) - self._seen[r] for r in running)
        if self.controller is not None:
            remaining = max((room[r] for r in running), default=0)
            chosen = self.controller.next_length(remaining, self._behind)
            self._time_off = chosen == 0 and self.controller.off
        return [
            0
            if row.finished
            else max(min(row.schedule.num_assistant_tokens if chosen is None else chosen, self._draft_cap(room[r])), 0)
            for r, row in enumerate(self.state)
        ]

    def _draft(self) -> _Block:
        """Draft lengths per row, bounded so the block (drafts + 1) fits under max_length, and the drafts."""
        state, pad = self.state, self.pad
        room = [self.plan.max_length - self.input_len - len(row.generated) for row in state]
        want = self._lengths(room)
        asked = max(want)
        proposal = Proposal([[] for _ in state], [None] * len(state))
        draft_s, proposed = 0.0, False
        looking_back = self.controller is not None and self.controller.looking_back
        if self.drafter is not None and (asked > 0 or looking_back):
            proposed = True
            started = time.perf_counter()
            try:
                proposal = self.drafter.propose(asked)
            except DraftFailure as exc:
                self._drafter_failed(exc)
            draft_s = time.perf_counter() - started
            self.stats.draft_seconds += draft_s
            self._seen = [self._prompt_lengths[r] + len(row.generated) for r, row in enumerate(state)]
        drafts = [list(proposal.tokens[r][: want[r]]) for r in range(len(state))]
        # A draft sampled with probabilities keeps its forbidden tokens when sampling: rejection sampling
        # rejects them (the masked target gives them p = 0) and draws from the residual, which is exact;
        # cutting them would skew the output towards the target's distribution at that position.
        drafts = [
            draft if self.plan.do_sample and proposal.probs[r] is not None else _grammar_allowed(state[r], draft)
            for r, draft in enumerate(drafts)
        ]
        # Finished rows are fed the pad token, as plain decoding feeds them (their scores stay exact).
        catch_up = max(cast(int, row.finish_length) for row in state) if all(row.finished for row in state) else 0
        forced = [
            [pad] * max(min(max(asked, catch_up - len(row.generated) - 1), room[r] - 1), 0)
            if row.finished and pad is not None
            else []
            for r, row in enumerate(state)
        ]
        blocks = [drafts[r] or forced[r] for r in range(len(state))]
        hindsight = None if proposal.hindsight is None else sum(proposal.hindsight, Hindsight())
        return _Block(
            asked, drafts, list(proposal.probs), blocks, draft_s, proposed, want, hindsight, proposal.ahead_hit
        )

    def _candidates(self, block: _Block) -> tuple[torch.Tensor, torch.Tensor]:
        """`[last token, block...]` per row `[rows, k + 1]`, and which of those slots are real tokens."""
        width, fill = block.k + 1, self.pad if self.pad is not None else 0
        rows = [[row.generated[-1], *block.blocks[r]] for r, row in enumerate(self.state)]
        candidates = torch.tensor([tokens + [fill] * (width - len(tokens)) for tokens in rows], dtype=torch.long)
        valid = torch.tensor([[1] * len(tokens) + [0] * (width - len(tokens)) for tokens in rows], dtype=torch.long)
        return candidates, valid

    def _process(self, block: _Block, logits: torch.Tensor) -> list[torch.Tensor]:
        """Per row, its processed scores `[len(block) + 1, V]`, each position with its own prefix."""
        blocks = block.blocks
        processed = self.rows.process(
            [
                (row.processors, row.ids(blocks[r][:j]), logits[r : r + 1, j])
                for r, row in enumerate(self.state)
                for j in range(len(blocks[r]) + 1)
            ]
        )
        scores, offset = [], 0
        for r in range(len(self.state)):
            pieces = processed[offset : offset + len(blocks[r]) + 1]
            scores.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))  # one position: no copy
            offset += len(blocks[r]) + 1
        return scores

    def _accept(self, block: _Block, scores: list[torch.Tensor]) -> _Outcome:
        """Acceptance for every row in one call, then the cut at the first stopping criterion.

        Rows that finished before this round are fed their pad filler and the pad token, with no
        draw; without a pad id they take the target's token like an empty draft (plain decoding
        runs them on too).
        """
        num_rows = len(self.state)
        # The pad is None only where every row decides below, and a deciding row's entry is replaced.
        emitted: list[list[int]] = [[*block.blocks[r], cast(int, self.pad)] for r in range(num_rows)]
        accepted, codes = [0] * num_rows, [0] * num_rows
        deciding = [r for r, row in enumerate(self.state) if not row.finished or self.pad is None]
        if not deciding:
            return _Outcome(emitted, accepted, codes)
        if not self.plan.do_sample and not any(block.blocks) and not any(row.finished for row in self.state):
            return self._plain_outcome(scores)
        result = accept_blocks(
            self.plan.do_sample,
            [block.blocks[r] for r in deciding],
            [block.probs[r] for r in deciding],
            [scores[r] for r in deciding],
            self.generator,
            self.plan.config.assistant_ensemble_weight,
        )
        tokens = result.tokens()
        running = torch.tensor([not self.state[r].finished for r in deciding], device=result.emitted.device)
        to_cut = AcceptResult(result.num_accepted, result.emitted, torch.where(running, result.num_emitted, 0))
        cut, finish = crop_at_stops(to_cut, self._stop_fn(deciding, tokens, scores))
        for i, (r, kept, n_accepted, code) in enumerate(
            zip(deciding, cut.num_emitted.tolist(), cut.num_accepted.tolist(), finish.tolist(), strict=True)
        ):
            finished = self.state[r].finished
            emitted[r] = tokens[i] if finished else tokens[i][:kept]
            accepted[r] = min(n_accepted, len(block.drafts[r]))
            codes[r] = code
        return _Outcome(emitted, accepted, codes)

    def _plain_outcome(self, scores: list[torch.Tensor]) -> _Outcome:
        """A greedy round in which no row drafted (time off): each row's argmax and its criteria after it, what
        `accept_blocks` and `crop_at_stops` give for empty blocks without their batching (a request in time off
        pays them every round, and under load its round's Python holds the model thread's forwards up)."""
        emitted, codes = [], []
        for r, row in enumerate(self.state):
            token = int(greedy_tokens(scores[r][0]))
            emitted.append([token])
            codes.append(row.stop_code([token], scores[r][0:1]))
        return _Outcome(emitted, [0] * len(self.state), codes)

    def _stop_fn(
        self, deciding: list[int], tokens: list[list[int]], scores: list[torch.Tensor]
    ) -> Callable[[int], torch.Tensor]:
        """`crop_at_stops`' check: each running row's criteria after its first `j` emitted tokens."""
        fired: set[int] = set()

        def stop_fn(j: int) -> torch.Tensor:
            codes = []
            for i, r in enumerate(deciding):
                row, code = self.state[r], 0
                # A row's criteria run only where `crop_at_stops` reads them, as far as its first stop.
                if not row.finished and i not in fired and j <= len(tokens[i]):
                    code = row.stop_code(tokens[i][:j], scores[r][j - 1 : j])
                    if code:
                        fired.add(i)
                codes.append(code)
            return torch.tensor(codes, dtype=torch.long)

        return stop_fn

    def _commit(
        self, outcome: _Outcome, scores: list[torch.Tensor], logits: torch.Tensor
    ) -> list[tuple[list[int], str | None]]:
        """Rows keep what they emitted; returns what the caller sees: real tokens, and a reason once."""
        events: list[tuple[list[int], str | None]] = []
        for r, row in enumerate(self.state):
            emitted, was_finished = outcome.emitted[r], row.finished
            row.generated += emitted
            if outcome.codes[r]:
                self._finish(row, outcome.codes[r])
            # Kept only when asked for, and copied: a view would keep the round's whole block alive
            # (a request otherwise holds ~2 x (k + 1) x vocab floats per round until it ends).
            if self.keep_scores:
                row.scores += list(scores[r][: len(emitted)].clone())
            if self.keep_logits:
                row.logits += list(logits[r, : len(emitted)].clone())
            if was_finished:
                events.append(([], None))
            else:
                events.append((emitted, row.reason if row.finished else None))
        return events

    def _discard(self, block: _Block, outcome: _Outcome) -> None:
        """Forget what was not kept: slots after the accepted drafts (the last emitted token is the next
        round's input, not yet in the cache)."""
        kept = [len(e) for e in outcome.emitted]
        physical = [block.k + 1 - n for n in kept]
        real = [len(block.blocks[r]) + 1 - kept[r] for r in range(len(self.state))]
        if any(physical) or any(real):  # a round whose every row kept its whole block (time off) has none
            self.rows.discard(torch.tensor(physical), torch.tensor(real))

    def _feedback(self, outcome: _Outcome) -> None:
        """Tells the drafter, per row, how many drafts were accepted and which tokens came after them."""
        if self.drafter is None:
            return
        appended = [outcome.emitted[r][outcome.accepted[r] :] for r in range(len(self.state))]
        try:
            self.drafter.feedback(outcome.accepted, appended, [row.finished for row in self.state])
        except DraftFailure as exc:
            self._drafter_failed(exc)

    def result(self) -> GenerationResult:
        state = self.state
        length = max(cast(int, row.finish_length) for row in state)  # set: result() follows done()
        sequences = torch.stack(
            [torch.cat([row.prompt, row.prompt.new_tensor(row.generated[:length])]) for row in state]
        )
        scores = logits = None
        if self.keep_scores:
            scores = tuple(torch.stack([row.scores[t] for row in state]) for t in range(length))
        if self.keep_logits:
            logits = tuple(torch.stack([row.logits[t] for row in state]) for t in range(length))
        if not self.plan.config.return_dict_in_generate:
            scores = logits = None
        return GenerationResult(
            sequences=sequences,
            scores=scores,
            logits=logits,
            finish_reasons=[row.reason or FINISH_LENGTH for row in state],
            prompt_length=self.input_len,
        )


def accept_blocks(
    do_sample: bool,
    blocks: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    scores: list[torch.Tensor],
    generator: torch.Generator | None,
    ensemble_weight: float | None = None,
) -> AcceptResult:
    """
    Verifies every row's block in one call of the acceptance functions (`speculation.acceptance`).

    Greedy decoding accepts the drafts equal to the target's argmax; sampling uses rejection sampling
    when every row that drafted brought the draft's probabilities, else the target's own samples
    (transformers' "case 2", exact whatever the draft). Rows draw in row order, each only what its own
    block needs, so the draws are those of one call per row.

    Args:
        do_sample (`bool`):
            Sampling (else greedy).
        blocks (`list[list[int]]`):
            Per row, its draft tokens (possibly none).
        draft_probs (`list[torch.Tensor | None]`):
            Per row, the draft's probabilities, of shape `(>= len(block), vocab)`, or `None`.
        scores (`list[torch.Tensor]`):
            Per row, the target's processed scores of shape `(len(block) + 1, vocab)`.
        generator (`torch.Generator`, *optional*):
            The request's randomness.
        ensemble_weight (`float`, *optional*):
            transformers' `assistant_ensemble_weight`: applied as transformers applies it, only where
            the draft's probabilities came with the drafts (a draft model; transformers refuses it with
            prompt lookup).

    Returns:
        `AcceptResult` over the rows.
    """
    device = scores[0].device
    k = max(len(block) for block in blocks)
    drafts = torch.tensor([block + [0] * (k - len(block)) for block in blocks], dtype=torch.long, device=device)
    lengths = torch.tensor([len(block) for block in blocks])  # only read on the host: it stays on the CPU
    drafted = [r for r, block in enumerate(blocks) if block]
    q: torch.Tensor | None = None  # [rows, k, V], the drafts' distributions when every drafted row has them
    if drafted and all(draft_probs[r] is not None for r in drafted):
        pieces = [
            cast(torch.Tensor, draft_probs[r])[: len(blocks[r])].to(device) if blocks[r] else None
            for r in range(len(blocks))
        ]
        q = _padded(pieces, k, like=pieces[drafted[0]])
    if not do_sample:
        if q is None or ensemble_weight is None:
            return greedy_accept(drafts, lengths, _padded(scores, k + 1))
        return greedy_accept(
            drafts, lengths, _padded(scores, k + 1), draft_probs=q.to(scores[0].dtype), ensemble_weight=ensemble_weight
        )
    # Each row's softmax is computed on its own scores, as a per-row call computes it.
    target_probs = _padded([row_scores.softmax(-1) for row_scores in scores], k + 1)  # [rows, k + 1, V]
    if q is not None:
        return rejection_sample(drafts, lengths, q, target_probs, generator, ensemble_weight=ensemble_weight)
    return sampled_accept_without_draft_probs(drafts, lengths, target_probs, generator)


def _padded(pieces: Sequence[torch.Tensor | None], width: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """Stacks per-row `[n, V]` pieces into `[rows, width, V]`, zeros after each row's `n` (never read)."""
    like = like if like is not None else cast(torch.Tensor, pieces[0])  # without `like`, every piece is given
    out = like.new_zeros((len(pieces), width, like.shape[-1]))
    for r, piece in enumerate(pieces):
        if piece is not None:
            out[r, : piece.shape[0]] = piece
    return out


def _grammar_allowed(row: _Row, draft: list[int]) -> list[int]:
    """The draft cut before the first token a structured-output grammar forbids: the verify forward
    masks that position, so the token could only be rejected. Exact for greedy decoding and for drafts
    without probabilities (whatever rule proposes them, the target's own draw decides)."""
    if draft:
        for processor in row.processors:
            allowed = getattr(processor, "allowed_prefix_length", None)
            if allowed is not None:
                draft = draft[: allowed(row.ids()[0], draft)]
    return draft


def _greedy_or_sample(plan: GenerationPlan, scores: torch.Tensor, generator: torch.Generator | None) -> int:
    if plan.do_sample:
        return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
    return int(greedy_tokens(scores))


def _unpadded(row: _Row, mask: torch.Tensor | None) -> list[int]:
    prompt = row.prompt if mask is None else row.prompt[mask.bool()]
    return prompt.tolist() + row.generated


def _close(drafter: Drafter) -> None:
    try:
        drafter.close()
    except Exception:  # noqa: BLE001 - a broken drafter must not break the request
        pass
    return None
