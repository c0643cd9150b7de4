"""One thread per process runs the model's forwards.

Why. torch's CPU kernels parallelise with OpenMP, and libgomp keeps a worker pool for every thread
that opens a parallel region. Once the pooled workers of all threads outnumber the cores, libgomp
stops spinning between parallel regions and parks its workers, so every matmul of a forward pays a
wake-up. Measured on 2 cores with SmolLM2: a decode step takes 32 ms on the first thread that runs
forwards and 52 ms on a second one. So each service runs its forwards on one thread only
(`model_executor`, or a thread that calls `claim_torch_threads` first), and threads that only do
small per-row tensor work run single-threaded (`torch.set_num_threads(1)` there opens no pool).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch


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


def model_executor(name: str) -> ThreadPoolExecutor:
    """A single-thread executor for the model's forwards, with the process's torch thread count."""
    return ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix=name,
        initializer=claim_torch_threads,
        initargs=(torch.get_num_threads(),),
    )


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
