"""Batched scheduling: one model forward per step for every running request of the target service.

Design. Each request keeps its own decoding loop, unchanged, running in its own thread; only the
model forward (and batchable logits processing) is shared. The loop's model-side state is a
`SlotRows` (`specwire.runtime.slot_cache`) whose `prefill`/`decode`/`verify` post a `SlotWork` to
the scheduler and block until its logits are back. The scheduler thread gathers the pending work of
every running request, runs ONE packed forward over all of it and hands each request its logits.
Sampling stays in the request's thread with its own `torch.Generator`, so a seeded request gives the
same tokens whatever its neighbours; only float noise of a wider matrix product differs from running
alone (see the slot cache's docstring).

KV cache. A `SlotKVCache` with `max_batch_rows` slots of `slot_tokens` positions each, allocated at
start-up (the memory budget, `kv_cache_mb`, caps the slot count). A request takes one slot per row
when admitted and gives them back when it ends; nobody else's cache moves.

Fairness. Admission is strict FIFO; every running request with pending work is in every forward, so a
long request advances one step per forward however many short ones come and go; prefills are chunked
so a long prompt does not stall the running requests; a request waiting on its draft service is not
waited for (no head-of-line blocking).

Threads. Every forward runs on the scheduler thread (see `specwire.model_thread` for why): the packed
forwards, and the forwards of the sequential lane, which run between two packed forwards. Nothing else
runs there: no request's loop, no draft wait. Why not a forward thread per lane request: a second
thread running forwards with the process's torch thread count makes every forward slower (two OpenMP
pools), and one with a single thread would compete for the same cores anyway.

Liveness (`BatchScheduler.problem`): a dead thread, a device error (sticky: after a CUDA error the
device context is unusable, every request then fails UNAVAILABLE) and a stuck forward loop (work
posted and no forward, processing or lane call done for `stuck_after` seconds); the target's watchdog
turns it into NOT_SERVING.

Modules (at run time each imports only modules listed above it; `request_thread` and `forward_loop`
name `BatchScheduler` for type checking only):
- `options`: `SchedulerKind` (`--scheduler`) and `SchedulerOptions` (the limits).
- `stats`: `SchedulerStats`, the counters and gauges `BatchScheduler.stats()` returns.
- `request`: `Request` and its `RequestState`, `ProcessWork`, `RequestCancelled`.
- `startup_probe`: sizes the slot cache; checks packed forwards and the lean forward on this model.
- `routing`: `lane_reason`, which requests the slot cache serves and which run in the sequential lane.
- `slot_admission`: `SlotAdmission`, the FIFO wait queue, slot allocation, cancellation, retry hints.
- `gather_policy`: when the next forward (or batched processing) runs.
- `request_thread`: `RequestThread`, a request's own thread running its loop.
- `forward_loop`: `ForwardLoop`, the scheduler thread (lane calls, processing, packed forwards).
- `batch_scheduler`: `BatchScheduler`, the shared state under one lock and the engine's entry points.
"""
