"""Progress lines on stderr, stamped with the seconds since the benchmark started."""

from __future__ import annotations

import sys
import time

_STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[bench {time.monotonic() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)
