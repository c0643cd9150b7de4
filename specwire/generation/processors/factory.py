"""Builds a request's processor list in transformers 5.23's `_get_logits_processor` order and conditions."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.config.serialization import SYNTHID_DEFAULTS, WATERMARK_DEFAULTS, watermark_kind

from .base import LogitsProcessor, LogitsProcessorList, token_id_list
from .bias import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor
from .diversity import HammingDiversityLogitsProcessor
from .guidance import UnbatchedClassifierFreeGuidanceLogitsProcessor
from .length import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
)
from .numerics import InfNanRemoveLogitsProcessor, LogitNormalization
from .penalties import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    ExponentialDecayLengthPenalty,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from .prefix import AllowedSequences, PrefixConstrainedLogitsProcessor
from .suppress import SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor
from .synthid import SynthIDTextWatermarkLogitsProcessor
from .warpers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from .watermark import WatermarkLogitsProcessor


def _field(config: Any, name: str) -> Any:
    # `config` is our GenerationConfig (every field present, None when unset) or any object with the
    # same attribute names; a missing attribute means unset.
    return getattr(config, name, None)


def watermark_processor(
    watermarking_config: Any, vocab_size: int, device: str | torch.device = "cpu"
) -> WatermarkLogitsProcessor | SynthIDTextWatermarkLogitsProcessor:
    """The processor of a `watermarking_config` (dict or transformers config object), as its
    `construct_processor(vocab_size, device)` builds it: SynthID for a config with `ngram_len`/`keys`,
    else the green-list one."""
    if isinstance(watermarking_config, Mapping):
        fields = dict(watermarking_config)
    else:
        fields = {k: getattr(watermarking_config, k) for k in vars(watermarking_config)}
    if watermark_kind(fields) == "synthid":
        unknown = sorted(set(fields) - set(SYNTHID_DEFAULTS) - {"ngram_len", "keys"})
        if unknown:
            raise ValueError(f"Unknown SynthID `watermarking_config` keys {unknown}.")
        params = {**SYNTHID_DEFAULTS, **{k: v for k, v in fields.items() if v is not None}}
        return SynthIDTextWatermarkLogitsProcessor(device=device, **params)
    unknown = sorted(set(fields) - set(WATERMARK_DEFAULTS))
    if unknown:
        raise ValueError(
            f"Unknown `watermarking_config` keys {unknown}; allowed keys are {sorted(WATERMARK_DEFAULTS)}."
        )
    params = {**WATERMARK_DEFAULTS, **{k: v for k, v in fields.items() if v is not None}}
    return WatermarkLogitsProcessor(vocab_size=vocab_size, **params)


def build_logits_processors(
    config: Any,
    *,
    input_len: int,
    vocab_size: int,
    eos_token_ids: int | Sequence[int] | torch.Tensor | None,
    num_beams: int,
    prompt_ids: torch.Tensor,
    prompt_pad_lengths: torch.Tensor | Sequence[int] | None = None,
    model: Any = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    structured: Any = None,
    allowed_token_sequences: Sequence[Sequence[int]] | None = None,
    user_processors: Sequence[Any] = (),
) -> LogitsProcessorList:
    r"""Build the processors for one request, in transformers 5.23's order and under its conditions.

    Order: classifier-free guidance, sequence bias, encoder repetition penalty, repetition penalty,
    no-repeat n-gram, encoder no-repeat n-gram, bad words, min length, min new tokens, allowed
    prefixes, forced BOS,
    forced EOS, inf/nan removal, exponential decay length penalty, suppress tokens, suppress at begin;
    then the structured-output mask, where transformers merges a user's `logits_processor` list, then
    the user's processors (server plugins) in their order; then,
    only when `do_sample`, temperature, top-h, top-k, top-p, min-p, typical, epsilon, eta; then
    the watermark, and `LogitNormalization` always last.

    Args:
        config (`GenerationConfig`):
            Our config with transformers' global defaults already applied (`max_length` already
            resolved from `max_new_tokens`); fields are read by attribute, missing means unset.
        input_len (`int`):
            Prompt length in tokens (columns of the padded prompt).
        vocab_size (`int`):
            The model's vocabulary size (`config.get_text_config().vocab_size`), used by the watermark.
        eos_token_ids (`int`, `Sequence[int]`, `torch.Tensor` or `None`):
            The resolved end-of-sequence id(s); `None` or empty disables the EOS-based processors.
        num_beams (`int`):
            Beams per input; > 1 raises the warpers' `min_tokens_to_keep` to `len(eos) + 1` (2 without EOS).
        prompt_ids (`torch.LongTensor` of shape `(batch, input_len)`):
            The prompt; it is the "encoder input" of decoder-only models (encoder repetition penalty,
            encoder no-repeat n-gram). Its device is where processor tensors live.
        prompt_pad_lengths (`torch.LongTensor` or `Sequence[int]` of shape `(rows,)`, *optional*):
            Left-padding length of each processed row (after expansion for beams / returned sequences):
            the repetition penalty ignores those positions. `None` when there is no padding.
        model (`torch.nn.Module`, *optional*):
            Needed only for classifier-free guidance (`guidance_scale` != 1).
        negative_prompt_ids (`torch.LongTensor` of shape `(1 or batch, neg_len)`, *optional*):
            Negative prompt for guidance, one for every row or one per prompt; defaults to each row's
            last prompt token.
        negative_prompt_attention_mask (`torch.LongTensor` of shape `(1 or batch, neg_len)`, *optional*):
            Its attention mask.
        structured (`CompiledGrammar`, *optional*):
            The request's compiled structured-output spec (`GenerationPlan.structured`): adds a
            `StructuredOutputLogitsProcessor` (its own matcher states, so build one list per request).
        allowed_token_sequences (`Sequence[Sequence[int]]`, *optional*):
            The serializable `prefix_allowed_tokens_fn`: the generated tokens must follow one of these
            sequences, then EOS (`AllowedSequences`); applied where transformers puts its
            `PrefixConstrainedLogitsProcessor` (after min new tokens, before forced BOS).
        user_processors (`Sequence[LogitsProcessor]`, *optional*):
            A user's `logits_processor` list (server plugins), appended where transformers merges it,
            after the structured-output mask: the mask is the request's own constraint and comes first,
            so a plugin sees (and may only further restrict or bias) the scores the grammar allows.

    Returns:
        `LogitsProcessorList`: the processors, applied in list order.

    Raises:
        ValueError: a field has a bad value, or a processor lacks what it needs (model, EOS, tokenizer...).
    """
    eos = token_id_list(eos_token_ids, "eos_token_id") if eos_token_ids is not None else None
    if eos is not None and len(eos) == 0:
        eos = None
    if prompt_ids is not None and not isinstance(prompt_ids, torch.Tensor):
        prompt_ids = torch.tensor(prompt_ids, dtype=torch.long)
    # The steps run in the order their processors appear in transformers' list; that order is the contract.
    processors = LogitsProcessorList()
    processors.extend(
        _guidance_processors(config, prompt_ids, model, negative_prompt_ids, negative_prompt_attention_mask)
    )
    processors.extend(_penalty_processors(config, prompt_ids, prompt_pad_lengths, eos))
    allowed = None
    if allowed_token_sequences is not None:
        allowed = AllowedSequences(allowed_token_sequences, input_len, eos or [])
    processors.extend(_length_and_suppression_processors(config, input_len, eos, allowed, num_beams))
    if structured is not None:
        # transformers 5.23 merges user processors here (`_merge_criteria_processor_list`), before the warpers.
        from specwire.generation.structured import StructuredOutputLogitsProcessor

        processors.append(StructuredOutputLogitsProcessor(structured, input_len))
    processors.extend(user_processors)
    if _field(config, "do_sample"):
        processors.extend(_sampling_warpers(config, num_beams, eos))
    processors.extend(_final_processors(config, vocab_size, prompt_ids.device if prompt_ids is not None else "cpu"))
    return processors


def _guidance_processors(
    config: Any,
    prompt_ids: torch.Tensor | None,
    model: Any,
    negative_prompt_ids: torch.Tensor | None,
    negative_prompt_attention_mask: torch.Tensor | None,
) -> list[LogitsProcessor]:
    """Classifier-free guidance, first in transformers' list (it replaces the scores it is given)."""
    guidance_scale = _field(config, "guidance_scale")
    if guidance_scale is None or guidance_scale == 1:
        return []
    if negative_prompt_ids is not None and prompt_ids is not None:
        negatives, prompts = negative_prompt_ids.shape[0], prompt_ids.shape[0]
        if negatives not in (1, prompts):
            # Checked here, before any forward, rather than at the processor's first call.
            raise InvalidGenerationArgument.for_field(
                "negative_prompt_ids",
                tuple(negative_prompt_ids.shape),
                f"give one negative prompt for the whole batch, or one per prompt ({prompts} here)",
            )
    use_cache = _field(config, "use_cache")
    return [
        UnbatchedClassifierFreeGuidanceLogitsProcessor(
            guidance_scale,
            model,
            unconditional_ids=negative_prompt_ids,
            unconditional_attention_mask=negative_prompt_attention_mask,
            # Unset means the model's own default, which is to cache.
            use_cache=True if use_cache is None else use_cache,
        )
    ]


def _penalty_processors(
    config: Any,
    prompt_ids: torch.Tensor | None,
    prompt_pad_lengths: torch.Tensor | Sequence[int] | None,
    eos: list[int] | None,
) -> list[LogitsProcessor]:
    """Sequence bias, Hamming diversity (group beam search), (encoder) repetition penalties, (encoder)
    no-repeat n-grams and bad words, in that order."""
    processors: list[LogitsProcessor] = []
    # transformers ignores dummy encoder inputs (filled with -100) and non-2-D ones.
    has_encoder_ids = prompt_ids is not None and prompt_ids.dim() == 2 and not bool((prompt_ids < 0).any())
    sequence_bias = _field(config, "sequence_bias")
    if sequence_bias is not None:
        processors.append(SequenceBiasLogitsProcessor(sequence_bias))
    # Group beam search only (transformers 4.55.4 builds it here, after the sequence bias).
    diversity_penalty, groups = _field(config, "diversity_penalty"), _field(config, "num_beam_groups")
    if diversity_penalty is not None and diversity_penalty > 0.0 and groups is not None and groups > 1:
        processors.append(
            HammingDiversityLogitsProcessor(float(diversity_penalty), int(_field(config, "num_beams")), int(groups))
        )
    encoder_penalty = _field(config, "encoder_repetition_penalty")
    if encoder_penalty is not None and encoder_penalty != 1.0:
        if has_encoder_ids:
            processors.append(EncoderRepetitionPenaltyLogitsProcessor(encoder_penalty, cast(torch.Tensor, prompt_ids)))
        else:
            # stacklevel 3: the warning points at build_logits_processors' caller.
            warnings.warn(
                "`encoder_repetition_penalty` needs the prompt ids (2-D, non-negative); ignoring it.",
                UserWarning,
                stacklevel=3,
            )
    repetition_penalty = _field(config, "repetition_penalty")
    if repetition_penalty is not None and repetition_penalty != 1.0:
        ignore = prompt_pad_lengths
        if ignore is not None and not isinstance(ignore, torch.Tensor):
            ignore = torch.tensor(list(ignore), dtype=torch.long)
        if ignore is not None and prompt_ids is not None:
            ignore = ignore.to(prompt_ids.device)
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty, prompt_ignore_length=ignore))
    no_repeat = _field(config, "no_repeat_ngram_size")
    if no_repeat is not None and no_repeat > 0:
        processors.append(NoRepeatNGramLogitsProcessor(no_repeat))
    encoder_no_repeat = _field(config, "encoder_no_repeat_ngram_size")
    if encoder_no_repeat is not None and encoder_no_repeat > 0:
        if has_encoder_ids:
            processors.append(EncoderNoRepeatNGramLogitsProcessor(encoder_no_repeat, cast(torch.Tensor, prompt_ids)))
        else:
            warnings.warn(
                "`encoder_no_repeat_ngram_size` needs the prompt ids (2-D, non-negative); ignoring it.",
                UserWarning,
                stacklevel=3,
            )
    bad_words_ids = _field(config, "bad_words_ids")
    if bad_words_ids is not None:
        processors.append(NoBadWordsLogitsProcessor(bad_words_ids, eos))
    return processors


def _length_and_suppression_processors(
    config: Any, input_len: int, eos: list[int] | None, allowed: Any = None, num_beams: int = 1
) -> list[LogitsProcessor]:
    """Min length, min new tokens, forced BOS/EOS, inf/nan removal, the exponential decay length
    penalty and token suppression, in transformers' order (inf/nan removal sits in the middle there too)."""
    processors: list[LogitsProcessor] = []
    min_length = _field(config, "min_length")
    if min_length is not None and eos is not None and min_length > 0:
        processors.append(MinLengthLogitsProcessor(min_length, eos))
    min_new_tokens = _field(config, "min_new_tokens")
    if min_new_tokens is not None and eos is not None and min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(input_len, min_new_tokens, eos))
    if allowed is not None:
        processors.append(PrefixConstrainedLogitsProcessor(allowed, num_beams))
    forced_bos = _field(config, "forced_bos_token_id")
    if forced_bos is not None:
        processors.append(ForcedBOSTokenLogitsProcessor(forced_bos))
    forced_eos = _field(config, "forced_eos_token_id")
    if forced_eos is not None:
        max_length = _field(config, "max_length")
        if max_length is None:
            raise ValueError("`forced_eos_token_id` needs `max_length`; apply the global defaults to the config first.")
        processors.append(ForcedEOSTokenLogitsProcessor(max_length, forced_eos))
    if _field(config, "remove_invalid_values") is True:
        processors.append(InfNanRemoveLogitsProcessor())
    decay = _field(config, "exponential_decay_length_penalty")
    if decay is not None:
        if eos is None:
            raise ValueError(
                "`exponential_decay_length_penalty` raises the EOS score, but no `eos_token_id` is set; set "
                "`eos_token_id` or drop the penalty."
            )
        processors.append(ExponentialDecayLengthPenalty(decay, eos, input_len))
    suppress = _field(config, "suppress_tokens")
    if suppress is not None:
        processors.append(SuppressTokensLogitsProcessor(suppress))
    begin_suppress = _field(config, "begin_suppress_tokens")
    if begin_suppress is not None:
        # After a one-token prompt a forced BOS takes the first position, so "begin" is one later.
        begin_index = input_len if (input_len > 1 or forced_bos is None) else input_len + 1
        processors.append(SuppressTokensAtBeginLogitsProcessor(begin_suppress, begin_index))
    return processors


def _sampling_warpers(config: Any, num_beams: int, eos: list[int] | None) -> list[LogitsProcessor]:
    """Temperature, top-h, top-k, top-p, min-p, typical, epsilon and eta, in that order (only when `do_sample`)."""
    # A beam must keep a non-EOS continuation next to every EOS id.
    if num_beams is not None and num_beams > 1:
        min_tokens_to_keep = len(eos) + 1 if eos is not None else 2
    else:
        min_tokens_to_keep = 1
    warpers: list[LogitsProcessor] = []
    temperature = _field(config, "temperature")
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    top_h = _field(config, "top_h")
    if top_h is not None:
        warpers.append(TopHLogitsWarper(top_h))
    top_k = _field(config, "top_k")
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k, min_tokens_to_keep=min_tokens_to_keep))
    top_p = _field(config, "top_p")
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p, min_tokens_to_keep=min_tokens_to_keep))
    min_p = _field(config, "min_p")
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p, min_tokens_to_keep=min_tokens_to_keep))
    typical_p = _field(config, "typical_p")
    if typical_p is not None and typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(typical_p, min_tokens_to_keep=min_tokens_to_keep))
    epsilon = _field(config, "epsilon_cutoff")
    if epsilon is not None and 0.0 < epsilon < 1.0:
        warpers.append(EpsilonLogitsWarper(epsilon, min_tokens_to_keep=min_tokens_to_keep))
    eta = _field(config, "eta_cutoff")
    if eta is not None and 0.0 < eta < 1.0:
        warpers.append(EtaLogitsWarper(eta, min_tokens_to_keep=min_tokens_to_keep))
    return warpers


def _final_processors(config: Any, vocab_size: int, device: str | torch.device) -> list[LogitsProcessor]:
    """The watermark, then `LogitNormalization`: both must see the final distribution, so they come last."""
    processors: list[LogitsProcessor] = []
    watermarking_config = _field(config, "watermarking_config")
    if watermarking_config is not None:
        processors.append(watermark_processor(watermarking_config, vocab_size, device))
    if _field(config, "renormalize_logits") is True:
        processors.append(LogitNormalization())
    return processors
