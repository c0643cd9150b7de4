"""What speculation did for one request: counts per round, summed over rows, for responses and tracing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from specwire.vocabulary import PROPOSER_NONE

__all__ = ["MAX_LENGTH_RUNS", "RoundRecord", "SpeculationStats"]

# Runs of equal draft lengths kept per request (`SpeculationStats.length_runs`): a response stays small
# however long the request; the rounds past them are only counted (`length_rounds_dropped`).
MAX_LENGTH_RUNS = 256


class RoundRecord(NamedTuple):
    """One speculative round, for tracing: one span each (`start_ns`/`end_ns` are `time.time_ns()`)."""

    rows: int
    asked: int
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    start_ns: int = 0
    end_ns: int = 0
    drafted_rows: int = 0  # rows that got a non-empty draft: the round's number of drafts


@dataclass
class SpeculationStats:
    """What speculation did for one request (summed over rows and rounds)."""

    proposer: str = PROPOSER_NONE
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    fallback_reason: str = ""
    # A remote draft with overlap: rows whose proposals came from the block drafted ahead while the
    # target verified (hits), and rows whose block drafted ahead was discarded (misses).
    draft_ahead_hits: int = 0
    draft_ahead_misses: int = 0
    # Who chose the draft lengths: "controller" (the adaptive controller) or "schedule" (a named or
    # constant schedule: transformers' `num_assistant_tokens(_schedule)`, `prompt_lookup_num_tokens`).
    decided_by: str = ""
    # The draft length asked each round, run-length encoded: `[(length, rounds), ...]` in round order,
    # 0 for a round without drafting; at most MAX_LENGTH_RUNS runs.
    length_runs: list[tuple[int, int]] = field(default_factory=list)
    length_rounds_dropped: int = 0
    # Tokens decoded while the controller took time off (rounds it chose not to draft), and its probes.
    tokens_without_draft: int = 0
    probes: int = 0
    # One entry per round with a draft: (rows, asked, drafted, accepted, draft_s, verify_s, start_ns,
    # end_ns, drafted_rows), for tracing.
    round_log: list[RoundRecord] = field(default_factory=list)

    def record_length(self, length: int) -> None:
        """One round asked for `length` draft tokens (0: no draft)."""
        if self.length_rounds_dropped:  # past the cap: later rounds are only counted, in order
            self.length_rounds_dropped += 1
        elif self.length_runs and self.length_runs[-1][0] == length:
            self.length_runs[-1] = (length, self.length_runs[-1][1] + 1)
        elif len(self.length_runs) < MAX_LENGTH_RUNS:
            self.length_runs.append((length, 1))
        else:
            self.length_rounds_dropped += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def observe_round(
        self,
        drafted: list[int],
        accepted: list[int],
        *,
        asked: int,
        draft_s: float,
        verify_s: float,
        start_ns: int,
        end_ns: int,
    ) -> None:
        """
        Adds one verified round. A round in which no row drafted counts for nothing (not even a round).

        Args:
            drafted (`list[int]`):
                Per row, the draft tokens it verified.
            accepted (`list[int]`):
                Per row, how many of them the target accepted.
            asked (`int`):
                The draft length the drafter was asked for.
            draft_s (`float`), verify_s (`float`):
                Seconds spent drafting and verifying (already added to `draft_seconds`/`verify_seconds`).
            start_ns (`int`), end_ns (`int`):
                The round's `time.time_ns()` span.
        """
        for row_drafted, row_accepted in zip(drafted, accepted, strict=True):
            if not row_drafted:
                continue
            for position in range(row_accepted):
                if position == len(self.accepted_by_position):
                    self.accepted_by_position.append(0)
                self.accepted_by_position[position] += 1
        drafted_now = sum(drafted)
        if not drafted_now:
            return
        accepted_now = sum(accepted)
        self.rounds += 1
        self.drafted_tokens += drafted_now
        self.accepted_tokens += accepted_now
        self.round_log.append(
            RoundRecord(
                len(drafted),
                asked,
                drafted_now,
                accepted_now,
                draft_s,
                verify_s,
                start_ns,
                end_ns,
                sum(1 for n in drafted if n),
            )
        )
