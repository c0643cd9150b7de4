"""The specwire side: timed requests to the target service through `specwire.client.TargetClient`."""

from __future__ import annotations

import time
from typing import Any

from bench.reference import Run


def speculation_unavailable(output: Any) -> str | None:
    """Why a request that asked for speculation ran plain decoding, or None when it speculated."""
    stats = output.speculation
    if stats.fallback_reason:
        return stats.fallback_reason
    # The adaptive controller may rightly decode a whole request without drafting: that is its choice
    # (the row's speed says what it cost), not speculation being unavailable.
    chose_not_to = stats.rounds == 0 and getattr(stats, "draft_length_source", "") == "controller"
    if stats.proposer in ("none", "unspecified") or (stats.rounds == 0 and not chose_not_to):
        return f"the target answered proposer={stats.proposer} with {stats.rounds} speculative rounds"
    return None


class Specwire:
    """Timed calls to a running target service (one channel, reused)."""

    def __init__(self, address: str):
        from specwire.client import TargetClient

        self.address = address
        self.client = TargetClient(address)

    def close(self) -> None:
        self.client.close()

    def generate(self, prompt: list[int], **kwargs) -> tuple[Run, Any]:
        """One unary Generate; returns the timing and the client's `GenerateOutput`."""
        started = time.perf_counter()
        output = self.client.generate(input_ids=[prompt], **kwargs)
        seconds = time.perf_counter() - started
        sequence = output.sequences[0].tolist()
        return Run(seconds, len(sequence) - len(prompt), sequence), output

    def stream(self, prompt: list[int], **kwargs) -> tuple[Run, Any]:
        """One GenerateStream; `Run.ttft` is the time to the first token delta, `Run.arrivals` the time to each."""
        started = time.perf_counter()
        arrivals: list[tuple[int, float]] = []
        final = None
        for item in self.client.stream(input_ids=[prompt], **kwargs):
            if hasattr(item, "row"):
                if item.token_ids:
                    count = (arrivals[-1][0] if arrivals else 0) + len(item.token_ids)
                    arrivals.append((count, time.perf_counter() - started))
            else:
                final = item
        seconds = time.perf_counter() - started
        sequence = final.sequences[0].tolist()
        first = arrivals[0][1] if arrivals else None
        return Run(seconds, len(sequence) - len(prompt), sequence, first, arrivals), final
