"""From a `GenerateRequest` to a checked `GenerationJob`: prompts as tensors, the effective config.

Effective config = request overrides > the inline or registry config > the model's
generation_config.json > transformers' global defaults (the v5 rule; the decoding loop applies the
last layer). Every problem is reported as INVALID_ARGUMENT naming the field, the value and the fix;
modes transformers 5 dropped are UNIMPLEMENTED.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specwire.errors import FieldProblem, InvalidArgument, Unimplemented
from specwire.generation.config import GenerationConfig, merge
from specwire.generation.speculative_loop import SpeculationStats
from specwire.models import LoadedModel
from specwire.target.v1 import target_service_pb2 as pb
from specwire.wire.generation_config import WireFormatError, config_from_proto
from target_service.config_resolver import ConfigResolver, ResolvedConfig

MAX_BATCH_SIZE = 64

# Drafting methods that need the target's hidden states every round: not servable by a separate
# draft service, and not implemented in-process either.
UNSERVED_FIELDS = ("use_mtp", "assistant_early_exit", "speculation_type")


@dataclass
class GenerationJob:
    """One checked request, ready for the decoding loop."""

    input_ids: torch.Tensor  # [batch, prompt_len]
    attention_mask: torch.Tensor | None  # [batch, prompt_len]
    config: GenerationConfig  # overrides > request config > model config; global defaults not applied
    resolved: ResolvedConfig | None = None
    negative_prompt_ids: torch.Tensor | None = None  # [1, neg_len]
    negative_prompt_attention_mask: torch.Tensor | None = None
    proposer: int = pb.PROPOSER_UNSPECIFIED
    request_id: str = ""
    warnings: list[FieldProblem] = field(default_factory=list)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)


def _config(message: Any, field_name: str) -> GenerationConfig:
    try:
        return config_from_proto(message)
    except WireFormatError as exc:
        raise InvalidArgument.for_field(f"{field_name}.{exc.field}", exc.value, exc.message) from exc
    except (TypeError, ValueError) as exc:
        raise InvalidArgument.for_field(field_name, None, f"not a valid GenerationConfig: {exc}") from exc


async def effective_config(
    request: pb.GenerateRequest | pb.GenerateStreamRequest, loaded: LoadedModel, resolver: ConfigResolver
) -> tuple[GenerationConfig, ResolvedConfig | None, list[FieldProblem]]:
    """Merge the layers and validate the result like transformers does at generate() time."""
    source = request.WhichOneof("config_source")
    resolved = None
    if source == "config_ref":
        resolved = await resolver.resolve(request.config_ref)
        given = resolved.config
    elif source == "config":
        given = _config(request.config, "config")
    else:
        given = GenerationConfig()
    overrides = _config(request.overrides, "overrides")
    if overrides.extra:
        # transformers' generate() refuses unknown keyword arguments (typos) rather than ignoring them.
        key = sorted(overrides.extra)[0]
        raise InvalidArgument.for_field(
            f"overrides.{key}", overrides.extra[key], "not a GenerationConfig field: check the spelling"
        )
    merged = merge(overrides, given, loaded.generation_config)
    violations = merged.validate()
    errors = [
        FieldProblem(f"config.{v.field}", v.value, v.message) for v in violations if v.severity == "error"
    ]
    if errors:
        summary = "; ".join(f"{p.field}={p.value!r}: {p.message}" for p in errors)
        raise InvalidArgument(f"invalid generation config: {summary}", errors)
    # Modes transformers 5 removed (group/constrained beams, contrastive, DoLa) are refused by the
    # decoding loop itself with UNIMPLEMENTED, naming the field.
    for name in UNSERVED_FIELDS:
        if getattr(merged, name) not in (None, False):
            raise Unimplemented(
                f"config.{name}={getattr(merged, name)!r} is not served by specwire; unset it"
            )
    warnings = [FieldProblem(f"config.{v.field}", v.value, v.message, "warning") for v in violations]
    return merged, resolved, warnings


def _check_ids(ids: list[int], vocab_size: int, field_name: str) -> None:
    if not ids:
        raise InvalidArgument.for_field(field_name, [], "a prompt needs at least one token")
    for j, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument.for_field(
                f"{field_name}[{j}]",
                token,
                f"token ids must be in [0, {vocab_size}) for this model's vocabulary",
            )


def _left_pad(
    rows: list[list[int]], masks: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, row_mask) in enumerate(zip(rows, masks, strict=True)):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = torch.tensor(row_mask, dtype=torch.long)
    return ids, mask


def prompt_tensors(
    prompts, loaded: LoadedModel, apply_chat_template: bool, pad_id: int, field_name: str = "prompts"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-id or text prompts as `input_ids` and `attention_mask` (None when transformers would infer it)."""
    if not prompts:
        raise InvalidArgument.for_field(field_name, [], "send at least one prompt (token_ids or text)")
    if len(prompts) > MAX_BATCH_SIZE:
        raise InvalidArgument.for_field(
            field_name, len(prompts), f"at most {MAX_BATCH_SIZE} prompts per request"
        )
    kinds = {p.WhichOneof("input") for p in prompts}
    if None in kinds:
        index = [p.WhichOneof("input") for p in prompts].index(None)
        raise InvalidArgument.for_field(f"{field_name}[{index}]", "", "set token_ids or text")
    if len(kinds) > 1:
        raise InvalidArgument.for_field(
            field_name, sorted(kinds), "use token_ids for every prompt or text for every one"
        )
    if kinds == {"text"}:
        return _tokenize([p.text for p in prompts], loaded, apply_chat_template, pad_id, field_name)
    rows = [list(p.token_ids.ids) for p in prompts]
    masks = []
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        _check_ids(row, loaded.vocab_size, f"{field_name}[{i}].token_ids")
        mask = list(prompt.attention_mask)
        if mask and (len(mask) != len(row) or any(m not in (0, 1) for m in mask)):
            raise InvalidArgument.for_field(
                f"{field_name}[{i}].attention_mask", mask, f"give one 0/1 entry per token ({len(row)} here)"
            )
        if mask and not any(mask):
            raise InvalidArgument.for_field(
                f"{field_name}[{i}].attention_mask", mask, "at least one token must be unmasked"
            )
        masks.append(mask)
    if len({len(r) for r in rows}) == 1 and not any(masks):
        # Same as a plain input_ids tensor in transformers: the mask is inferred from the pad id.
        return torch.tensor(rows, dtype=torch.long), None
    ids, mask = _left_pad(rows, [m or [1] * len(r) for r, m in zip(rows, masks, strict=True)], pad_id)
    return ids, mask


def _tokenize(texts, loaded: LoadedModel, apply_chat_template: bool, pad_id: int, field_name: str):
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise InvalidArgument.for_field(field_name, "text", "this model has no tokenizer: send token_ids")
    rows = []
    for i, text in enumerate(texts):
        if apply_chat_template:
            if not getattr(tokenizer, "chat_template", None):
                raise InvalidArgument.for_field(
                    "apply_chat_template",
                    True,
                    "this model's tokenizer has no chat template: send plain text",
                )
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        if not ids:
            raise InvalidArgument.for_field(f"{field_name}[{i}].text", text, "the text tokenizes to nothing")
        rows.append(list(ids))
    if len({len(r) for r in rows}) == 1:
        return torch.tensor(rows, dtype=torch.long), torch.ones(len(rows), len(rows[0]), dtype=torch.long)
    return _left_pad(rows, [[1] * len(r) for r in rows], pad_id)


def pad_token_id(config: GenerationConfig, loaded: LoadedModel) -> int:
    """The id used to left-pad ragged prompts: pad, else the first EOS, else 0."""
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None:
        return eos
    return (
        loaded.tokenizer.pad_token_id
        if loaded.tokenizer is not None and loaded.tokenizer.pad_token_id is not None
        else 0
    )


async def build_job(request, loaded: LoadedModel, resolver: ConfigResolver) -> GenerationJob:
    """Check a Generate/GenerateStream request and turn it into a job."""
    config, resolved, warnings = await effective_config(request, loaded, resolver)
    pad = pad_token_id(config, loaded)
    input_ids, attention_mask = prompt_tensors(request.prompts, loaded, request.apply_chat_template, pad)
    negative_ids = negative_mask = None
    if request.HasField("negative_prompt"):
        negative_ids, negative_mask = prompt_tensors(
            [request.negative_prompt], loaded, False, pad, "negative_prompt"
        )
    return GenerationJob(
        input_ids=input_ids,
        attention_mask=attention_mask,
        config=config,
        resolved=resolved,
        negative_prompt_ids=negative_ids,
        negative_prompt_attention_mask=negative_mask,
        proposer=request.proposer,
        request_id=request.request_id,
        warnings=warnings,
    )
