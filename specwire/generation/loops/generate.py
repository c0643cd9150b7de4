"""The decoding entry points: `iter_generate` / `generate`, with transformers' `generate()` semantics.

Generation is a sequence of *steps over a batch of rows* (`specwire.generation.rows`). First
`prepare_generation` (`specwire.generation.planning`) resolves the config against the prompts; then
the processors (`processors`) and stopping criteria (`stopping`) are built, and one of the loops runs:
greedy/multinomial sampling (`loops.sample`) or beam search and beam-sample (`loops.beam`);
speculative decoding (`loops.speculative`) reuses this module's steps. A loop applies the logits
processors, picks tokens (`generation.sampling`, or the vectorised `BeamSearch` of `loops.beam_search`),
runs the stopping criteria and records outputs. It is a Python generator: each step yields a
`StepEvent`, and the final `GenerationResult` is the generator's return value (`StopIteration.value`).
Cancellation is the caller closing or abandoning the generator: no work runs past the current step.

Semantics follow transformers 5.23's `generate()` for decoder-only models (see `planning` for the
resolution order). Assisted-generation flags (`prompt_lookup_num_tokens`, `assistant_early_exit`,
`use_mtp`) are ignored here: speculation is the target service's strategy built on `verify`, and it
keeps this loop's output (identical tokens for greedy, the same distribution for sampling).
Attention weights and hidden states are returned as transformers returns them
(`check_model_outputs`); the KV cache is a `DynamicCache`, or a `StaticCache` with
`cache_implementation="static"`, whose decoding steps run through `torch.compile` where transformers'
rule compiles them (`specwire.generation.compilation`); another `cache_implementation` is a warning
in the target's response (`config.treatment`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any, cast

import torch

from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.compilation import decide_compile, decoding_call
from specwire.generation.config import GenerationMode, uses_static_cache
from specwire.generation.healing import heal_same_shape
from specwire.generation.loops.beam import beam_loop
from specwire.generation.loops.constrained_beam import constrained_beam_loop
from specwire.generation.loops.contrastive import contrastive_loop
from specwire.generation.loops.dola import DolaContrast
from specwire.generation.loops.group_beam import group_beam_loop
from specwire.generation.loops.sample import sample_loop
from specwire.generation.loops.stop_codes import StopCodes
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.planning import GenerationPlan, model_limits, prepare_generation
from specwire.generation.processors import build_logits_processors
from specwire.generation.rows import RowBatch, Rows
from specwire.generation.sampling import make_generator

__all__ = ["drain", "generate", "generate_from_plan", "iter_generate"]


def iter_generate(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: Any,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
    rows_factory: Callable[..., Rows] | None = None,
    structured_output: Any = None,
    allowed_token_sequences: Any = None,
) -> Generator[StepEvent, None, GenerationResult]:
    """
    Generates with transformers `generate()` semantics, one step at a time.

    Validation, length resolution and the construction of processors and stopping criteria happen in this
    call (errors raise here, before any forward pass; the `max_time` clock starts here); the returned
    generator runs the model. Iterate it to get `StepEvent`s; its return value (`StopIteration.value`,
    or `yield from`) is the `GenerationResult`. Stop iterating (or `close()` it) to cancel: nothing runs
    past the current step.

    Args:
        model (`PreTrainedModel`):
            A transformers decoder-only causal LM (e.g. `LoadedModel.model`).
        input_ids (`torch.LongTensor` of shape `(batch, input_len)`):
            Left-padded prompts.
        attention_mask (`torch.LongTensor` of shape `(batch, input_len)`, *optional*):
            0 on padding; inferred from `pad_token_id` when missing (see module docstring).
        config (`GenerationConfig`):
            Merged request > model config; unset fields get transformers' global defaults.
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            Needed for `stop_strings` and `token_healing`.
        generator (`torch.Generator`, *optional*):
            Randomness for sampling, on the model's device. Defaults to one seeded with `config.seed`
            (or from OS entropy when no seed is set); the global RNG is never used.
        negative_prompt_ids (`torch.LongTensor` of shape `(batch, neg_len)`, *optional*):
            Negative prompt for classifier-free guidance (`guidance_scale`).
        negative_prompt_attention_mask (`torch.LongTensor` of shape `(batch, neg_len)`, *optional*):
            Its mask.
        max_position_embeddings (`int`, *optional*):
            Context length for the default-length cap; read from the model config when `None`.
        rows_factory (`Callable`, *optional*):
            Builds the model-side state (a `Rows`) instead of `RowBatch`, with its constructor arguments,
            e.g. the target service's slot-cache rows that share one forward with other requests.
        structured_output (`StructuredOutput`, *optional*):
            A JSON schema, regex, Lark grammar or choice list every row's output must match (needs the
            tokenizer); see `specwire.generation.structured`.
        allowed_token_sequences (`Sequence[Sequence[int]]`, *optional*):
            The serializable `prefix_allowed_tokens_fn`: every row's generated tokens follow one of
            these sequences, then EOS (see `specwire.generation.processors.prefix`).

    Returns:
        `Generator[StepEvent, None, GenerationResult]`

    Raises:
        `UnsupportedModeError`: low_memory beams.
        `ValueError`: invalid combinations (see `prepare_generation`), or `stop_strings` without a tokenizer.
    """
    if config.token_healing:  # as transformers: the prompts are healed, then decoded as usual
        input_ids = heal_same_shape(model, tokenizer, input_ids)
    plan = prepare_generation(
        model,
        input_ids,
        attention_mask,
        config=config,
        max_position_embeddings=max_position_embeddings,
        structured_output=structured_output,
        tokenizer=tokenizer,
        allowed_token_sequences=allowed_token_sequences,
    )
    return generate_from_plan(
        model,
        plan,
        tokenizer=tokenizer,
        generator=generator,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        max_position_embeddings=max_position_embeddings,
        rows_factory=rows_factory,
    )


def generate_from_plan(
    model: Any,
    plan: GenerationPlan,
    *,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
    rows_factory: Callable[..., Rows] | None = None,
) -> Generator[StepEvent, None, GenerationResult]:
    """
    `iter_generate` from a `GenerationPlan` that `prepare_generation` already made for this model.

    Builds the rows, the processors and the stopping criteria (errors raise here, before any forward
    pass) and returns the step generator of the sample or beam loop.

    Args:
        model (`PreTrainedModel`):
            The model the plan was prepared for.
        plan (`GenerationPlan`):
            What `prepare_generation` resolved.
        tokenizer, generator, negative_prompt_ids, negative_prompt_attention_mask, max_position_embeddings,
        rows_factory: as for `iter_generate`.

    Returns:
        `Generator[StepEvent, None, GenerationResult]`
    """
    config = plan.config
    plan.require_tokenizer(tokenizer)
    device = plan.input_ids.device
    expanded_ids, expanded_mask = plan.expanded()
    wanted = check_model_outputs(plan, model)
    recorded: dict[str, Any] = {**wanted, **static_cache(plan, model)}
    mode = config.get_generation_mode()
    contrastive = mode is GenerationMode.CONTRASTIVE_SEARCH
    if contrastive:
        # It ranks candidates by their last-layer hidden states, and repeats and selects cache rows: a
        # RowBatch keeping every forward's hidden states (the config rules refuse what would change them).
        recorded, rows_factory = {"output_hidden_states": True}, None
    elif mode is GenerationMode.DOLA_GENERATION:
        # It reads earlier layers' hidden states through the LM head every step.
        recorded, rows_factory = {**recorded, "output_hidden_states": True}, None
    rows = (rows_factory or RowBatch)(
        model,
        attention_mask=expanded_mask,
        prompt_length=plan.input_len,
        rows=expanded_ids.shape[0],
        use_cache=bool(config.use_cache),
        prefill_chunk_size=getattr(config, "prefill_chunk_size", None),
        **recorded,
    )
    vocab_size, max_position_embeddings = model_limits(model, max_position_embeddings)
    processors = build_logits_processors(
        config,
        input_len=plan.input_len,
        vocab_size=vocab_size,
        eos_token_ids=plan.eos_token_ids,
        num_beams=plan.num_beams,
        prompt_ids=plan.input_ids,
        prompt_pad_lengths=rows.padding_lengths,
        model=model,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        structured=plan.structured,
        allowed_token_sequences=plan.allowed_token_sequences,
        user_processors=plan.logits_processor,
    )
    generator = _request_generator(plan, generator, device)
    stop_codes = StopCodes.for_plan(plan, config, tokenizer, max_position_embeddings, device)
    if contrastive:
        loop = contrastive_loop(plan, cast(RowBatch, rows), expanded_ids, expanded_mask, processors, stop_codes)
    elif mode is GenerationMode.CONSTRAINED_BEAM_SEARCH:
        loop = constrained_beam_loop(plan, rows, expanded_ids, processors, stop_codes)
    elif plan.num_beams > 1 and (config.num_beam_groups or 1) > 1:
        loop = group_beam_loop(plan, rows, expanded_ids, processors, stop_codes)
    elif plan.num_beams > 1:
        loop = beam_loop(plan, rows, expanded_ids, processors, stop_codes, generator)
    else:
        contrast = None
        if mode is GenerationMode.DOLA_GENERATION:
            keep = bool(wanted.get("output_hidden_states"))
            contrast = DolaContrast(model, config.dola_layers, cast(RowBatch, rows), keep_hidden_states=keep)
        loop = sample_loop(plan, rows, expanded_ids, processors, stop_codes, generator, contrast=contrast)
    if wanted.get("output_attentions") or wanted.get("output_hidden_states"):
        return _with_model_outputs(loop, cast(RowBatch, rows), plan.num_beams > 1)
    return loop


def static_cache(plan: GenerationPlan, model: Any) -> dict[str, Any]:
    """The `RowBatch` arguments for a static `cache_implementation` (`"static"`, or the deprecated aliases
    transformers still builds a `StaticCache` for, `config.STATIC_CACHES`): transformers' size, `max_length - 1`
    positions, or `max_cache_len` when larger (transformers also keeps the largest size any earlier call
    used on the same model object; a service does not let one request's size depend on another's), and
    the compiled decoding call where transformers' rule compiles (`specwire.generation.compilation`)."""
    config = plan.config
    if not uses_static_cache(config):
        return {}
    found: dict[str, Any] = {"static_cache_len": max(plan.max_length - 1, int(config.max_cache_len or 0))}
    decision = decide_compile(model, config)
    if decision.options is not None:
        found["compiled_forward"] = decoding_call(model, decision.options)
    return found


def check_model_outputs(plan: GenerationPlan, model: Any) -> dict[str, bool]:
    """The `RowBatch` arguments that keep attention weights / hidden states, for a plan that returns them.

    transformers returns them only with `return_dict_in_generate`; specwire returns them from the model's
    own forward (`RowBatch`), one entry per step (a chunked prefill's last chunk, as transformers).

    Raises:
        `InvalidGenerationArgument`: `output_attentions` on a model whose attention implementation computes
            no weights (sdpa).
    """
    config = plan.config
    wanted = {
        name: bool(config.return_dict_in_generate and getattr(config, name))
        for name in ("output_attentions", "output_hidden_states")
    }
    if not any(wanted.values()):
        return {}
    implementation = getattr(model.config, "_attn_implementation", None)
    if wanted["output_attentions"] and implementation != "eager":
        raise InvalidGenerationArgument.for_field(
            "output_attentions",
            True,
            f"the served model runs {implementation!r} attention, which computes no attention weights; serve "
            "it with eager attention (--attn-implementation eager) to return them, or unset output_attentions",
        )
    return wanted


def _with_model_outputs(
    loop: Generator[StepEvent, None, GenerationResult], rows: RowBatch, beams: bool
) -> Generator[StepEvent, None, GenerationResult]:
    """The loop's events, then its result with the attentions / hidden states of each step.

    The rows keep one entry per forward. Greedy search and sampling return the first `n`, those of the
    `n` generated tokens; beam search returns every forward's, for all `batch * num_beams` running rows
    in their order at that step (transformers' beam layout, like its `scores`).
    """
    result = yield from loop
    steps = len(rows.attentions or rows.hidden_states) if beams else result.sequences.shape[1] - result.prompt_length
    if rows.output_attentions:
        result.attentions = tuple(rows.attentions[:steps])
    if rows.output_hidden_states and rows.hidden_states:  # (DoLa drops them when only attentions are wanted)
        result.hidden_states = tuple(rows.hidden_states[:steps])
    return result


def _request_generator(
    plan: GenerationPlan, generator: torch.Generator | None, device: torch.device
) -> torch.Generator | None:
    """The request's generator: the one given (on the model's device), or a new one seeded with `seed`."""
    if plan.do_sample and generator is None:
        generator = make_generator(plan.config.seed, device)
    if generator is not None and generator.device.type != device.type:
        raise InvalidGenerationArgument.for_field(
            "generator",
            str(generator.device),
            f"the generator must live on the model's device ({device}); "
            f"create it with torch.Generator(device={str(device)!r})",
        )
    return generator


def generate(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: Any,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
    structured_output: Any = None,
    allowed_token_sequences: Any = None,
) -> GenerationResult:
    """
    Runs `iter_generate` to the end and returns its `GenerationResult`.

    Args:
        model, input_ids, attention_mask, config, tokenizer, generator, negative_prompt_ids,
        negative_prompt_attention_mask, max_position_embeddings, structured_output,
        allowed_token_sequences: as for `iter_generate`.

    Returns:
        `GenerationResult`
    """
    steps = iter_generate(
        model,
        input_ids,
        attention_mask,
        config=config,
        tokenizer=tokenizer,
        generator=generator,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        max_position_embeddings=max_position_embeddings,
        structured_output=structured_output,
        allowed_token_sequences=allowed_token_sequences,
    )
    return drain(steps)


def drain(steps: Iterator[StepEvent]) -> GenerationResult:
    """
    Consumes a step generator and returns its result.

    Args:
        steps (`Generator[StepEvent, None, GenerationResult]`):
            What `iter_generate` returned.

    Returns:
        `GenerationResult`
    """
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return cast(GenerationResult, stop.value)
