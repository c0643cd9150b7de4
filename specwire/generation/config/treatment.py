"""How specwire treats every `GenerationConfig` field: honoured, warned about, or refused.

The rule of the service is that nothing it accepts is silently ignored. `FIELD_TREATMENT` is the one
table that says, for each field, what happens to a request that sets it; a unit test checks that every
field of `GenerationConfig` is in it, so a new field cannot be dropped silently. `not_honoured(config)`
returns the warnings the target puts in its response for the fields that are accepted but not acted on.

The rows of `modes.MODE_FIELDS` (modes transformers 5 removed, options it ignores, drafting methods the
service cannot run) are derived from that table: `validate()` already warns about the options and the
decoding loop refuses the modes, so `not_honoured` does not repeat them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specwire.generation.config.modes import MODE_FIELDS, STATIC_CACHES, FieldStatus, uses_static_cache
from specwire.generation.config.violations import Violation

__all__ = ["FIELD_TREATMENT", "FieldTreatment", "Treatment", "not_honoured"]


class Treatment(enum.Enum):
    """What happens to a request that sets a field."""

    # The decoding loops act on it as transformers' `generate()` does (a parity test shows the effect).
    HONOURED = "honoured"
    # Accepted; a value the loops do not act on gets a warning in the response (`not_honoured`).
    WARNED = "warned"
    # `validate()` warns whenever it is set (an option transformers 5 ignores or moved out).
    WARNED_BY_VALIDATION = "warned_by_validation"
    # A request that selects it is refused before any forward pass (UNIMPLEMENTED or INVALID_ARGUMENT).
    REFUSED = "refused"


@dataclass(frozen=True)
class FieldTreatment:
    """One row of `FIELD_TREATMENT`.

    Args:
        how (`Treatment`):
            What happens to a request that sets the field.
        why (`str`):
            Where it is honoured, or why it is not (the text of the warning).
        honoured (`Callable[[Any, Any], bool]`, *optional*):
            `Treatment.WARNED` only: `honoured(value, config)` says when a value is honoured after all (no
            warning), e.g. `disable_compile=True`. `None`: every set value is warned about.
    """

    how: Treatment
    why: str
    honoured: Callable[[Any, Any], bool] | None = None


def _honoured(why: str) -> FieldTreatment:
    return FieldTreatment(Treatment.HONOURED, why)


def _warned(why: str, honoured: Callable[[Any, Any], bool] | None = None) -> FieldTreatment:
    return FieldTreatment(Treatment.WARNED, why, honoured)


_LOOP = "the decoding loops (planning, loops/)"
_PROCESSOR = "a logits processor (processors/factory.py), as transformers builds it"
_STOPPING = "a stopping criterion (stopping.py)"
_DRAFTING = "speculative decoding (speculation/, target_service/drafting.py)"

# Fields the decoding loops act on, and where.
_HONOURED: dict[str, str] = {
    "max_length": _LOOP,
    "max_new_tokens": _LOOP,
    "min_length": _PROCESSOR,
    "min_new_tokens": _PROCESSOR,
    "early_stopping": "beam search (loops/beam_search.py)",
    "max_time": _STOPPING,
    "stop_strings": _STOPPING,
    "do_sample": _LOOP,
    "num_beams": _LOOP,
    "use_cache": "the rows (without a cache every step runs the whole sequence)",
    "temperature": _PROCESSOR,
    "top_k": _PROCESSOR,
    "top_p": _PROCESSOR,
    "min_p": _PROCESSOR,
    "top_h": _PROCESSOR,
    "typical_p": _PROCESSOR,
    "epsilon_cutoff": _PROCESSOR,
    "eta_cutoff": _PROCESSOR,
    "repetition_penalty": _PROCESSOR,
    "encoder_repetition_penalty": _PROCESSOR + " (the prompt is the encoder input of a decoder-only model)",
    "length_penalty": "beam search scores (loops/beam_search.py)",
    "no_repeat_ngram_size": _PROCESSOR,
    "encoder_no_repeat_ngram_size": _PROCESSOR + " (the prompt is the encoder input of a decoder-only model)",
    "bad_words_ids": _PROCESSOR,
    "renormalize_logits": _PROCESSOR,
    "forced_bos_token_id": _PROCESSOR,
    "forced_eos_token_id": _PROCESSOR,
    "remove_invalid_values": _PROCESSOR,
    "exponential_decay_length_penalty": _PROCESSOR,
    "suppress_tokens": _PROCESSOR,
    "begin_suppress_tokens": _PROCESSOR,
    "sequence_bias": _PROCESSOR,
    "guidance_scale": _PROCESSOR + " with its own KV cache (classifier-free guidance)",
    "watermarking_config": _PROCESSOR + " (green-list, and SynthID with its per-row state; speculative requests "
    "with SynthID run plain decoding)",
    "num_return_sequences": _LOOP,
    "output_attentions": "the result's attentions, transformers' layout (eager attention: an sdpa model refuses "
    "it; speculative requests run plain decoding)",
    "output_hidden_states": "the result's hidden states, transformers' layout (speculative requests run plain "
    "decoding)",
    "output_scores": "the result's scores",
    "output_logits": "the result's logits",
    "return_dict_in_generate": "the result (the wire always carries the dict form)",
    "pad_token_id": _LOOP,
    "bos_token_id": "generation from no prompt starts from it, as transformers does with inputs=None",
    "eos_token_id": _LOOP + " and " + _STOPPING,
    "is_assistant": _STOPPING,
    "num_assistant_tokens": _DRAFTING,
    "num_assistant_tokens_schedule": _DRAFTING,
    "assistant_confidence_threshold": _DRAFTING,
    "prompt_lookup_num_tokens": _DRAFTING,
    "assistant_early_exit": _DRAFTING + " with the target's own first N layers and LM head "
    "(speculation/early_exit.py, proposer early_exit)",
    "use_mtp": _DRAFTING + " with the served model's own multi-token prediction layers, in the target's process "
    "(speculation/mtp.py, proposer mtp); a model without MTP layers is refused",
    "speculation_type": _DRAFTING + " with the DFlash assistant the target loaded (--dflash-model): 'dflash' only, "
    "refused without one (speculation/dflash.py, proposer dflash)",
    "max_matching_ngram_size": _DRAFTING,
    "assistant_ensemble_weight": _DRAFTING + " with a draft model, greedy and sampling; refused with prompt "
    "lookup (as transformers refuses it); the target warns when the request runs without a draft model",
    "prefill_chunk_size": "the rows' prefill (in chunks of that many tokens)",
    "disable_compile": "the static-cache decoding steps run through torch.compile where transformers' rule compiles "
    "them (generation/compilation.py); True decodes without it",
    "seed": "the request's sampling generator (specwire extension)",
}

_CACHES = (
    "specwire decodes with a dynamic KV cache, or a static one with cache_implementation 'static' (or its aliases "
    "'sliding_window', 'hybrid_chunked')"
)

# Fields accepted and not acted on: a request that sets one gets a warning naming it.
_WARNED: dict[str, FieldTreatment] = {
    "cache_implementation": _warned(
        f"{_CACHES}; a {{value!r}} cache is not used (outputs are those of the dynamic cache)",
        # "hybrid": transformers unsets it before generating (a dynamic cache), as specwire does.
        honoured=lambda value, config: value in ("dynamic", "hybrid", *STATIC_CACHES),
    ),
    "cache_config": _warned(f"{_CACHES}, which take no cache configuration"),
    "max_cache_len": _warned(
        "it sizes a static cache, and this request does not use one (set cache_implementation='static')",
        honoured=lambda value, config: config.cache_implementation in STATIC_CACHES,
    ),
    # Honoured with a static cache unless compilation is disabled; on a device transformers does not compile
    # on (the CPU without `_compile_all_devices`), the target adds the warning (`compilation.compile_warning`).
    "compile_config": _warned(
        "transformers compiles the decoding steps only with a static cache (cache_implementation='static') and "
        "without disable_compile=True; this request decodes without torch.compile",
        honoured=lambda value, config: uses_static_cache(config) and not config.disable_compile,
    ),
    "decoder_start_token_id": _warned(
        "it starts the decoder of encoder-decoder models; the served model is decoder-only (transformers ignores "
        "it there too)"
    ),
    "assistant_lookbehind": _warned(
        "it applies when the draft model has another tokenizer (universal assisted decoding); specwire's drafts "
        "share the target's vocabulary"
    ),
    "target_lookbehind": _warned(
        "it applies when the draft model has another tokenizer (universal assisted decoding); specwire's drafts "
        "share the target's vocabulary"
    ),
}


# The v4 modes specwire runs with transformers 4.55.4's semantics (validate() warns that transformers 5
# moved them out).
_V4_MODES = {
    "num_beam_groups": "group beam search (loops/group_beam.py), transformers 4.55.4's semantics",
    "diversity_penalty": "group beam search's Hamming diversity penalty (processors/diversity.py), transformers "
    "4.55.4's semantics; without num_beam_groups > 1 it has no effect (validate() warns)",
    "penalty_alpha": "contrastive search with top_k (loops/contrastive.py), transformers 4.55.4's semantics",
    "dola_layers": "DoLa decoding with greedy search or sampling (loops/dola.py), transformers 4.55.4's semantics; "
    "with beam search it has no effect (validate() warns, as 4.55.4 does)",
    "force_words_ids": "constrained beam search (loops/constrained_beam.py): each entry a phrasal or disjunctive "
    "constraint, transformers 4.55.4's semantics",
    "constraints": "constrained beam search (loops/constrained_beam.py) with phrasal / disjunctive constraints "
    "given as plain data, transformers 4.55.4's semantics",
}


def _mode_field_treatment(field: str, status: FieldStatus) -> FieldTreatment:
    if status is FieldStatus.SERVED_V4:
        return _honoured(_V4_MODES[field])
    if status is FieldStatus.REMOVED_MODE:
        return FieldTreatment(Treatment.REFUSED, "a decoding mode or drafting method specwire does not run")
    return FieldTreatment(Treatment.WARNED_BY_VALIDATION, "transformers 5 ignores it; validate() warns")


FIELD_TREATMENT: dict[str, FieldTreatment] = {
    **{name: _honoured(why) for name, why in _HONOURED.items()},
    **_WARNED,
    "token_healing": _honoured("the target heals the tokenized prompts (specwire.generation.healing) before decoding"),
    **{row.field: _mode_field_treatment(row.field, row.status) for row in MODE_FIELDS},
}


def not_honoured(config: Any) -> list[Violation]:
    """Warnings for the fields `config` sets that the decoding loops do not act on.

    Args:
        config (`GenerationConfig`):
            The merged config of a request (unset fields are `None`).

    Returns:
        `list[Violation]`: one warning per such field, in the table's order, naming the value and why it
        is not honoured.
    """
    found = []
    for name, row in FIELD_TREATMENT.items():
        if row.how is not Treatment.WARNED:
            continue
        value = getattr(config, name, None)
        if value is None or (row.honoured is not None and row.honoured(value, config)):
            continue
        why = row.why.replace("{value!r}", repr(value))
        found.append(Violation(name, value, f"not honoured: {why}", "warning"))
    return found
