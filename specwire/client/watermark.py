"""The client side of `TargetService.DetectWatermark`: the request from Python values, the answer as
arrays named like transformers' `WatermarkDetectorOutput` (plus SynthID's `mean_score`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specwire.client.config_client import config_to_wire
from specwire.common.v1 import common_pb2
from specwire.target.v1 import target_service_pb2 as pb
from specwire.wire.generation_config import json_value

__all__ = ["WatermarkDetection", "build_detect_request"]

WATERMARK_KINDS = {pb.WATERMARK_KIND_GREEN_LIST: "green_list", pb.WATERMARK_KIND_SYNTHID: "synthid"}


@dataclass
class WatermarkDetection:
    """Per-row scores, one array entry per row sent.

    Args:
        kind (`str`): `"green_list"` (transformers' WatermarkingConfig) or `"synthid"`.
        num_tokens_scored (`np.ndarray`): tokens (n-grams) scored per row.
        num_green_tokens, green_fraction, z_score, p_value, prediction, confidence (`np.ndarray`, *optional*):
            transformers' `WatermarkDetectorOutput` fields (green list only).
        mean_score (`np.ndarray`, *optional*): SynthID's mean g-value per row (SynthID only).
        z_threshold (`float`): the threshold `prediction` used (green list).
        watermarking_config (`dict`): the effective config that was scored.
        token_ids (`list[list[int]]`): the ids scored per row (texts as the target tokenized them).
    """

    kind: str
    num_tokens_scored: np.ndarray
    num_green_tokens: np.ndarray | None
    green_fraction: np.ndarray | None
    z_score: np.ndarray | None
    p_value: np.ndarray | None
    prediction: np.ndarray | None
    confidence: np.ndarray | None
    mean_score: np.ndarray | None
    z_threshold: float
    watermarking_config: dict[str, Any]
    token_ids: list[list[int]]

    @classmethod
    def from_proto(cls, response: pb.DetectWatermarkResponse) -> WatermarkDetection:
        rows = list(response.rows)
        green = response.kind == pb.WATERMARK_KIND_GREEN_LIST

        def column(name: str, dtype: Any, wanted: bool) -> np.ndarray | None:
            return np.array([getattr(r, name) for r in rows], dtype=dtype) if wanted else None

        return cls(
            kind=WATERMARK_KINDS.get(response.kind, "unspecified"),
            num_tokens_scored=np.array([r.num_tokens_scored for r in rows], dtype=np.int64),
            num_green_tokens=column("num_green_tokens", np.int64, green),
            green_fraction=column("green_fraction", np.float64, green),
            z_score=column("z_score", np.float64, green),
            p_value=column("p_value", np.float64, green),
            prediction=column("prediction", bool, green),
            confidence=column("confidence", np.float64, green),
            mean_score=column("mean_score", np.float64, not green),
            z_threshold=response.z_threshold,
            watermarking_config={k: json_value(v) for k, v in response.watermarking_config.fields.items()},
            token_ids=[list(t.ids) for t in response.token_ids],
        )


def _as_dict(watermarking_config: Any) -> dict[str, Any]:
    """A watermarking dict from a dict or a transformers (SynthID)WatermarkingConfig."""
    if isinstance(watermarking_config, dict):
        return dict(watermarking_config)
    to_dict = getattr(watermarking_config, "to_dict", None)
    if to_dict is None:
        raise TypeError(
            f"watermarking_config must be a dict or a transformers WatermarkingConfig, not {watermarking_config!r}"
        )
    return {k: v for k, v in to_dict().items() if not k.startswith("_")}


def build_detect_request(
    input_ids: Any = None,
    *,
    text: str | list[str] | None = None,
    watermarking_config: Any = None,
    generation_config: Any = None,
    z_threshold: float | None = None,
    ignore_repeated_ngrams: bool = False,
    request_id: str = "",
) -> pb.DetectWatermarkRequest:
    """A DetectWatermarkRequest: rows from `input_ids` (a list, nested lists or a tensor) or `text`, and the
    config from `watermarking_config` (inline) or `generation_config` (a registry reference or a config)."""
    if (input_ids is None) == (text is None):
        raise ValueError("pass input_ids or text (exactly one)")
    if watermarking_config is not None and generation_config is not None:
        raise ValueError("pass watermarking_config or generation_config, not both")
    request = pb.DetectWatermarkRequest(ignore_repeated_ngrams=ignore_repeated_ngrams, request_id=request_id)
    if text is not None:
        for item in [text] if isinstance(text, str) else text:
            request.rows.add(text=item)
    else:
        rows = input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids
        if rows and isinstance(rows[0], int):
            rows = [rows]
        for row in rows:
            request.rows.add(token_ids=common_pb2.TokenSequence(ids=[int(t) for t in row]))
    if watermarking_config is not None:
        request.config.CopyFrom(config_to_wire({"watermarking_config": _as_dict(watermarking_config)}))
    elif isinstance(generation_config, str):
        request.config_ref = generation_config
    elif generation_config is not None:
        request.config.CopyFrom(config_to_wire(generation_config))
    if z_threshold is not None:
        request.z_threshold = z_threshold
    return request
