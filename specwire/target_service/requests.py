"""From a `GenerateRequest` to a checked `GenerationJob`: prompts as tensors, the effective config.

Effective config = request overrides > the inline or registry config > the model's
generation_config.json > transformers' global defaults (the v5 rule; the decoding loop applies the
last layer). Every problem is reported as INVALID_ARGUMENT naming the field, the value and the fix;
modes transformers 5 dropped are UNIMPLEMENTED.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from specwire.deadline import remaining
from specwire.errors import DeadlineExceeded, FieldProblem, InvalidArgument
from specwire.generation.config import (
    GenerationConfig,
    field_suggestion,
    merge,
    not_honoured,
    raise_for_errors,
    unknown_keys,
    v4_mode_violations,
)
from specwire.generation.healing import heal_same_shape
from specwire.generation.planning import resolved_eos_token_ids
from specwire.generation.plugins import BuiltMethod, PluginContext, PluginRegistry
from specwire.generation.speculation.stats import SpeculationStats
from specwire.generation.structured import StructuredOutput, compile_structured_output
from specwire.models import LoadedModel
from specwire.target.v1 import target_service_pb2 as pb
from specwire.target_service.admission import PreparationPool
from specwire.target_service.config_resolver import ConfigResolver, ResolvedConfig
from specwire.target_service.limits import ModelShape, RequestLimits, check_config, check_job, check_prompts
from specwire.wire.generation_config import WireFormatError, config_from_proto
from specwire.wire.structured_output import structured_output_from_proto


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
    structured_output: StructuredOutput | None = None
    allowed_token_sequences: list[list[int]] | None = None  # the serializable prefix_allowed_tokens_fn
    # Server plugins' instances (`specwire.generation.plugins`), built in the preparation pool.
    logits_processor: list[Any] = field(default_factory=list)
    stopping_criteria: list[Any] = field(default_factory=list)
    # A server plugin generate method (`specwire.generation.generate_methods`) replacing the loops.
    generate_method: BuiltMethod | None = None
    # The draft-length fields the request itself named (`named_draft_fields`): transformers' schedule
    # then decides, not the adaptive controller.
    draft_fields: tuple[str, ...] = ()


# `generate()` arguments that are code, not data, and what a request sends instead (messages stay under
# the 300 characters a field problem keeps).
_PLUGINS_HINT = (
    "a server plugin (a package with a specwire.logits_processors or specwire.stopping_criteria entry point, "
    "enabled with the target's --plugins; send processors=[{'name': ..., 'args': {...}}])"
)
_GENERATE_ARGUMENT_HINTS = {
    "custom_generate": "runs a Hub repository's code, which specwire does not run; install the method as a server "
    "plugin (a package with a specwire.generate_methods entry point, enabled with the target's --plugins; send "
    "generate_method={'name': ..., 'args': {...}})",
    "trust_remote_code": f"specwire runs no remote code; install it as {_PLUGINS_HINT}",
    "logits_processor": f"a Python callable cannot travel over gRPC; install it as {_PLUGINS_HINT}",
    "prefix_allowed_tokens_fn": "a Python callable cannot travel over gRPC; send the allowed continuations as "
    "allowed_token_sequences (lists of token ids)",
}


def config_from_wire(message: Any, field_name: str) -> GenerationConfig:
    try:
        return config_from_proto(message)
    except WireFormatError as exc:
        raise InvalidArgument.for_field(f"{field_name}.{exc.field}", exc.value, exc.message) from exc
    except (TypeError, ValueError) as exc:
        raise InvalidArgument.for_field(field_name, None, f"not a valid GenerationConfig: {exc}") from exc


async def resolve_source(
    request: pb.GenerateRequest | pb.GenerateStreamRequest, resolver: ConfigResolver
) -> ResolvedConfig | None:
    """The registry config named by `config_ref` (a network call, so on the event loop); else None."""
    if request.WhichOneof("config_source") == "config_ref":
        return await resolver.resolve(request.config_ref)
    return None


# What transformers v4.56 kept from the model's generation config with `use_model_defaults=False`.
_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def model_defaults(request: pb.GenerateRequest | pb.GenerateStreamRequest, loaded: LoadedModel) -> GenerationConfig:
    """The model's generation_config.json layer: whole, or only its special tokens with `use_model_defaults=False`."""
    if not request.HasField("use_model_defaults") or request.use_model_defaults:
        return loaded.generation_config
    return GenerationConfig(**{name: getattr(loaded.generation_config, name) for name in _SPECIAL_TOKENS})


# A request that sets one of these names its draft lengths: transformers' schedule decides them exactly.
DRAFT_LENGTH_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "prompt_lookup_num_tokens")


def named_draft_fields(
    request: pb.GenerateRequest | pb.GenerateStreamRequest, resolved: ResolvedConfig | None
) -> tuple[str, ...]:
    """The draft-length fields set by the request's overrides, its inline config or its registry config.

    The model's generation_config.json does not count: it is a layer users rarely know is there, and a
    value left in it (transformers writes a `"heuristic"` schedule's last value back into it) would
    silently turn the adaptive controller off for every request to that model.
    """
    named = [name for name in DRAFT_LENGTH_FIELDS if request.overrides.HasField(name)]
    if resolved is not None:
        named += [name for name in DRAFT_LENGTH_FIELDS if getattr(resolved.config, name) is not None]
    elif request.WhichOneof("config_source") == "config":
        named += [name for name in DRAFT_LENGTH_FIELDS if request.config.HasField(name)]
    return tuple(dict.fromkeys(named))


def effective_config(
    request: pb.GenerateRequest | pb.GenerateStreamRequest,
    resolved: ResolvedConfig | None,
    loaded: LoadedModel,
    limits: RequestLimits | None = None,
) -> tuple[GenerationConfig, list[FieldProblem], bool]:
    """Merge the layers and validate the result like transformers does at generate() time.

    Returns the merged config, its warnings, and whether the request itself (its overrides or its
    config) set `max_new_tokens` or `max_length` (a length it did not set is clipped to the limits).
    """
    if resolved is not None:
        given = resolved.config
    elif request.WhichOneof("config_source") == "config":
        given = config_from_wire(request.config, "config")
    else:
        given = GenerationConfig()
    overrides = config_from_wire(request.overrides, "overrides")
    if overrides.extra:
        # transformers' generate() refuses unknown keyword arguments (typos) rather than ignoring them.
        key = sorted(overrides.extra)[0]
        raise InvalidArgument.for_field(
            f"overrides.{key}",
            overrides.extra[key],
            _GENERATE_ARGUMENT_HINTS.get(key)
            or f"not a GenerationConfig field: {field_suggestion(key) or 'check the spelling'}",
        )
    merged = merge(overrides, given, model_defaults(request, loaded))
    caller_set_length = any(
        getattr(layer, name) is not None for layer in (overrides, given) for name in ("max_new_tokens", "max_length")
    )
    if limits is not None:
        check_config(merged, limits)  # before validation: its cost grows with the lists it checks
    violations = merged.validate()
    raise_for_errors(violations, field_prefix="config.", summary="invalid generation config")
    # The rules transformers 4.55.4 has for the v4 modes specwire runs (group beam search).
    raise_for_errors(
        v4_mode_violations(merged.with_defaults()), field_prefix="config.", summary="invalid generation config"
    )
    # Modes specwire does not run are refused by the decoding loop itself with UNIMPLEMENTED, naming the field.
    if resolved is None:  # an inline config's unknown keys; the registry warned about its own when stored
        violations += unknown_keys(given)
    violations += not_honoured(merged)  # accepted and not acted on: never silently
    warnings = [FieldProblem(f"config.{v.field}", v.value, v.message, "warning") for v in violations]
    return merged, warnings, caller_set_length


def _token_row(prompt, vocab_size: int, field_name: str) -> torch.Tensor:
    """One prompt's token ids as a tensor, range-checked with one min/max (not a loop over tokens)."""
    ids = torch.tensor(prompt.token_ids.ids, dtype=torch.long)
    if ids.numel() == 0:
        raise InvalidArgument.for_field(f"{field_name}.token_ids", [], "a prompt needs at least one token")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        j = int((ids == bad).nonzero()[0, 0])
        raise InvalidArgument.for_field(
            f"{field_name}.token_ids[{j}]",
            bad,
            f"token ids must be in [0, {vocab_size}) for this model's vocabulary",
        )
    return ids


def _mask_row(prompt, length: int, field_name: str) -> torch.Tensor | None:
    if not prompt.attention_mask:
        return None
    mask = torch.tensor(prompt.attention_mask, dtype=torch.long)
    if mask.numel() != length or bool(((mask != 0) & (mask != 1)).any()):
        shown = list(prompt.attention_mask[:32]) + (["..."] if mask.numel() > 32 else [])
        raise InvalidArgument.for_field(
            f"{field_name}.attention_mask", shown, f"give one 0/1 entry per token ({length} here)"
        )
    if not bool(mask.any()):
        raise InvalidArgument.for_field(
            f"{field_name}.attention_mask", "all zeros", "at least one token must be unmasked"
        )
    return mask


def _left_pad(rows: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, row_mask) in enumerate(zip(rows, masks, strict=True)):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = row_mask
    return ids, mask


def prompt_tensors(
    prompts, loaded: LoadedModel, apply_chat_template: bool, pad_id: int, field_name: str = "prompts"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-id or text prompts as `input_ids` and `attention_mask` (None when transformers would infer it)."""
    if not prompts:
        raise InvalidArgument.for_field(field_name, [], "send at least one prompt (token_ids or text)")
    # The prompt count is capped earlier, from the wire request (`limits.check_prompts`).
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
    rows = [_token_row(p, loaded.vocab_size, f"{field_name}[{i}]") for i, p in enumerate(prompts)]
    masks = [_mask_row(p, len(r), f"{field_name}[{i}]") for i, (p, r) in enumerate(zip(prompts, rows, strict=True))]
    if len({len(r) for r in rows}) == 1 and all(m is None for m in masks):
        # Same as a plain input_ids tensor in transformers: the mask is inferred from the pad id.
        return torch.stack(rows), None
    full = [torch.ones_like(r) if m is None else m for r, m in zip(rows, masks, strict=True)]
    return _left_pad(rows, full, pad_id)


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
        rows.append(torch.tensor(ids, dtype=torch.long))
    if len({len(r) for r in rows}) == 1:
        return torch.stack(rows), torch.ones(len(rows), len(rows[0]), dtype=torch.long)
    return _left_pad(rows, [torch.ones_like(r) for r in rows], pad_id)


def bos_prompt(config: GenerationConfig, loaded: LoadedModel) -> torch.Tensor:
    """The prompt of a request with none: one row holding `bos_token_id`, as transformers' `generate()`
    starts with `inputs=None` (`_maybe_initialize_input_ids_for_generation`, batch size 1).

    Raises:
        `InvalidArgument`: the effective config has no `bos_token_id` (transformers raises too).
    """
    bos = config.bos_token_id
    if bos is None:
        raise InvalidArgument.for_field(
            "config.bos_token_id",
            None,
            "a request with no prompt starts from bos_token_id and this model's generation config has none: "
            "send a prompt, or set bos_token_id",
        )
    if not 0 <= bos < loaded.vocab_size:
        raise InvalidArgument.for_field(
            "config.bos_token_id", bos, f"token ids must be in [0, {loaded.vocab_size}) for this model's vocabulary"
        )
    return torch.tensor([[bos]], dtype=torch.long)


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


def prepare_job(
    request,
    resolved: ResolvedConfig | None,
    loaded: LoadedModel,
    limits: RequestLimits | None = None,
    plugins: PluginRegistry | None = None,
    model: Any = None,
) -> GenerationJob:
    """Validate, tokenize and limit-check a request (blocking: run it in the preparation pool).

    `model` is the served model as preparation may call it (token healing's forwards): one whose calls run on
    the model thread (`Engine.on_model_thread`); `loaded.model` itself, called here, without it.
    """
    config, warnings, caller_set_length = effective_config(request, resolved, loaded, limits)
    if isinstance(request, pb.GenerateStreamRequest) and (config.num_beams or 1) > 1:
        # transformers refuses a streamer with beam search for the same reason.
        raise InvalidArgument.for_field(
            "config.num_beams",
            config.num_beams,
            "beam search cannot stream: which beam is best is known only when the search ends; call "
            "Generate for the whole answer at once, or set num_beams=1 to stream",
        )
    pad = pad_token_id(config, loaded)
    if request.prompts:
        input_ids, attention_mask = prompt_tensors(request.prompts, loaded, request.apply_chat_template, pad)
    else:
        input_ids, attention_mask = bos_prompt(config, loaded), None
    if request.apply_chat_template and not any(p.WhichOneof("input") == "text" for p in request.prompts):
        warnings.append(
            FieldProblem(
                "apply_chat_template",
                True,
                "not honoured: the chat template wraps text prompts, and this request has none (token ids are "
                "sent as they are); send text, or apply the template before tokenizing",
                "warning",
            )
        )
    if limits is not None:
        config = check_job(
            config,
            input_ids.shape[0],
            input_ids.shape[1],
            loaded.vocab_size,
            limits,
            caller_set_length,
            loaded.max_position_embeddings,
            ModelShape.of(loaded.model),
        )
    if config.token_healing:
        # Here, where the tokenizer is, after the limits (it runs the model once per healed row): the
        # decoding loops then run on the healed prompts, speculation included. Its tokenizer and vocabulary
        # work stays on this thread; its forwards run on the model thread, each after a deadline check.
        healer = _Deadlined(model if model is not None else loaded.model)
        input_ids = heal_same_shape(healer, loaded.tokenizer, input_ids)
    structured = structured_output_from_proto(request)
    if structured is not None:
        # Compiled here, in the preparation pool, so a spec the library refuses costs no model work and
        # the scheduler's planning finds it in the cache (building a tokenizer's grammar vocabulary, once,
        # takes ~0.25 s for SmolLM2: never on the model thread).
        compile_structured_output(structured, loaded.tokenizer, loaded.vocab_size, resolved_eos_token_ids(config))
    plugins = plugins or PluginRegistry()
    processors, criteria = _plugin_instances(request, config, loaded, plugins, input_ids.shape[1])
    method = _generate_method(request, config, loaded, plugins, input_ids.shape[1])
    negative_ids = negative_mask = None
    if request.HasField("negative_prompt"):
        negative_ids, negative_mask = prompt_tensors([request.negative_prompt], loaded, False, pad, "negative_prompt")
        if config.guidance_scale is None or config.guidance_scale == 1:
            # transformers ignores it then too; the rule here is that nothing accepted is ignored silently.
            warnings.append(
                FieldProblem(
                    "negative_prompt",
                    f"{negative_ids.shape[1]} tokens",
                    f"not honoured: a negative prompt is used only with guidance_scale > 1 (it is "
                    f"{config.guidance_scale}); set guidance_scale or drop the negative prompt",
                    "warning",
                )
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
        structured_output=structured,
        allowed_token_sequences=_allowed_sequences(request, loaded.vocab_size),
        logits_processor=processors,
        stopping_criteria=criteria,
        generate_method=method,
        draft_fields=named_draft_fields(request, resolved),
        # A config served from the target's cache during a registry outage says so first.
        warnings=[*(resolved.warnings if resolved is not None else ()), *warnings],
    )


def _plugin_calls(request: Any, field_name: str) -> list[tuple[str, dict[str, Any]]]:
    """`[(name, args), ...]` of a request's `processors` or `stopping_criteria` (args: a JSON object)."""
    return [_plugin_call(call, f"{field_name}[{i}]") for i, call in enumerate(getattr(request, field_name))]


def _plugin_call(call: Any, where: str) -> tuple[str, dict[str, Any]]:
    """`(name, args)` of one `PluginCall` (args: a JSON object); `where` names it in errors."""
    if not call.name:
        raise InvalidArgument.for_field(f"{where}.name", "", "name the plugin (GetModelInfo lists those enabled)")
    try:
        args = json.loads(call.args_json) if call.args_json else {}
    except json.JSONDecodeError as exc:
        raise InvalidArgument.for_field(f"{where}.args_json", call.args_json, f"not JSON: {exc}") from None
    if not isinstance(args, dict):
        raise InvalidArgument.for_field(f"{where}.args_json", call.args_json, "the arguments must be a JSON object")
    return call.name, args


def _plugin_context(config: GenerationConfig, loaded: LoadedModel, input_len: int) -> PluginContext:
    return PluginContext(
        tokenizer=loaded.tokenizer,
        vocab_size=loaded.vocab_size,
        device=loaded.device,
        config=config,
        input_len=input_len,
        eos_token_ids=resolved_eos_token_ids(config),
    )


def _plugin_instances(
    request: Any, config: GenerationConfig, loaded: LoadedModel, plugins: PluginRegistry, input_len: int
) -> tuple[list[Any], list[Any]]:
    """The request's plugin processors and criteria, built here (before any model work) so that bad
    arguments are INVALID_ARGUMENT without a forward pass."""
    processors, criteria = _plugin_calls(request, "processors"), _plugin_calls(request, "stopping_criteria")
    if not processors and not criteria:
        return [], []
    context = _plugin_context(config, loaded, input_len)
    return (
        plugins.build("logits_processor", "processors", processors, context),
        plugins.build("stopping_criteria", "stopping_criteria", criteria, context),
    )


def _generate_method(
    request: Any, config: GenerationConfig, loaded: LoadedModel, plugins: PluginRegistry, input_len: int
) -> BuiltMethod | None:
    """The request's generate method plugin, built here (bad arguments cost no model work), or None.

    Raises:
        `InvalidArgument`: not enabled, arguments refused, or a combination the method cannot run:
        speculation (a method replaces the loop that speculates), beams it does not declare.
    """
    if not request.HasField("generate_method"):
        return None
    call = _plugin_call(request.generate_method, "generate_method")
    if request.proposer not in (pb.PROPOSER_UNSPECIFIED, pb.PROPOSER_NONE) or config.prompt_lookup_num_tokens:
        value = request.proposer if config.prompt_lookup_num_tokens is None else config.prompt_lookup_num_tokens
        name = "proposer" if config.prompt_lookup_num_tokens is None else "config.prompt_lookup_num_tokens"
        raise InvalidArgument.for_field(
            name,
            value,
            f"a generate method ({call[0]!r}) replaces the decoding loop, which is what speculates: "
            "send proposer=none (or leave it unset), or drop generate_method",
        )
    (built,) = plugins.build("generate_method", "generate_method", [call], _plugin_context(config, loaded, input_len))
    if (config.num_beams or 1) > 1 and not built.supports_beams:
        raise InvalidArgument.for_field(
            "config.num_beams",
            config.num_beams,
            f"the generate method {call[0]!r} does not declare beam search (supports_beams): set num_beams=1",
        )
    return built


def _allowed_sequences(request, vocab_size: int) -> list[list[int]] | None:
    """The request's allowed token sequences (None when it sends none), checked against the vocabulary."""
    if not request.allowed_token_sequences:
        return None
    sequences = [list(sequence.ids) for sequence in request.allowed_token_sequences]
    for i, sequence in enumerate(sequences):
        if not sequence:
            raise InvalidArgument.for_field(
                f"allowed_token_sequences[{i}]", [], "an allowed sequence needs at least one token id"
            )
        bad = [t for t in sequence if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument.for_field(
                f"allowed_token_sequences[{i}]",
                bad[0],
                f"token ids must be in [0, {vocab_size}) for this model's vocabulary; use the model's tokenizer",
            )
    return sequences


def check_wire_sizes(request, limits: RequestLimits) -> None:
    """The cheap checks on the wire request (counts and lengths only), run before any preparation."""
    check_prompts(request.prompts, limits)
    if request.HasField("negative_prompt"):
        check_prompts([request.negative_prompt], limits, "negative_prompt")


async def build_job(
    request,
    loaded: LoadedModel,
    resolver: ConfigResolver,
    limits: RequestLimits | None = None,
    pool: PreparationPool | None = None,
    plugins: PluginRegistry | None = None,
    model: Any = None,
) -> GenerationJob:
    """Check a Generate/GenerateStream request and turn it into a job.

    The order is the cost order: the wire sizes (counts, no tokenizing), then the registry lookup
    (awaited, no CPU), then validation, tokenization and the limits in `pool` (a worker thread; without
    a pool, inline). `model`: as for `prepare_job`.
    """
    limits = limits or RequestLimits.for_model(loaded.max_position_embeddings)
    check_wire_sizes(request, limits)
    resolved = await resolve_source(request, resolver)
    if pool is None:
        return prepare_job(request, resolved, loaded, limits, plugins, model)
    return await pool.run(prepare_job, request, resolved, loaded, limits, plugins, model)


class _Deadlined:
    """A model whose every call first checks the caller's deadline (DEADLINE_EXCEEDED once it passed), so a
    request healing many rows stops asking the model thread for forwards when its caller has gone."""

    def __init__(self, model: Any):
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if remaining() == 0:
            raise DeadlineExceeded("the request's deadline passed while its prompts were being healed")
        return self._model(*args, **kwargs)
