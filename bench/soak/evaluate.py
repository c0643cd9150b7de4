"""The soak's targets, and how "flat" is measured.

Flat within 5%, per service and per process incarnation (a restarted service starts a new one):
- warm-up is the first `warmup_s` seconds of the incarnation (`min(20% of the run, 5 minutes)`);
  an incarnation with fewer than `MIN_JUDGED_SAMPLES` samples after it is "not judged";
- the *start level* is the median of the first 10% (at least 3) of the samples after warm-up,
  the *end level* the median of the last 10% (at least 3);
- flat means `end level <= start level * 1.05`. A median over a window, not single samples, so one
  transient allocation (a beam request's logits) neither passes nor fails a run by itself, while a
  leak, which grows for the whole run, shows at the end.
The peak after warm-up and a least-squares slope (% of the start level per hour) are reported beside
it, unjudged: a slope near zero with a high peak is a spike, a steady slope is a leak.
"""

from __future__ import annotations

import math
import statistics

FLAT_TOLERANCE = 0.05
MIN_JUDGED_SAMPLES = 6
METRICS = ("rss_kib", "threads", "fds")
JUDGED_METRICS = ("rss_kib", "threads")


def warmup_seconds(duration_s: float) -> float:
    return min(0.2 * duration_s, 300.0)


def incarnations(samples: list[dict], service: str) -> list[list[dict]]:
    """The live samples of `service`, split by process id, in time order."""
    groups: list[list[dict]] = []
    for sample in samples:
        if sample["service"] != service or sample.get("rss_kib") is None:
            continue
        if groups and groups[-1][0]["pid"] == sample["pid"]:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def _slope_per_hour(times: list[float], values: list[float]) -> float:
    mean_t, mean_v = statistics.fmean(times), statistics.fmean(values)
    var = sum((t - mean_t) ** 2 for t in times)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values, strict=True)) / var * 3600


def flatness(segment: list[dict], metric: str, warmup_s: float, healthy_from: float = 0.0) -> dict:
    """Start/end levels, change, peak and slope of `metric` over one incarnation (see the module doc).

    `healthy_from` (seconds): when a restarted incarnation became healthy; its warm-up counts from
    there, not from its start, so the model loading is never taken for growth.
    """
    first_t = max(segment[0]["t"], healthy_from)
    post = [s for s in segment if s["t"] >= first_t + warmup_s]
    result = {
        "pid": segment[0]["pid"],
        "from_s": first_t,
        "to_s": segment[-1]["t"],
        "first": segment[0][metric],
        "last": segment[-1][metric],
        "samples_after_warmup": len(post),
    }
    if len(post) < MIN_JUDGED_SAMPLES:
        result.update(judged=False, flat=None, reason=f"{len(post)} samples after warm-up")
        return result
    n = max(3, math.ceil(0.1 * len(post)))
    start = statistics.median(s[metric] for s in post[:n])
    end = statistics.median(s[metric] for s in post[-n:])
    peak = max(s[metric] for s in post)
    slope = _slope_per_hour([s["t"] for s in post], [s[metric] for s in post])
    change = (end - start) / start if start else 0.0
    result.update(
        judged=True,
        start_level=start,
        end_level=end,
        change=round(change, 4),
        peak=peak,
        peak_change=round((peak - start) / start if start else 0.0, 4),
        slope_pct_per_hour=round(100 * slope / start if start else 0.0, 2),
        flat=change <= FLAT_TOLERANCE,
    )
    if metric == "threads":
        result["names_change"] = _names_change(post[0].get("thread_names"), post[-1].get("thread_names"))
    return result


def _names_change(before: dict | None, after: dict | None) -> dict[str, int]:
    """Per thread name (see `monitor.thread_names`), how many more (or fewer) threads at the end."""
    if not before or not after:
        return {}
    change = {name: after.get(name, 0) - before.get(name, 0) for name in sorted(set(before) | set(after))}
    return {name: delta for name, delta in change.items() if delta}


def resources(samples: list[dict], services: list[str], warmup_s: float, faults: list[dict]) -> dict:
    """service -> metric -> one `flatness` dict per incarnation (`faults`: the fault records, as JSON)."""
    healthy_from = {f["new_pid"]: f["up_s"] for f in faults if f["new_pid"] is not None}
    return {
        service: {
            metric: [
                flatness(seg, metric, warmup_s, healthy_from.get(seg[0]["pid"], 0.0))
                for seg in incarnations(samples, service)
            ]
            for metric in METRICS
        }
        for service in services
    }


def evaluate(results: dict) -> None:
    """Fill `results["resources"]` and `results["targets"]` from the samples, faults and counts."""
    load = [s for s in results["samples"] if s["phase"] == "load"]
    services = sorted({s["service"] for s in load})
    results["resources"] = resources(load, services, results["meta"]["warmup_s"], results["faults"])
    results["targets"] = targets(results)


def _target(name: str, goal: str, measured, met: bool | None, detail: str = "") -> dict:
    return {"name": name, "goal": goal, "measured": measured, "met": met, "detail": detail}


def targets(results: dict) -> list[dict]:
    """Every target with its measurement and whether it was met (None: could not be judged)."""
    totals = results["requests"]["by_code"]
    outcomes = results["requests"]["by_outcome"]
    found = [
        _target("no INTERNAL", "0 INTERNAL responses", totals.get("INTERNAL", 0), totals.get("INTERNAL", 0) == 0),
        _target(
            "every request accounted for",
            "0 requests ending outside their kind's documented statuses",
            outcomes.get("unexpected", 0),
            outcomes.get("unexpected", 0) == 0,
            "; ".join(f"{k}: {v}" for k, v in sorted(results["requests"]["unexpected_by_kind"].items())),
        ),
    ]
    labels = {"rss_kib": "RSS", "threads": "threads"}
    for service, metrics in results["resources"].items():
        for metric in JUDGED_METRICS:
            segments = metrics[metric]
            judged = [s for s in segments if s["judged"]]
            worst = max(judged, key=lambda s: s["change"]) if judged else None
            detail = ", ".join(
                f"pid {s['pid']}: {s['start_level']} -> {s['end_level']} ({100 * s['change']:+.1f}%)"
                + (f" [by name: {s['names_change']}]" if s.get("names_change") else "")
                if s["judged"]
                else f"pid {s['pid']}: not judged ({s['reason']})"
                for s in segments
            )
            found.append(
                _target(
                    f"{service} {labels[metric]} flat",
                    "end level within +5% of the level at warm-up end, every incarnation",
                    None if worst is None else worst["change"],
                    None if worst is None else all(s["flat"] for s in judged),
                    detail,
                )
            )
    faults = results["faults"]
    unrecovered = [f for f in faults if f["up_s"] is None]
    found.append(
        _target(
            "faults recovered",
            "every killed/restarted service healthy again",
            f"{len(faults) - len(unrecovered)}/{len(faults)}",
            not unrecovered,
            "; ".join(f"{f['name']} at {f['down_s']:.0f}s: {f['error']}" for f in unrecovered),
        )
    )
    deaths = results["unexpected_exits"]
    found.append(
        _target(
            "no service died on its own",
            "no service process gone outside a fault window",
            len(deaths),
            not deaths,
            "; ".join(f"{d['service']} pid {d['pid']} gone at {d['t']:.0f}s" for d in deaths[:5]),
        )
    )
    unhealthy = {name: status for name, status in results["health_at_end"].items() if status != "SERVING"}
    found.append(
        _target(
            "healthy at the end",
            "every service SERVING after the load",
            len(unhealthy),
            not unhealthy,
            ", ".join(f"{name}: {status}" for name, status in unhealthy.items()),
        )
    )
    return found


def misses(found: list[dict]) -> list[str]:
    """One line per missed target (a target that could not be judged is not a miss)."""
    lines = []
    for target in found:
        if target["met"] is False:
            detail = f" ({target['detail']})" if target["detail"] else ""
            lines.append(f"MISSED {target['name']}: {target['goal']}; measured {target['measured']}{detail}")
    return lines
