"""One thread per process runs the model's forwards.

Why. torch's CPU kernels parallelise with OpenMP, and libgomp keeps a worker pool for every thread
that opens a parallel region. Once the pooled workers of all threads outnumber the cores, libgomp
stops spinning between parallel regions and parks its workers, so every matmul of a forward pays a
wake-up. Measured on 2 cores with SmolLM2: a decode step takes 32 ms on the first thread that runs
forwards and 52 ms on a second one. So each service runs its forwards on one thread only
(`ModelExecutor`, or a thread that calls `claim_torch_threads` first), and threads that only do
small per-row tensor work run single-threaded (`torch.set_num_threads(1)` there opens no pool).

A stopping service joins the threads that run torch work within a bound (`join_or_report`): one still in a
forward when Python finalizes aborts the process, and one stuck on its device would hold the exit forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger("specwire.model_thread")


def claim_torch_threads(threads: int) -> None:
    """Make the calling thread run torch ops with `threads` OpenMP threads.

    torch initialises a thread's count lazily, from the last count any thread set, on its first
    parallel op; that first op is forced here so the explicit count is the one that sticks.
    """
    torch.get_num_threads()
    torch.set_num_threads(threads)


@contextlib.contextmanager
def without_thread_pool() -> Iterator[None]:
    """Run the calling thread's torch ops single-threaded, so they open no OpenMP pool, and restore its count after.

    For heavy one-off work on a thread that will not run the forwards, before they start: `quantize_int8` on
    the main thread opened a pool there that made every later decode step on the model thread ~25% slower
    (SmolLM2, 8 rows, 2 cores: 77 ms against 61).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class ModelExecutor(ThreadPoolExecutor):
    """A single-thread executor for the model's forwards, with the process's torch thread count.

    Args:
        name (`str`): its thread's name prefix.
    """

    def __init__(self, name: str):
        super().__init__(
            max_workers=1, thread_name_prefix=name, initializer=claim_torch_threads, initargs=(torch.get_num_threads(),)
        )
        # Started now, so `close` always has the thread to wait for.
        self.thread: threading.Thread = self.submit(threading.current_thread).result()

    def close(self, timeout: float) -> None:
        """Drop the work not started and wait up to `timeout` seconds for the running one (see `join_or_report`)."""
        self.shutdown(wait=False, cancel_futures=True)
        join_or_report([self.thread], timeout)


# How long a stopping service waits for each kind of thread it started (scheduler, requests', model thread).
STOP_TIMEOUT_S = 10.0
# Threads that did not end when their service stopped them: a forward stuck on its device.
_stuck: list[str] = []


def join_or_report(threads: list[threading.Thread], timeout: float) -> None:
    """Join `threads`, waiting `timeout` seconds in all; the ones still running are logged and remembered
    (`stuck_threads`): the service's process then exits without waiting for them or finalizing around them
    (`exit_if_stuck`), since an executor's thread would hold the exit forever and a daemon thread woken inside
    torch during finalization aborts the process."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    if stuck:
        log.error(
            "still running %.0fs after the service stopped them (a forward stuck on its device?): %s",
            timeout,
            ", ".join(stuck),
        )
        _stuck.extend(stuck)


def stuck_threads() -> list[str]:
    """The threads `join_or_report` found still running (none: every service thread ended)."""
    return list(_stuck)


def exit_if_stuck(service: str) -> None:
    """End a stopped service's process at once, with exit status 1, when a thread it ran torch work on did not
    end (`stuck_threads`); nothing when every one ended."""
    if _stuck:
        print(f"{service}: exiting without waiting for {', '.join(_stuck)}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)


# Messages of the errors a broken accelerator raises (CUDA/ROCm runtime, cuBLAS/cuDNN, NCCL). After
# one of them the device context is unusable for the process: every later forward fails too, so the
# service must say NOT_SERVING and be restarted, unlike a failure caused by one request's input.
_DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "cuDNN error",
    "device-side assert",
    "illegal memory access",
    "HIP error",
    "NCCL error",
    "unspecified launch failure",
)


def is_device_error(exc: BaseException) -> bool:
    """Whether `exc` (raised by a forward) says the accelerator itself failed.

    Out-of-memory is not one: it depends on the load and the next forward may fit.
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _DEVICE_ERROR_MARKERS)
