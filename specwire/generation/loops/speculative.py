"""Speculative decoding: rounds of draft, verify in one target forward, accept for all rows at once.

Each round has four steps (`SpeculativeRun.round`, in `loops.speculative_rounds`):

1. **draft**: every row asks the drafter for up to `k` tokens (bounded by `max_length`): the length the
   adaptive controller picks for the request (`speculation.controller`, when the request names no
   schedule; 0 is a round of plain decoding), else each row's `DraftSchedule`; rows that already
   finished get the pad filler instead.
2. **verify**: the target runs `[last token, block...]` for all rows in one forward
   (`RaggedRows.verify`), and the request's processors are applied at each candidate position with
   that position's own prefix (all rows and positions in one `process` call).
3. **accept**: one call of the vectorized acceptance functions (`speculation.acceptance`) for all
   rows: the longest agreeing prefix (greedy), rejection sampling with the draft's probabilities
   (Leviathan et al., arXiv 2211.17192), or the target's own samples when the drafter gives none
   (prompt lookup while sampling). A row gains its accepted drafts plus one target token (the
   recovered token, or the bonus token when all were accepted), and `crop_at_stops` cuts the block
   at the first stopping criterion inside it (EOS, max length, stop strings, max time).
4. **commit**: rows keep what they emitted, `RaggedRows.discard` crops the KV positions every row
   rejected and masks the rest (rows advance by different amounts, the batch stays one forward per
   round), then the schedules, the statistics and the drafter learn the outcome.

Output equals plain decoding: greedy tokens are identical (the target's argmax decides every
token), and `scores`/`logits` hold one entry per generated position, computed from the same
prefix as in plain decoding. Rows that finished early are fed the pad token like plain decoding
feeds them, so their scores match too. Random draws are made row by row in row order (the
acceptance functions' contract), so a seeded request draws what it drew with one call per row.
When the drafter fails (unreachable, too slow, died), the loop finishes with empty drafts, which is
plain decoding, and records why.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, cast

import torch

from specwire.generation.config import GenerationMode, is_synthid_watermark, uses_static_cache
from specwire.generation.healing import heal_same_shape
from specwire.generation.loops.generate import generate_from_plan
from specwire.generation.loops.speculative_rounds import SpeculativeRun
from specwire.generation.loops.stop_codes import StopCodes, reason_names
from specwire.generation.outputs import GenerationResult, StepEvent
from specwire.generation.planning import GenerationPlan, model_limits, prepare_generation
from specwire.generation.processors import build_logits_processors
from specwire.generation.rows import RaggedRows, SpeculativeRows
from specwire.generation.sampling import make_generator
from specwire.generation.speculation.controller import SpeculationController
from specwire.generation.speculation.drafters import Drafter
from specwire.generation.speculation.mtp import HiddenStates, bind_hidden_states
from specwire.generation.speculation.stats import SpeculationStats

__all__ = ["iter_speculative", "speculate_from_plan", "speculation_blocker", "speculative_loop"]


def speculative_loop(
    plan: GenerationPlan,
    rows: SpeculativeRows,
    input_ids: torch.Tensor,
    row_processors: list[Any],
    row_stop_codes: Sequence[StopCodes],
    generator: torch.Generator | None,
    open_drafter: Callable[[list[list[int]]], Drafter],
    stats: SpeculationStats,
    reason_names: dict[int, str],
    draft_length: int | None = None,
    controller: SpeculationController | None = None,
    prefill_apart: bool = False,
) -> Generator[StepEvent, None, GenerationResult]:
    """Greedy or sampling with speculative rounds (see the module docstring).

    Args:
        plan (`GenerationPlan`): the resolved generation (lengths, special tokens, sampling).
        rows (`SpeculativeRows`): the model-side state of the expanded rows (`RaggedRows`, `SlotRows`).
        input_ids (`torch.LongTensor` of shape `(rows, input_len)`): expanded, left-padded prompts.
        row_processors (`list`): each row's logits processors (built for a batch of one).
        row_stop_codes (`list[StopCodes]`): each row's stopping check, `(ids [1, len], scores) -> codes [1]`.
        generator (`torch.Generator`, *optional*): the request's randomness (sampling).
        open_drafter (`Callable`): opens the drafting session for the rows' tokens so far
            (prompt without padding, plus the first generated token); may raise `DraftFailure`.
        stats (`SpeculationStats`): filled in as the rounds go.
        reason_names (`dict`): finish-reason code -> name.
        draft_length (`int`, *optional*): a constant draft length (prompt lookup) instead of the
            config's `num_assistant_tokens` schedule.
        controller (`SpeculationController`, *optional*): chooses each round's draft length instead of
            `draft_length` and the schedule (`speculation.controller`).
        prefill_apart (`bool`, *optional*, defaults to `False`): the drafter computes on a device of its own (an
            overlapped draft service, `DraftPolicy.prefills_apart`): its session opens on the prompt before the
            target's prefill, and the drafter catches up on it meanwhile (`RemoteDrafter.prefill`); the first token
            reaches it as feedback.
    """
    run = SpeculativeRun(
        plan, rows, input_ids, row_processors, row_stop_codes, generator, stats, reason_names, draft_length, controller
    )
    early = run.drafts_from_the_prompt
    # A draft service prefills the prompt on its own device while the target prefills it: the first block (or
    # look-back) only catches up on the tokens since. Opened after the first token, the draft's prefill came after
    # the target's (the code edit's 411-token prompt: ~0.8 s of a pinned SmolLM2 int8 draft), and a look-back that
    # had to pay it did not fit the controller's budget.
    open_first = prefill_apart and not early
    # The drafter holds a session (a draft-service stream, KV caches) until closed: it is closed on
    # every way out of this generator (finish, error, the caller closing it on cancel or deadline).
    try:
        if open_first:
            run.open_drafter(open_drafter, prefill=True)
        if not early:
            # Step 0: the first token comes from the prefill's logits, as in plain decoding.
            yield run.first_step()
        if not open_first:
            run.open_drafter(open_drafter)
        if early:  # step 0 is a round drafted from the prompt (transformers' block boundaries)
            yield run.first_round()
        step = 1
        while not run.done():
            yield run.round(step)
            step += 1
        return run.result()
    finally:
        run.close_drafter()


def speculation_blocker(plan: GenerationPlan) -> str:
    """Why this generation cannot speculate ("" when it can); it then runs plain decoding."""
    config = plan.config
    if plan.num_beams > 1:
        return "beam search runs without speculation (plain beam search)"
    mode = config.get_generation_mode()
    if mode in (GenerationMode.CONTRASTIVE_SEARCH, GenerationMode.DOLA_GENERATION):
        # Their tokens come from each step's hidden states, not from the target's distribution alone.
        return f"{mode.value} runs without speculation (plain {mode.value})"
    if config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states):
        # transformers' assisted generation splits a verified block's outputs into per-token entries; plain
        # decoding returns them one forward per token, which is the layout the caller asked for.
        return "output_attentions / output_hidden_states run without speculation (plain decoding)"
    if uses_static_cache(config):
        # Rejected drafts are cropped from the cache, which a StaticCache cannot do (the target service
        # refuses the combination, as transformers does; the library runs plain decoding with it).
        return (
            f"cache_implementation={config.cache_implementation!r} runs without speculation (plain decoding with a "
            "static cache)"
        )
    if not config.use_cache:
        return "speculation needs use_cache=True"
    if config.guidance_scale is not None and config.guidance_scale != 1:
        return "classifier-free guidance (guidance_scale) needs one target step at a time"
    if is_synthid_watermark(config.watermarking_config):
        # Its processor's per-row state advances once per call: verifying a block of drafted tokens calls it
        # once per position, and a rejected token would leave its context behind (transformers' assisted
        # generation has the same problem, so its output is not the watermark's plain-decoding output).
        return (
            "SynthID watermarking (watermarking_config with ngram_len/keys) runs without speculation (plain decoding)"
        )
    return ""


def iter_speculative(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: Any,
    open_drafter: Callable[[list[list[int]], Any], Drafter],
    stats: SpeculationStats,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
    draft_length: int | None = None,
    rows_factory: Callable[..., SpeculativeRows] | None = None,
    structured_output: Any = None,
    allowed_token_sequences: Any = None,
    controller: SpeculationController | None = None,
    hidden_layers: Sequence[int] | None = None,
    prefill_apart: bool = False,
) -> Generator[StepEvent, None, GenerationResult]:
    """`iter_generate` with speculative rounds when the request allows it, else plain decoding.

    Same arguments and result as `specwire.generation.loops.generate.iter_generate`, plus:

    Args:
        open_drafter (`Callable[[list[list[int]], GenerationConfig], Drafter]`): opens the drafting
            session for the rows (prompt tokens without padding) and the resolved config; may raise
            `DraftFailure`, which falls back to plain decoding.
        stats (`SpeculationStats`): receives the request's speculation statistics and fallback reason.
        draft_length (`int`, *optional*): constant draft length (prompt lookup) instead of the schedule.
        rows_factory (`Callable`, *optional*): builds the model-side state instead of `RaggedRows`
            (a `SpeculativeRows`); passed on to plain decoding.
        controller (`SpeculationController`, *optional*): the adaptive controller chooses each round's
            draft length (instead of `draft_length` and the config's schedule).
        hidden_layers (`Sequence[int]`, *optional*): the target's hidden-state indices the drafter reads every
            round (a DFlash assistant's: `speculation.dflash.dflash_hidden_layers`).
        prefill_apart (`bool`, *optional*, defaults to `False`): the drafter computes on a device of its own (a
            `RemoteDrafter`): it opens on the prompt and prefills it while the target does.
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
    return speculate_from_plan(
        model,
        plan,
        open_drafter=open_drafter,
        stats=stats,
        tokenizer=tokenizer,
        generator=generator,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        max_position_embeddings=max_position_embeddings,
        draft_length=draft_length,
        rows_factory=rows_factory,
        controller=controller,
        hidden_layers=hidden_layers,
        prefill_apart=prefill_apart,
    )


def speculate_from_plan(
    model: Any,
    plan: GenerationPlan,
    *,
    open_drafter: Callable[[list[list[int]], Any], Drafter],
    stats: SpeculationStats,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
    draft_length: int | None = None,
    rows_factory: Callable[..., SpeculativeRows] | None = None,
    controller: SpeculationController | None = None,
    hidden_layers: Sequence[int] | None = None,
    prefill_apart: bool = False,
) -> Generator[StepEvent, None, GenerationResult]:
    """`iter_speculative` from a `GenerationPlan` that `prepare_generation` already made for this model
    (the target service plans once per request, to route it, and runs from that plan).

    Args:
        model (`PreTrainedModel`): the model the plan was prepared for.
        plan (`GenerationPlan`): what `prepare_generation` resolved.
        open_drafter, stats, tokenizer, generator, negative_prompt_ids, negative_prompt_attention_mask,
        max_position_embeddings, draft_length, rows_factory, controller, hidden_layers: as for
        `iter_speculative`.
        prefill_apart (`bool`, *optional*, defaults to `False`): the drafts come from a draft service, which
            prefills the prompt while the target does (`speculative_loop`).
    """
    blocker = speculation_blocker(plan)
    if blocker:
        stats.fallback_reason = blocker
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
    config = plan.config
    plan.require_tokenizer(tokenizer)
    expanded, mask = plan.expanded()
    # The MTP drafter reads the last hidden states, a DFlash drafter those of its `target_layer_ids`.
    extra: dict[str, Any] = {}
    if config.use_mtp:
        extra["keep_last_hidden_states"] = True
    elif hidden_layers:
        extra["keep_last_hidden_states"] = list(hidden_layers)
    rows = (rows_factory or RaggedRows)(
        model,
        attention_mask=mask,
        prompt_length=plan.input_len,
        rows=expanded.shape[0],
        use_cache=True,
        prefill_chunk_size=getattr(config, "prefill_chunk_size", None),
        **extra,
    )
    row_processors, row_stops = _per_row_steps(model, plan, rows, tokenizer, max_position_embeddings)
    if plan.do_sample and generator is None:
        generator = make_generator(getattr(config, "seed", None), expanded.device)
    return speculative_loop(
        plan,
        rows,
        expanded,
        row_processors,
        row_stops,
        generator,
        lambda tokens: _bound(open_drafter(tokens, config), rows),
        stats,
        reason_names(),
        draft_length,
        controller,
        prefill_apart,
    )


def _bound(drafter: Drafter, rows: SpeculativeRows) -> Drafter:
    """`drafter`, given the rows' hidden states when it drafts from them (MTP)."""
    bind_hidden_states(drafter, cast(HiddenStates, rows))
    return drafter


def _per_row_steps(
    model: Any, plan: GenerationPlan, rows: SpeculativeRows, tokenizer: Any, max_position_embeddings: int | None
) -> tuple[list[Any], list[StopCodes]]:
    """Each row's processors and stopping criteria, built for a batch of one (rows advance apart)."""
    config = plan.config
    vocab_size, max_position_embeddings = model_limits(model, max_position_embeddings)
    pad_lengths = rows.padding_lengths
    row_processors, row_stops = [], []
    for r in range(plan.rows):
        prompt = plan.input_ids[r // plan.expand : r // plan.expand + 1]
        row_processors.append(
            build_logits_processors(
                config,
                input_len=plan.input_len,
                vocab_size=vocab_size,
                eos_token_ids=plan.eos_token_ids,
                num_beams=1,
                prompt_ids=prompt,
                prompt_pad_lengths=None if pad_lengths is None else pad_lengths[r : r + 1],
                model=model,
                structured=plan.structured,
                allowed_token_sequences=plan.allowed_token_sequences,
                user_processors=plan.logits_processor,
            )
        )
        row_stops.append(StopCodes.for_plan(plan, config, tokenizer, max_position_embeddings, plan.input_ids.device))
    return row_processors, row_stops
