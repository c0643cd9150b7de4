"""What the batched scheduler has done (`SchedulerStats`), for observability and tests."""

from __future__ import annotations

import dataclasses

# Cancellations kept for `SchedulerStats.cancellations` (the most recent ones).
CANCELLATIONS_KEPT = 64


@dataclasses.dataclass
class SchedulerStats:
    """
    Counters of a `BatchScheduler` since start-up, and gauges at the moment `BatchScheduler.stats()` ran.

    The scheduler updates one instance under its lock; `stats()` hands out a copy (every field is
    immutable), so a reader never sees a half-recorded forward.

    Args:
        forwards (`int`): packed forwards run.
        tokens_run (`int`): tokens through packed forwards.
        shared_forwards (`int`): packed forwards that ran the work of two requests or more.
        requests_peak (`int`): most requests in one packed forward.
        rows_peak (`int`): most rows (KV slots) running at once.
        forward_seconds (`float`): time in packed forwards.
        gather_seconds (`float`): time between packed forwards (requests' own work, gathering).
        process_batches (`int`): batched logits-processing runs.
        shared_process_batches (`int`): those with two requests or more.
        lane_forwards (`int`): sequential-lane model calls run on the scheduler thread.
        cancellations (`tuple[tuple[int, int], ...]`): `(forwards when cancelled, forwards when its
            slots were freed)` of the last cancelled requests, oldest first.
        running (`int`): requests holding slots (gauge).
        queued (`int`): requests waiting for slots (gauge).
        drafting (`int`): running requests waiting on their drafter (gauge).
        free_slots (`int`): KV slots free (gauge).
    """

    forwards: int = 0
    tokens_run: int = 0
    shared_forwards: int = 0
    requests_peak: int = 0
    rows_peak: int = 0
    forward_seconds: float = 0.0
    gather_seconds: float = 0.0
    process_batches: int = 0
    shared_process_batches: int = 0
    lane_forwards: int = 0
    cancellations: tuple[tuple[int, int], ...] = ()
    running: int = 0
    queued: int = 0
    drafting: int = 0
    free_slots: int = 0

    def record_forward(self, requests: int, tokens: int, seconds: float, gathering_seconds: float) -> None:
        """A packed forward of `requests` requests ran `tokens` tokens in `seconds`, after
        `gathering_seconds` since the previous one ended."""
        self.forwards += 1
        self.tokens_run += tokens
        self.forward_seconds += seconds
        self.gather_seconds += gathering_seconds
        self.requests_peak = max(self.requests_peak, requests)
        if requests > 1:
            self.shared_forwards += 1

    def record_processing(self, requests: int) -> None:
        """A batched logits-processing run over `requests` requests."""
        self.process_batches += 1
        if requests > 1:
            self.shared_process_batches += 1

    def record_rows(self, rows: int) -> None:
        """`rows` KV slots are taken now."""
        self.rows_peak = max(self.rows_peak, rows)

    def record_cancellation(self, cancelled_at: int, freed_at: int) -> None:
        """A cancelled request's slots were freed (forward counts at both moments)."""
        self.cancellations = (*self.cancellations, (cancelled_at, freed_at))[-CANCELLATIONS_KEPT:]
