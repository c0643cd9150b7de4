"""The decoding entry points: `iter_generate` / `generate`, with transformers' `generate()` semantics.

Generation is a sequence of *steps over a batch of rows* (`specwire.generation.rows`). First
`prepare_generation` (`specwire.generation.planning`) resolves the config against the prompts; then
the processors (`processors`) and stopping criteria (`stopping`) are built, and one of the loops runs:
greedy/multinomial sampling (`loops.sample`) or beam search and beam-sample (`loops.beam`);
speculative decoding (`loops.speculative`) reuses this module's steps. A loop applies the logits
processors, picks tokens (`loops.sampling`, or the vectorised `BeamSearch` of `loops.beam_search`),
runs the stopping criteria and records outputs. It is a Python generator: each step yields a
`StepEvent`, and the final `GenerationResult` is the generator's return value (`StopIteration.value`).
Cancellation is the caller closing or abandoning the generator: no work runs past the current step.

Semantics follow transformers 5.23's `generate()` for decoder-only models (see `planning` for the
resolution order). Assisted-generation flags (`prompt_lookup_num_tokens`, `assistant_early_exit`,
`use_mtp`) are ignored here: speculation is the target service's strategy built on `verify`, and it
keeps this loop's output (identical tokens for greedy, the same distribution for sampling).
Attention/hidden-state outputs are not returned, and the KV cache is always a `DynamicCache`
(`cache_implementation` is ignored).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any, cast

import torch

from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.loops.beam import beam_loop
from specwire.generation.loops.sample import sample_loop
from specwire.generation.loops.sampling import make_generator
from specwire.generation.loops.stop_codes import StopCodes
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.planning import GenerationPlan, model_limits, prepare_generation
from specwire.generation.processors import build_logits_processors
from specwire.generation.rows import RowBatch, Rows
from specwire.generation.stopping import build_stopping_criteria

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
            Needed for `stop_strings`.
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
        `UnsupportedModeError`: group/constrained beam search, contrastive search, DoLa, low_memory beams,
            token healing, SynthID watermarking.
        `ValueError`: invalid combinations (see `prepare_generation`), or `stop_strings` without a tokenizer.
    """
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
    rows = (rows_factory or RowBatch)(
        model,
        attention_mask=expanded_mask,
        prompt_length=plan.input_len,
        rows=expanded_ids.shape[0],
        use_cache=bool(config.use_cache),
        prefill_chunk_size=getattr(config, "prefill_chunk_size", None),
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
    )
    criteria = build_stopping_criteria(
        config,
        max_length=plan.max_length,
        eos_token_ids=plan.eos_token_ids,
        tokenizer=tokenizer,
        max_position_embeddings=max_position_embeddings,
    )
    generator = _request_generator(plan, generator, device)
    stop_codes = StopCodes(criteria, plan.eos_token_ids, device)
    if plan.num_beams > 1:
        return beam_loop(plan, rows, expanded_ids, processors, stop_codes, generator)
    return sample_loop(plan, rows, expanded_ids, processors, stop_codes, generator)


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
