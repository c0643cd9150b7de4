"""Keep freed tensor memory from piling up in glibc's heap in long-running model services.

glibc serves large allocations with mmap and returns them to the system on free, but it raises that
threshold to the size of each large block freed (up to 32 MiB). A service that frees a verify
block's logits (17 x 49152 floats, 3.3 MB) from one thread and allocates other sizes from others then
serves them all from the heap, where they fragment and stay resident. Measured on the target with
SmolLM2 and 8 concurrent prompt-lookup clients: 1334 MB resident afterwards with the default
behaviour, 1088 MB with a fixed 1 MiB threshold. A fixed threshold turns the adjustment off; blocks
under it (one row's logits, 196 KB) keep the heap's speed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def fix_mmap_threshold(size: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve allocations of `size` bytes or more with mmap, always (glibc only; a no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt), or no libc to load
        return False
    done = mallopt(_M_MMAP_THRESHOLD, size) == 1
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", size)
    return done
