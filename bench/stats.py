"""Summaries of repeated measurements: median with min and max, latency percentiles, ratios of medians,
and `lookup` to read a figure back out of the nested results."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def summarize(values: Sequence[float | None]) -> dict | None:
    """`{"median", "min", "max", "n", "values"}` over the non-None values, or None when there are none."""
    kept = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not kept:
        return None
    return {
        "median": statistics.median(kept),
        "min": min(kept),
        "max": max(kept),
        "n": len(kept),
        "values": kept,
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    data = sorted(values)
    if not data:
        return None
    if len(data) == 1:
        return data[0]
    position = (len(data) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)


def ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    """Ratio of two summaries' medians (None when either is missing or the denominator is zero)."""
    if not numerator or not denominator or not denominator["median"]:
        return None
    return numerator["median"] / denominator["median"]


def lookup(data: Any, *path: str, default: Any = None) -> Any:
    """`data[path[0]][path[1]]...`, or `default` where a level is not a dict or a key is missing or None
    (a workload skipped, failed or not available)."""
    for key in path:
        if not isinstance(data, dict) or key not in data or data[key] is None:
            return default
        data = data[key]
    return data
