"""Thread pools whose threads all exist from the start.

`ThreadPoolExecutor` starts a thread per submitted task until it has `max_workers`, so a service's
thread count creeps up under its first concurrent requests and looks like a leak to anyone counting
threads (the leak tests, the soak, an operator's dashboard). A pool built here is full at once: its
thread count is a constant of the configuration.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait


def eager_thread_pool(workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A `ThreadPoolExecutor` of `workers` threads, every one of them started before it is returned."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=thread_name_prefix)
    # Each task holds its thread until all have one, so the pool must start `workers` threads.
    everyone = threading.Barrier(workers)
    wait([pool.submit(everyone.wait) for _ in range(workers)])
    return pool
