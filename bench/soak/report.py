"""The soak's outputs: progress lines, soak.json, soak.md (the figures the README quotes) and soak.png."""

from __future__ import annotations

import json
from pathlib import Path

from bench.soak.evaluate import JUDGED_METRICS
from bench.soak.kinds import EXPECTED, USES_REGISTRY

SERVICES = ("target", "draft", "config")


def request_totals(recorder) -> dict:
    """The recorder's counts as JSON."""
    return {
        "total": sum(recorder.by_outcome.values()),
        "by_outcome": dict(recorder.by_outcome),
        "by_code": dict(recorder.by_code),
        "by_kind": {kind: dict(codes) for kind, codes in sorted(recorder.by_kind.items())},
        "unexpected_by_kind": dict(recorder.unexpected_by_kind),
        "internal_messages": dict(recorder.internal_messages),
        "draft_model_fallbacks": recorder.draft_fallbacks,
        "failures": recorder.failures,
    }


def _mb(kib) -> str:
    return "-" if kib is None else f"{kib / 1024:.0f}MB"


def progress_line(rows: list[dict], interval: dict, recorder) -> str:
    """One line per interval: each service's RSS/threads/fds/health and the interval's request outcomes."""
    t, outcomes = interval["t"], interval["by_outcome"]
    parts = []
    for row in sorted(rows, key=lambda r: SERVICES.index(r["service"])):
        if row["rss_kib"] is None:
            parts.append(f"{row['service']} DOWN")
        else:
            parts.append(
                f"{row['service']} {_mb(row['rss_kib'])} {row['threads']}thr {row['fds']}fd"
                + ("" if row["health"] == "SERVING" else f" {row['health']}")
            )
    done = ", ".join(f"{outcomes.get(k, 0)} {k}" for k in ("finished", "expected_status", "unexpected"))
    if interval["finished_max_s"] is not None:
        done += f" (finished in {interval['finished_median_s']:.1f}s median, {interval['finished_max_s']:.1f}s max)"
    total = recorder.by_outcome
    return (
        f"t={t:5.0f}s | " + " | ".join(parts) + f" | {done} (total {sum(total.values())}, "
        f"{total.get('unexpected', 0)} unexpected, {recorder.by_code.get('INTERNAL', 0)} INTERNAL)"
    )


def _level(value, metric: str) -> str:
    if value is None:
        return "-"
    return _mb(value) if metric == "rss_kib" else f"{value:g}"


def _resource_rows(results: dict) -> list[str]:
    rows = [
        "| service | metric | pid | from-to (s) | first sample | level at warm-up end | level at end | change "
        "| peak after warm-up | slope (%/h) | flat (<= +5%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    labels = {"rss_kib": "RSS", "threads": "threads", "fds": "open fds"}
    for service in SERVICES:
        for metric, segments in results["resources"].get(service, {}).items():
            for seg in segments:
                span = f"{seg['from_s']:.0f}-{seg['to_s']:.0f}"
                if not seg["judged"]:
                    rows.append(
                        f"| {service} | {labels[metric]} | {seg['pid']} | {span} | {_level(seg['first'], metric)} "
                        f"| not judged ({seg['reason']}) | {_level(seg['last'], metric)} | | | | |"
                    )
                    continue
                verdict = ("yes" if seg["flat"] else "**no**") if metric in JUDGED_METRICS else "(not a target)"
                rows.append(
                    f"| {service} | {labels[metric]} | {seg['pid']} | {span} | {_level(seg['first'], metric)} "
                    f"| {_level(seg['start_level'], metric)} | {_level(seg['end_level'], metric)} "
                    f"| {100 * seg['change']:+.1f}% | {_level(seg['peak'], metric)} ({100 * seg['peak_change']:+.1f}%) "
                    f"| {seg['slope_pct_per_hour']:+.1f} | {verdict} |"
                )
    return rows


def _idle_rows(results: dict) -> list[str]:
    before = {r["service"]: r for r in results["idle"]["before"]}
    after = {r["service"]: r for r in results["idle"]["after"]}
    rows = [
        "| service | RSS before | RSS after | threads before | threads after | fds before | fds after | pid changed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for service in SERVICES:
        b, a = before.get(service, {}), after.get(service, {})
        rows.append(
            f"| {service} | {_mb(b.get('rss_kib'))} | {_mb(a.get('rss_kib'))} | {b.get('threads', '-')} "
            f"| {a.get('threads', '-')} | {b.get('fds', '-')} | {a.get('fds', '-')} "
            f"| {'yes (restarted by a fault)' if b.get('pid') != a.get('pid') else 'no'} |"
        )
    return rows


def _request_rows(results: dict) -> list[str]:
    requests = results["requests"]
    codes = sorted({code for counts in requests["by_kind"].values() for code in counts})
    rows = [
        "| kind | expected statuses | " + " | ".join(codes) + " | unexpected |",
        "|---|---|" + "---|" * len(codes) + "---|",
    ]
    unexpected = requests["unexpected_by_kind"]
    for kind, counts in requests["by_kind"].items():
        bad = sum(n for key, n in unexpected.items() if key.split(" -> ")[0] == kind)
        expected = ", ".join(sorted(EXPECTED[kind])) + (
            " (+UNAVAILABLE in a registry restart)" if kind in USES_REGISTRY else ""
        )
        rows.append(
            f"| {kind} | {expected} | "
            + " | ".join(str(counts.get(code, "")) for code in codes)
            + f" | {'**' + str(bad) + '**' if bad else 0} |"
        )
    totals = requests["by_code"]
    rows.append(
        "| **all** | | "
        + " | ".join(f"**{totals.get(code, 0)}**" for code in codes)
        + f" | **{sum(unexpected.values())}** |"
    )
    return rows


def markdown(results: dict) -> str:
    meta = results["meta"]
    requests = results["requests"]
    outcome = requests["by_outcome"]
    lines = [
        f"# Soak: {meta['minutes']:g} minutes, {meta['clients']} clients, {meta['model_id']}",
        "",
        f"- Date {meta['date']}, commit `{(meta.get('git_commit') or '?')[:12]}`"
        + (" (uncommitted changes)" if meta.get("git_dirty") else "")
        + f"; `{meta['command']}`",
        f"- Machine: {meta['machine']['cpu_model']}, {meta['machine']['usable_cores']} usable cores, "
        f"{meta['machine']['ram_gib']} GiB; torch {meta['versions']['torch']}, transformers "
        f"{meta['versions']['transformers']}",
        f"- Target `{meta['model']}` on {meta['device']} ({meta['dtype']}); draft service `{meta['draft_model']}`"
        + (f" **{meta['draft_service_note']}**" if meta["draft_service_note"] else ""),
        f"- {meta['max_new_tokens']} new tokens per normal request, deadlines {meta['request_timeout_s']:g} s "
        f"(normal) and {meta['hostile_timeout_s']:g} s (bad or over-limit); samples every {meta['interval_s']:g} s; "
        f"warm-up {meta['warmup_s']:.0f} s; ran {meta['elapsed_s']:.0f} s",
        *([f"- Note: {meta['note']}"] if meta.get("note") else []),
        "",
        "## Targets",
        "",
        "| target | goal | measured | met |",
        "|---|---|---|---|",
    ]
    for target in results["targets"]:
        measured = target["measured"]
        if isinstance(measured, float):
            measured = f"{100 * measured:+.1f}%"
        verdict = {True: "met", False: "**MISSED**", None: "not judged"}[target["met"]]
        detail = f" ({target['detail']})" if target["detail"] else ""
        lines.append(f"| {target['name']} | {target['goal']} | {measured}{detail} | {verdict} |")
    if results["client_crashes"]:
        lines += ["", "Soak client problems: " + "; ".join(results["client_crashes"])]
    lines += [
        "",
        "## Requests",
        "",
        f"{requests['total']} requests: {outcome.get('finished', 0)} finished, "
        f"{outcome.get('expected_status', 0)} got their documented status, "
        f"**{outcome.get('unexpected', 0)} unexpected**. Draft-model requests that fell back to plain decoding: "
        f"{requests['draft_model_fallbacks']}. CANCELLED is the client's own cancel of a stream after two deltas.",
        "",
        *_request_rows(results),
    ]
    if results["mix"]["left_out"]:
        lines += ["", "Left out of the mix: " + "; ".join(f"{k} ({v})" for k, v in results["mix"]["left_out"].items())]
    lines += [
        "",
        "## Services over time",
        "",
        "Levels are medians of the first and last 10% (at least 3) of the samples after warm-up; flat means "
        "the end level is at most 5% above the warm-up-end level (see `bench/soak/evaluate.py`). A restarted "
        "service is a new process (pid) and is judged on its own.",
        "",
        *_resource_rows(results),
        "",
        "Idle before the load and idle after it (the load stopped, a few seconds to settle):",
        "",
        *_idle_rows(results),
        "",
        "![RSS, threads and open fds over time](soak.png)",
        "",
        "## Faults",
        "",
    ]
    if results["faults"]:
        lines += ["| fault | planned (s) | down (s) | healthy again (s) | pid | error |", "|---|---|---|---|---|---|"]
        for f in results["faults"]:
            up = "never" if f["up_s"] is None else f"{f['up_s']:.1f}"
            lines.append(
                f"| {f['name']} | {f['planned_s']:.0f} | {f['down_s']:.1f} | {up} | {f['old_pid']} -> {f['new_pid']} "
                f"| {f['error'] or ''} |"
            )
    else:
        lines.append("No faults were injected.")
    if results["unexpected_exits"]:
        lines += ["", "Service processes gone outside a fault window:"]
        lines += [f"- {d['service']} pid {d['pid']} at {d['t']:.0f} s" for d in results["unexpected_exits"]]
    if requests["internal_messages"]:
        lines += ["", "## INTERNAL responses", ""]
        lines += [f"- {n} x {message}" for message, n in requests["internal_messages"].items()]
    if requests["failures"]:
        lines += ["", f"## Unexpected outcomes (first {min(len(requests['failures']), 40)})", ""]
        for f in requests["failures"][:40]:
            note = f" {f['note']}" if f["note"] else ""
            lines.append(
                f"- {f['start_s']:.0f} s, {f['kind']}{note} -> {f['code']} after {f['seconds']:.2f} s: "
                f"{f['message'][:200]}"
            )
    lines += ["", f"Service logs of this run: `{meta['service_logs']}` (not kept with the results)."]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """RSS, threads and open fds per service, and requests by outcome, over time; warm-up and faults shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load = [s for s in results["samples"] if s["phase"] == "load"]
    figure, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    for axis, metric, label, scale in (
        (axes[0], "rss_kib", "RSS (MB)", 1 / 1024),
        (axes[1], "threads", "threads", 1),
        (axes[2], "fds", "open fds", 1),
    ):
        for service in SERVICES:
            points = [(s["t"], s[metric] * scale) for s in load if s["service"] == service and s[metric] is not None]
            if points:
                axis.plot(*zip(*points, strict=True), marker=".", linewidth=1, label=service)
        axis.axvspan(0, results["meta"]["warmup_s"], color="grey", alpha=0.15)
        for fault in results["faults"]:
            end = fault["up_s"] if fault["up_s"] is not None else fault["down_s"] + 1
            axis.axvspan(fault["down_s"], end, color="red" if fault["service"] == "draft" else "orange", alpha=0.25)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    requests = axes[3]
    during = [i for i in results["intervals"] if not i.get("after_load")]
    times = [i["t"] for i in during]
    for outcome, color in (("finished", "tab:green"), ("expected_status", "tab:blue"), ("unexpected", "tab:red")):
        requests.plot(
            times,
            [i["by_outcome"].get(outcome, 0) for i in during],
            marker=".",
            linewidth=1,
            color=color,
            label=outcome,
        )
    requests.set_ylabel("requests ended per interval")
    requests.legend(loc="upper left")
    axes[0].legend(loc="upper left")
    axes[0].set_title(
        "Services during the soak (grey: warm-up; red: draft killed until healthy; orange: config restart)"
    )
    axes[-1].set_xlabel("seconds since the load started")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def write(results: dict, folder: Path) -> list[Path]:
    """soak.json, soak.md and soak.png in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "soak.json", folder / "soak.md", folder / "soak.png"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    plot(results, paths[2])
    paths[1].write_text(markdown(results))
    return paths
