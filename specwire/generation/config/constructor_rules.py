"""The rules of `transformers.GenerationConfig(**kwargs)` (configuration_utils.py `validate()`), in its order.

Each function records on a `Recorder`; `validation.validate()` runs them before the `generate()` rules.
Values are compared only after a type test, so no rule evaluates an expression that could raise.
"""

from __future__ import annotations

from typing import Any

from specwire.generation.config.modes import (
    DEPRECATED_FIELDS,
    REMOVED_MODE_FIELDS,
    V4_MODE_FIELDS,
    GenerationMode,
    generation_mode,
)
from specwire.generation.config.serialization import (
    COMPILE_KEYS,
    SYNTHID_KEYS,
    SYNTHID_REQUIRED,
    WATERMARK_DEFAULTS,
    watermark_kind,
)
from specwire.generation.config.value_types import as_set, has_field_type, is_int, is_number
from specwire.generation.config.violations import Recorder

__all__ = ["check_constructor"]

# `generate()` arguments that transformers refuses to find inside a config (configuration_utils.py
# validate()).
GENERATE_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)

STATIC_CACHE_IMPLEMENTATIONS = ("static", "offloaded_static")
ALL_STATIC_CACHE_IMPLEMENTATIONS = STATIC_CACHE_IMPLEMENTATIONS + (
    "sliding_window",
    "hybrid",
    "hybrid_chunked",
    "offloaded_hybrid",
    "offloaded_hybrid_chunked",
)
# "paged" is accepted too: in transformers it routes to continuous batching.
VALID_CACHE_IMPLEMENTATIONS = ALL_STATIC_CACHE_IMPLEMENTATIONS + ("dynamic", "offloaded", "quantized", "paged")

_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")

# Sampling flags and the value that leaves them inactive (`None`: any value is reported).
_SAMPLING_FLAGS: tuple[tuple[str, float | None], ...] = (
    ("temperature", 1.0),
    ("top_p", 1.0),
    ("min_p", None),
    ("top_h", None),
    ("typical_p", 1.0),
    ("top_k", 50),
    ("epsilon_cutoff", 0.0),
    ("eta_cutoff", 0.0),
)


def check_constructor(r: Recorder) -> None:
    """Everything `transformers.GenerationConfig(**kwargs)` refuses or warns about, in its order."""
    check_basic_values(r)
    check_cache_and_compile(r)
    if r.cfg.watermarking_config is not None:
        check_watermarking_config(r, r.cfg.watermarking_config)
    check_unused_sampling_flags(r)
    check_unused_beam_flags(r)
    check_num_return_sequences(r)
    check_unused_outputs(r)
    check_forced_and_suppressed(r)
    for name in GENERATE_ARGUMENTS:
        if name in r.cfg.extra:
            r.error(
                name,
                r.cfg.extra[name],
                f"`{name}` is not a valid argument of `GenerationConfig`. It is an argument of `generate()`; "
                "remove it from the config.",
            )
    check_deprecated(r)


def check_basic_values(r: Recorder) -> None:
    """`early_stopping`, `max_new_tokens`, `assistant_ensemble_weight` and `pad_token_id`."""
    c = r.cfg
    # A tuple, not transformers' set: the same verdict without hashing (an unhashable value is refused too).
    if c.early_stopping not in (None, True, False, "never"):
        r.error(
            "early_stopping",
            c.early_stopping,
            f"`early_stopping` (={c.early_stopping!r}) must be a boolean or 'never'. Use True, False or 'never'.",
        )
    if c.max_new_tokens is not None and (not is_number(c.max_new_tokens) or c.max_new_tokens <= 0):
        r.error(
            "max_new_tokens",
            c.max_new_tokens,
            f"`max_new_tokens` (={c.max_new_tokens!r}) must be greater than 0. Set a positive integer, or unset "
            "it to use `max_length`.",
        )
    weight = c.assistant_ensemble_weight
    if weight is not None and not (has_field_type("assistant_ensemble_weight", weight) and 0.0 < weight < 1.0):
        r.error(
            "assistant_ensemble_weight",
            weight,
            f"`assistant_ensemble_weight` (={weight!r}) must be in the open interval (0.0, 1.0). Unset it for "
            "standard (lossless) speculative decoding.",
        )
    if c.pad_token_id is not None:
        if not is_number(c.pad_token_id):
            r.error(
                "pad_token_id",
                c.pad_token_id,
                f"`pad_token_id` (={c.pad_token_id!r}) must be a non-negative integer token id.",
            )
        elif c.pad_token_id < 0:
            r.warn(
                "pad_token_id",
                c.pad_token_id,
                f"`pad_token_id` should be positive but got {c.pad_token_id}. This will cause errors when batch "
                "generating with padding. Set `pad_token_id` to the id of the tokenizer's pad token.",
            )


def check_cache_and_compile(r: Recorder) -> None:
    """`cache_implementation`, `max_cache_len` and `compile_config`."""
    c = r.cfg
    if c.cache_implementation is not None and c.cache_implementation not in VALID_CACHE_IMPLEMENTATIONS:
        r.error(
            "cache_implementation",
            c.cache_implementation,
            f"Invalid `cache_implementation` (={c.cache_implementation!r}). Choose one of: "
            f"{VALID_CACHE_IMPLEMENTATIONS}.",
        )
    if c.max_cache_len is not None and c.cache_implementation not in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        r.warn(
            "max_cache_len",
            c.max_cache_len,
            f"`max_cache_len` is only used with static caches {STATIC_CACHE_IMPLEMENTATIONS}; it will be ignored "
            f"with `cache_implementation={c.cache_implementation!r}`. Set a static `cache_implementation` or unset "
            "`max_cache_len`.",
        )
    cc = c.compile_config
    if cc is not None and (not isinstance(cc, dict) or not set(cc) <= COMPILE_KEYS):
        r.error(
            "compile_config",
            cc,
            f"`compile_config` (={cc!r}) must be a dict of `CompileConfig` arguments ({sorted(COMPILE_KEYS)}).",
        )


def check_watermarking_config(r: Recorder, wm: Any) -> None:
    """What `WatermarkingConfig` / `SynthIDTextWatermarkingConfig` and their `validate()` refuse."""
    name = "watermarking_config"
    if not isinstance(wm, dict):
        r.error(name, wm, f"`watermarking_config` (={wm!r}) must be a dict (WatermarkingConfig fields).")
        return
    if watermark_kind(wm) == "synthid":
        unknown = sorted(set(wm) - SYNTHID_KEYS)
        missing = [k for k in SYNTHID_REQUIRED if k not in wm]
        table_size = wm.get("sampling_table_size", 2**16)
        if unknown or missing:
            r.error(
                name,
                wm,
                f"`watermarking_config` looks like a SynthIDTextWatermarkingConfig but has unknown keys {unknown} "
                f"or lacks required keys {missing}. Allowed keys: {sorted(SYNTHID_KEYS)}.",
            )
        elif not is_number(table_size) or table_size > 2**24:
            r.error(
                name,
                wm,
                f"`watermarking_config.sampling_table_size` must be an integer < 2**24, but is {table_size!r}.",
            )
        return
    unknown = sorted(set(wm) - set(WATERMARK_DEFAULTS))
    if unknown:
        r.error(
            name,
            wm,
            f"`watermarking_config` has unknown keys {unknown}. WatermarkingConfig accepts "
            f"{sorted(WATERMARK_DEFAULTS)}; SynthID configs need `ngram_len` and `keys`.",
        )
        return
    full = {**WATERMARK_DEFAULTS, **wm}
    ratio, width = full["greenlist_ratio"], full["context_width"]
    if full["seeding_scheme"] not in ["selfhash", "lefthash"]:
        r.error(
            name,
            wm,
            "`watermarking_config.seeding_scheme` must be 'selfhash' or 'lefthash', but is "
            f"{full['seeding_scheme']!r}.",
        )
    elif not (is_number(ratio) and 0.0 <= ratio <= 1.0):
        r.error(
            name,
            wm,
            f"`watermarking_config.greenlist_ratio` must be in range between 0.0 and 1.0, but is {ratio!r}.",
        )
    elif not (is_number(width) and width >= 1):
        r.error(name, wm, f"`watermarking_config.context_width` must be a positive integer, but is {width!r}.")


def check_unused_sampling_flags(r: Recorder) -> None:
    """transformers' minor issue: sampling flags set while not sampling."""
    c = r.cfg
    if c.do_sample is True:
        return
    for name, neutral in _SAMPLING_FLAGS:
        value = getattr(c, name)
        if value is not None and (neutral is None or value != neutral):
            r.warn(
                name,
                value,
                f"`do_sample` is not set to `True`. However, `{name}` is set to `{value}` -- this flag is only "
                f"used in sample-based generation modes. You should set `do_sample=True` or unset `{name}`.",
            )


def check_unused_beam_flags(r: Recorder) -> None:
    """transformers' minor issue: beam flags set without beams."""
    c = r.cfg
    if not (c.num_beams is None or c.num_beams == 1):
        return
    for name, active in (
        ("early_stopping", c.early_stopping is not None and c.early_stopping is not False),
        ("length_penalty", c.length_penalty is not None and c.length_penalty != 1.0),
    ):
        if active:
            value = getattr(c, name)
            r.warn(
                name,
                value,
                f"`num_beams` is set to {c.num_beams}. However, `{name}` is set to `{value}` -- this flag is only "
                f"used in beam-based generation modes. You should set `num_beams>1` or unset `{name}`.",
            )


def check_num_return_sequences(r: Recorder) -> None:
    """More than one sequence needs sampling or at least as many beams."""
    c = r.cfg
    nrs = c.num_return_sequences
    if nrs is None:
        return
    if not is_number(nrs):
        r.error("num_return_sequences", nrs, f"`num_return_sequences` (={nrs!r}) must be a positive integer.")
    elif not nrs > 1:  # not `nrs <= 1`: a nan is not checked further either
        return
    elif c.num_beams is None or c.num_beams == 1:
        if not c.do_sample:
            r.error(
                "num_return_sequences",
                nrs,
                "Greedy methods (do_sample != True) without beam search do not support `num_return_sequences` "
                f"different than 1 (got {nrs}). Set `do_sample=True`, or `num_beams` >= `num_return_sequences`.",
            )
    elif not is_number(c.num_beams) or nrs > c.num_beams:
        r.error(
            "num_return_sequences",
            nrs,
            f"`num_return_sequences` ({nrs}) has to be smaller or equal to `num_beams` ({c.num_beams}). Raise "
            "`num_beams` or lower `num_return_sequences`.",
        )


def check_unused_outputs(r: Recorder) -> None:
    """transformers' minor issues: cache settings without the cache, output flags without a dict output."""
    c = r.cfg
    if c.use_cache is False:
        for name in ("cache_implementation", "cache_config"):
            value = getattr(c, name)
            if value is not None:
                r.warn(
                    name,
                    value,
                    f"You have not set `use_cache` to `True`, but {name} is set to {value}. {name} will have no "
                    "effect. Set `use_cache=True` or unset it.",
                )
    if c.return_dict_in_generate is not True:
        for name in _OUTPUT_FLAGS:
            if getattr(c, name) is True:
                r.warn(
                    name,
                    True,
                    f"`return_dict_in_generate` is NOT set to `True`, but `{name}` is. When `return_dict_in_generate` "
                    f"is not `True`, `{name}` is ignored. Set `return_dict_in_generate=True` to get these outputs.",
                )


def check_forced_and_suppressed(r: Recorder) -> None:
    """A token both forced and suppressed leaves only `-inf` logits at the forcing step."""
    c = r.cfg
    if c.suppress_tokens is None:
        return
    suppressed = as_set(c.suppress_tokens)
    if suppressed is None:
        r.error(
            "suppress_tokens",
            c.suppress_tokens,
            f"`suppress_tokens` (={c.suppress_tokens!r}) must be a list of token ids.",
        )
        return
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = getattr(c, name)
        if forced is None:
            continue
        tokens = {forced} if is_int(forced) else as_set(forced)
        if tokens is None:
            r.error(name, forced, f"`{name}` (={forced!r}) must be a token id or a list of ids.")
        elif tokens and tokens <= suppressed:
            r.error(
                name,
                forced,
                f"Every token in `{name}` ({sorted(tokens, key=repr)}) is also in `suppress_tokens`. Forcing a "
                "token while suppressing it sets all logits to `-inf` at the forcing step. Remove the "
                f"overlapping token(s) from either `{name}` or `suppress_tokens` (to prevent an early EOS token, "
                "use `min_new_tokens` instead).",
            )


def check_deprecated(r: Recorder) -> None:
    """A warning per field of `DEPRECATED_FIELDS` that is set."""
    c = r.cfg
    mode: GenerationMode = generation_mode(c, assisted_triggers=True)
    for name in DEPRECATED_FIELDS:
        value = getattr(c, name)
        if value is None:
            continue
        if name == "continuous_batching_config":
            message = (
                "`continuous_batching_config` in a generation config is deprecated since transformers 5.13 and "
                "ignored by `generate()`. Remove it."
            )
        elif name in V4_MODE_FIELDS.get(mode, ()) or (name == "diversity_penalty" and mode in V4_MODE_FIELDS):
            message = (
                f"`{name}` (={value!r}) selects or configures `{mode.value}`, a decoding mode transformers v5 moved "
                "to a Hub `custom_generate` repository; specwire runs it with transformers 4.55.4's semantics."
            )
        elif name in REMOVED_MODE_FIELDS.get(mode, ()):
            message = (
                f"`{name}` (={value!r}) selects `{mode.value}`, a decoding mode transformers v5 moved to a Hub "
                "`custom_generate` repository; specwire does not run it. Unset it."
            )
        else:
            beams = " and beam search refuses `low_memory=True`" if name == "low_memory" else ""
            message = (
                f"`{name}` (={value!r}) belongs to a decoding mode transformers v5 removed; it has no effect "
                f"here{beams}. Unset it."
            )
        r.warn(name, value, message)
    penalty = c.repetition_penalty
    if mode is GenerationMode.DOLA_GENERATION and not (isinstance(penalty, (int, float)) and penalty >= 1.2):
        # transformers 4.55.4's rule for DoLa (a minor issue there, a warning here).
        r.warn(
            "repetition_penalty",
            penalty,
            f"`dola_layers` is set to trigger DoLa decoding, but `repetition_penalty` is set to a value of {penalty}, "
            "which could induce unwanted repetition. The recommended value for DoLa decoding is "
            "`repetition_penalty>=1.2`.",
        )
