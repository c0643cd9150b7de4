"""What speculation did for one request: counts per round, summed over rows, for responses and tracing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

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

    proposer: str = "none"
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    fallback_reason: str = ""
    # One entry per round with a draft: (rows, asked, drafted, accepted, draft_s, verify_s, start_ns,
    # end_ns, drafted_rows), for tracing.
    round_log: list[RoundRecord] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
