"""`specwire watermark detect`: score texts or token ids for a watermark through a running target service."""

from __future__ import annotations

import json
import math
from typing import Any

from .common import (
    DEFAULT_CONFIG_TIMEOUT_S,
    EXIT_OK,
    UsageError,
    add_command,
    add_retries_option,
    add_token_option,
    connected,
    read_source,
)


def add_watermark_parser(sub: Any) -> None:
    """Register `specwire watermark detect` on the CLI's subparsers."""
    watermark = add_command(sub, "watermark", help="watermark detection through a running target service")
    actions = watermark.add_subparsers(dest="watermark_command", required=True)
    detect = add_command(
        actions,
        "detect",
        help="score texts (or --ids) for the watermark of a config: z-score, p-value and prediction per row for "
        "the green-list watermark, the mean g-value for SynthID",
    )
    detect.add_argument("rows", nargs="*", help="texts to score, one row each (with --ids: comma-separated ids)")
    detect.add_argument("--ids", action="store_true", help="the rows are token ids, e.g. 12,7,301")
    source = detect.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="registry reference whose watermarking_config generated the rows")
    source.add_argument(
        "--watermark-json", metavar="FILE", help="a watermarking_config as JSON ('-' for stdin), e.g. {\"bias\": 2.0}"
    )
    detect.add_argument("--z-threshold", type=float, default=None, help="green list: prediction is z > this (3.0)")
    detect.add_argument("--ignore-repeated-ngrams", action="store_true", help="green list: count each n-gram once")
    detect.add_argument("--address", default="127.0.0.1:50052", help="target service host:port")
    detect.add_argument("--as-json", action="store_true", help="print the scores as JSON")
    detect.add_argument("--timeout", type=float, default=DEFAULT_CONFIG_TIMEOUT_S, help="deadline in seconds")
    add_retries_option(detect)
    add_token_option(detect)


def _id_rows(rows: list[str]) -> list[list[int]]:
    try:
        return [[int(t) for t in row.replace(" ", "").split(",") if t] for row in rows]
    except ValueError:
        raise UsageError(f"--ids rows are comma-separated integers, got {rows!r}") from None


def _number(value: Any) -> Any:
    """JSON has no NaN: a SynthID row with nothing scored prints null."""
    return None if isinstance(value, float) and math.isnan(value) else value


def watermark_command(args) -> int:
    """Run `specwire watermark detect`; the exit code."""
    from specwire.client import TargetClient

    if not args.rows:
        raise UsageError('give rows to score, e.g. specwire watermark detect --config NAME "some text"')
    kwargs: dict[str, Any] = {"z_threshold": args.z_threshold, "ignore_repeated_ngrams": args.ignore_repeated_ngrams}
    if args.config:
        kwargs["generation_config"] = args.config
    else:
        try:
            kwargs["watermarking_config"] = json.loads(read_source(args.watermark_json))
        except json.JSONDecodeError as exc:
            raise UsageError(f"--watermark-json {args.watermark_json}: not JSON ({exc})") from None
        if not isinstance(kwargs["watermarking_config"], dict):
            raise UsageError("--watermark-json holds a JSON object (the watermarking_config)")
    rows: dict[str, Any] = {"input_ids": _id_rows(args.rows)} if args.ids else {"text": list(args.rows)}
    with connected(TargetClient, args) as client:
        out = client.detect_watermark(**rows, **kwargs)
    green = out.kind == "green_list"
    columns = (
        ["num_tokens_scored", "num_green_tokens", "green_fraction", "z_score", "p_value", "prediction"]
        if green
        else ["num_tokens_scored", "mean_score"]
    )
    table = [{name: getattr(out, name)[i].item() for name in columns} for i in range(len(out.num_tokens_scored))]
    if args.as_json:
        document = {
            "kind": out.kind,
            "watermarking_config": out.watermarking_config,
            **({"z_threshold": out.z_threshold} if green else {}),
            "rows": [{k: _number(v) for k, v in row.items()} for row in table],
        }
        print(json.dumps(document, indent=2))
        return EXIT_OK
    print(f"watermark: {out.kind}" + (f" (z_threshold {out.z_threshold:g})" if green else ""))
    print("  ".join(["ROW", *columns]))
    for i, row in enumerate(table):
        cells = [f"{v:.6g}" if isinstance(v, float) else str(v) for v in row.values()]
        print("  ".join([str(i), *cells]))
    return EXIT_OK
