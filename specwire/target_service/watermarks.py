"""`TargetService.DetectWatermark`: score texts or token ids for the watermark of a config.

The work is the detector's own computation (`specwire.generation.watermark_detection`): green lists or
SynthID g-values from hashes of the rows' tokens, on the model's device type, no forward pass. It runs in
the preparation pool, bounded like a Generate's preparation: rows by `--max-prompts`, text by
`--max-prompt-chars`, tokens per row by `--max-model-len`.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import struct_pb2

from specwire.common.v1 import common_pb2
from specwire.errors import InvalidArgument
from specwire.generation.config import GenerationConfig, is_synthid_watermark, merge, raise_for_errors
from specwire.generation.watermark_detection import WatermarkScore, detect_watermark
from specwire.models import LoadedModel
from specwire.target.v1 import target_service_pb2 as pb
from specwire.target_service.admission import PreparationPool
from specwire.target_service.config_resolver import ConfigResolver, ResolvedConfig
from specwire.target_service.limits import RequestLimits, check_prompts
from specwire.target_service.requests import config_from_wire, resolve_source

__all__ = ["detect"]

DEFAULT_Z_THRESHOLD = 3.0  # transformers' WatermarkDetector default


async def detect(
    request: pb.DetectWatermarkRequest,
    loaded: LoadedModel,
    resolver: ConfigResolver,
    limits: RequestLimits,
    pool: PreparationPool,
) -> pb.DetectWatermarkResponse:
    """Check the wire sizes, resolve the config (on the event loop: a network call), score in `pool`."""
    if not request.rows:
        raise InvalidArgument.for_field("rows", [], "send at least one row to score (token_ids or text)")
    check_prompts(request.rows, limits, "rows")
    for i, row in enumerate(request.rows):
        if row.attention_mask:
            raise InvalidArgument.for_field(
                f"rows[{i}].attention_mask",
                list(row.attention_mask[:8]),
                "rows are scored one by one and take no mask: send each row's tokens without padding",
            )
    if request.HasField("z_threshold") and not math.isfinite(request.z_threshold):
        raise InvalidArgument.for_field("z_threshold", request.z_threshold, "must be a finite number, e.g. 3.0")
    resolved = await resolve_source(request, resolver)
    return await pool.run(_score, request, resolved, loaded, limits)


def _watermarking_config(
    request: pb.DetectWatermarkRequest, resolved: ResolvedConfig | None, loaded: LoadedModel
) -> tuple[dict[str, Any], str]:
    """The effective `watermarking_config` (the request's config over the model's) and its field name."""
    if resolved is not None:
        given, field = resolved.config, "config_ref"
    elif request.WhichOneof("config_source") == "config":
        given, field = config_from_wire(request.config, "config"), "config.watermarking_config"
    else:
        given, field = GenerationConfig(), "config.watermarking_config"
    merged = merge(given, loaded.generation_config)
    wm = merged.watermarking_config
    if wm is None:
        raise InvalidArgument.for_field(
            field,
            None,
            "the config sets no watermarking_config, and neither does the model's generation_config.json: "
            "send the config the text was generated with, e.g. {'watermarking_config': {'greenlist_ratio': 0.25}}",
        )
    violations = [v for v in GenerationConfig(watermarking_config=wm).validate() if v.field == "watermarking_config"]
    raise_for_errors(violations, field_prefix="config.", summary="invalid watermarking_config")
    return dict(wm), field


def _row_ids(request: pb.DetectWatermarkRequest, loaded: LoadedModel, limits: RequestLimits) -> list[list[int]]:
    rows = []
    for i, row in enumerate(request.rows):
        kind = row.WhichOneof("input")
        if kind is None:
            raise InvalidArgument.for_field(f"rows[{i}]", "", "set token_ids or text")
        if kind == "token_ids":
            ids = list(row.token_ids.ids)
        else:
            if loaded.tokenizer is None:
                raise InvalidArgument.for_field(
                    f"rows[{i}].text", "text", "this model has no tokenizer: send token_ids"
                )
            ids = list(loaded.tokenizer(row.text, add_special_tokens=False)["input_ids"])
            if len(ids) >= limits.max_model_len:  # the bound `check_prompts` puts on token-id rows
                raise InvalidArgument.for_field(
                    f"rows[{i}].text",
                    f"{len(ids)} tokens",
                    f"at most {limits.max_model_len - 1} tokens per row on this target (--max-model-len): shorten it",
                )
        rows.append(ids)
    return rows


def _eos_token_id(loaded: LoadedModel) -> int | None:
    """The EOS SynthID's mask stops at: the tokenizer's, as transformers' detector takes it, else the model's."""
    if loaded.tokenizer is not None and loaded.tokenizer.eos_token_id is not None:
        return int(loaded.tokenizer.eos_token_id)
    eos = loaded.generation_config.eos_token_id
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos


def _score(
    request: pb.DetectWatermarkRequest, resolved: ResolvedConfig | None, loaded: LoadedModel, limits: RequestLimits
) -> pb.DetectWatermarkResponse:
    """Validate, tokenize and score (blocking: runs in the preparation pool)."""
    wm, _ = _watermarking_config(request, resolved, loaded)
    rows = _row_ids(request, loaded, limits)
    z_threshold = request.z_threshold if request.HasField("z_threshold") else DEFAULT_Z_THRESHOLD
    text_config = loaded.model.config.get_text_config()
    scores = detect_watermark(
        rows,
        wm,
        vocab_size=loaded.vocab_size,
        bos_token_id=getattr(text_config, "bos_token_id", None),
        eos_token_id=_eos_token_id(loaded),
        device=loaded.device,
        z_threshold=z_threshold,
        ignore_repeated_ngrams=request.ignore_repeated_ngrams,
    )
    struct = struct_pb2.Struct()
    struct.update(wm)
    synthid = is_synthid_watermark(wm)
    return pb.DetectWatermarkResponse(
        kind=pb.WATERMARK_KIND_SYNTHID if synthid else pb.WATERMARK_KIND_GREEN_LIST,
        rows=[_score_to_proto(s) for s in scores],
        z_threshold=0.0 if synthid else z_threshold,
        watermarking_config=struct,
        token_ids=[common_pb2.TokenSequence(ids=ids) for ids in rows],
    )


def _score_to_proto(score: WatermarkScore) -> pb.WatermarkScore:
    if score.mean_score is not None:
        return pb.WatermarkScore(num_tokens_scored=score.num_tokens_scored, mean_score=score.mean_score)
    return pb.WatermarkScore(
        num_tokens_scored=score.num_tokens_scored,
        num_green_tokens=score.num_green_tokens or 0,
        green_fraction=score.green_fraction or 0.0,
        z_score=score.z_score or 0.0,
        p_value=score.p_value or 0.0,
        prediction=bool(score.prediction),
        confidence=score.confidence or 0.0,
    )
