"""What speculation did for one request: counts per round, summed over rows, for responses and tracing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from specwire.vocabulary import PROPOSER_NONE

__all__ = ["RoundRecord", "SpeculationStats"]


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
    # One entry per round with a draft: (rows, asked, drafted, accepted, draft_s, verify_s, start_ns,
    # end_ns, drafted_rows), for tracing.
    round_log: list[RoundRecord] = field(default_factory=list)

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
