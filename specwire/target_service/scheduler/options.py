"""Which scheduler the target service runs (`SchedulerKind`, `--scheduler`) and the batched one's limits."""

from __future__ import annotations

import dataclasses
import enum


class SchedulerKind(enum.StrEnum):
    """How the target service runs its requests' forwards (`--scheduler`).

    A `StrEnum`, so `"batched"` from a flag, an environment variable or a caller compares equal.
    """

    # One request per forward, on one model thread (`Engine`'s own path).
    SEQUENTIAL = "sequential"
    # One packed forward per step for every running request (`BatchScheduler`), with a sequential
    # lane for the requests the slot cache cannot serve.
    BATCHED = "batched"


@dataclasses.dataclass
class SchedulerOptions:
    """
    Limits of the batched scheduler.

    Args:
        max_batch_rows (`int`, defaults to 16):
            Rows (KV slots) running at once; a request takes `batch * max(num_beams, num_return_sequences)`.
        max_tokens_per_step (`int`, defaults to 256):
            Tokens per forward; prefills are chunked to fit (decode and verify rows are never cut).
        max_queued (`int`, defaults to 64):
            Requests waiting for slots before RESOURCE_EXHAUSTED.
        slot_tokens (`int`, *optional*):
            Positions per slot (prompt + new tokens); defaults to `min(max_position_embeddings, 2048)`.
            Longer requests run in the sequential lane.
        kv_cache_mb (`float`, defaults to 2048):
            Memory budget of the slot cache; the slot count is reduced to fit.
        gather_fraction (`float`, defaults to 0.5):
            How long (as a fraction of the last forward's time) a forward waits for running requests
            still preparing their next step.
        min_prefill_tokens (`int`, defaults to 32):
            Prefill tokens every forward runs when some are waiting, even past the token budget.
        max_lane_requests (`int`, defaults to 4):
            Requests running in the sequential lane at once (their `DynamicCache`s live outside
            `kv_cache_mb`); beyond that a lane request fails with RESOURCE_EXHAUSTED and a retry hint.
        lean_forward (`bool`, defaults to `True`):
            Run packed forwards through `LeanDecoder` (same ops and logits as the model's own forward,
            without its module machinery) when the model has the Llama layout and the start-up probe
            finds its logits bitwise equal to the model's; else through `model(...)`.
    """

    max_batch_rows: int = 16
    max_tokens_per_step: int = 256
    max_queued: int = 64
    slot_tokens: int | None = None
    kv_cache_mb: float = 2048.0
    gather_fraction: float = 0.5
    min_prefill_tokens: int = 32
    max_lane_requests: int = 4
    lean_forward: bool = True

    def __post_init__(self) -> None:
        for name in ("max_batch_rows", "max_tokens_per_step", "min_prefill_tokens", "max_lane_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.slot_tokens is not None and self.slot_tokens < 2:
            raise ValueError(f"slot_tokens must be >= 2, got {self.slot_tokens}")
