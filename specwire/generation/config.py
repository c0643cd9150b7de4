"""`GenerationConfig`: transformers' generation parameters as a plain dataclass, with validation.

The dataclass mirrors `transformers.GenerationConfig` (v5.23) field for field, plus the v4.56 fields that v5
still accepts (`num_beam_groups`, `diversity_penalty`, `force_words_ids`, `constraints`, `penalty_alpha`,
`dola_layers`, `low_memory`) and one extension, `seed`. As in transformers v5, **every field defaults to
`None`, meaning unset**: an unset field takes the model's `generation_config.json` value, then transformers'
global default (`DEFAULT_GENERATION_PARAMS`), and `merge()` keeps that priority order. Keys that are not
fields ("custom entries", which transformers keeps as attributes) live in `extra`.

`validate()` reports, without raising, exactly what transformers refuses from the config alone: what
`transformers.GenerationConfig(**kwargs)` raises, and what `generate()` raises while it resolves the
generation mode, prepares special tokens and lengths, builds logits processors and stopping criteria, and runs
the first decoding step. transformers' logged "minor issues" are warnings.
`tests/parity/test_validation_battery.py` checks the verdicts against the installed transformers.

This module is pure Python: torch and transformers are imported only inside `from_transformers()` and
`to_transformers()`, so config registries can use it without loading either.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "DEFAULT_GENERATION_PARAMS",
    "DEPRECATED_FIELDS",
    "GenerationConfig",
    "GenerationMode",
    "Violation",
    "errors",
    "merge",
]

# Global defaults applied by `generate()` to fields still unset after the model's generation config
# (transformers 5.23 `GenerationConfig._get_default_generation_params()`; a test checks them against it).
DEFAULT_GENERATION_PARAMS: Mapping[str, Any] = MappingProxyType(
    {
        "max_length": 20,
        "min_length": 0,
        "do_sample": False,
        "use_cache": True,
        "early_stopping": False,
        "num_beams": 1,
        "temperature": 1.0,
        "top_k": 50,
        "top_p": 1.0,
        "typical_p": 1.0,
        "repetition_penalty": 1.0,
        "length_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "encoder_no_repeat_ngram_size": 0,
        "bad_words_ids": None,
        "num_return_sequences": 1,
        "output_scores": False,
        "return_dict_in_generate": False,
        "forced_bos_token_id": None,
        "forced_eos_token_id": None,
        "remove_invalid_values": False,
        "exponential_decay_length_penalty": None,
        "suppress_tokens": None,
        "begin_suppress_tokens": None,
        "epsilon_cutoff": 0.0,
        "eta_cutoff": 0.0,
        "encoder_repetition_penalty": 1.0,
        "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4,
        "assistant_lookbehind": 10,
        "target_lookbehind": 10,
        "num_beam_groups": 1,
        "diversity_penalty": 0.0,
    }
)

# Fields that only select a decoding mode v5 moved to the Hub, or that v5 ignores (the target service answers
# UNIMPLEMENTED for those modes); `validate()` warns whenever one is set.
DEPRECATED_FIELDS = (
    "low_memory",
    "penalty_alpha",
    "dola_layers",
    "diversity_penalty",
    "num_beam_groups",
    "constraints",
    "force_words_ids",
    "continuous_batching_config",
)

# Keys of a `generation_config.json` that describe the file, not the generation.
_METADATA_KEYS = ("transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash")

# `generate()` arguments that transformers refuses to find inside a config (configuration_utils.py
# validate()).
_GENERATE_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
)

_STATIC_CACHE_IMPLEMENTATIONS = ("static", "offloaded_static")
_ALL_STATIC_CACHE_IMPLEMENTATIONS = _STATIC_CACHE_IMPLEMENTATIONS + (
    "sliding_window",
    "hybrid",
    "hybrid_chunked",
    "offloaded_hybrid",
    "offloaded_hybrid_chunked",
)
# "paged" is accepted too: in transformers it routes to continuous batching.
_VALID_CACHE_IMPLEMENTATIONS = _ALL_STATIC_CACHE_IMPLEMENTATIONS + (
    "dynamic",
    "offloaded",
    "quantized",
    "paged",
)

_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")

# Constructor arguments (and defaults) of transformers' WatermarkingConfig, SynthIDTextWatermarkingConfig and
# CompileConfig: the dict forms stored here are their `to_dict()` outputs.
_WATERMARK_DEFAULTS = MappingProxyType(
    {
        "greenlist_ratio": 0.25,
        "bias": 2.0,
        "hashing_key": 15485863,
        "seeding_scheme": "lefthash",
        "context_width": 1,
    }
)
_SYNTHID_DEFAULTS = MappingProxyType(
    {
        "context_history_size": 1024,
        "sampling_table_seed": 0,
        "sampling_table_size": 2**16,
        "skip_first_ngram_calls": False,
        "debug_mode": False,
    }
)
_SYNTHID_REQUIRED = ("ngram_len", "keys")
_SYNTHID_KEYS = frozenset(_SYNTHID_DEFAULTS) | frozenset(_SYNTHID_REQUIRED)
_COMPILE_DEFAULTS = MappingProxyType(
    {"fullgraph": False, "dynamic": None, "backend": "inductor", "mode": "reduce-overhead", "options": None}
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class GenerationMode(enum.StrEnum):
    """Decoding modes, with transformers' `GenerationMode` values.

    `group_beam_search`, `constrained_beam_search`, `contrastive_search` and `dola_generation` were moved to
    Hub `custom_generate` repositories in transformers v5; specwire reports them but does not run them.
    """

    CONTRASTIVE_SEARCH = "contrastive_search"
    GREEDY_SEARCH = "greedy_search"
    SAMPLE = "sample"
    ASSISTED_GENERATION = "assisted_generation"
    DOLA_GENERATION = "dola_generation"
    BEAM_SEARCH = "beam_search"
    BEAM_SAMPLE = "beam_sample"
    CONSTRAINED_BEAM_SEARCH = "constrained_beam_search"
    GROUP_BEAM_SEARCH = "group_beam_search"

    def __str__(self) -> str:
        return self.value


REMOVED_MODES = frozenset(
    {
        GenerationMode.GROUP_BEAM_SEARCH,
        GenerationMode.CONSTRAINED_BEAM_SEARCH,
        GenerationMode.CONTRASTIVE_SEARCH,
        GenerationMode.DOLA_GENERATION,
    }
)


@dataclass(frozen=True)
class Violation:
    """One problem found by `GenerationConfig.validate()`.

    Args:
        field (`str`):
            Name of the offending field (transformers' attribute name, or an `extra` key).
        value (`Any`):
            The offending value, as set in the config.
        message (`str`):
            What is wrong and how to fix it.
        severity (`"error"` or `"warning"`):
            `"error"` when transformers refuses the config, `"warning"` for transformers' "minor issues" and
            for fields that v5 ignores or only uses in modes specwire does not run.
    """

    field: str
    value: Any
    message: str
    severity: Literal["error", "warning"]


def errors(violations: Iterable[Violation]) -> list[Violation]:
    """The violations of severity `"error"`.

    Args:
        violations (`Iterable[Violation]`):
            What `GenerationConfig.validate()` returned.

    Returns:
        `list[Violation]`: the errors, in order.
    """
    return [v for v in violations if v.severity == "error"]


@dataclass
class GenerationConfig:
    """The parameters of one generation, with transformers' names, types and meaning; `None` means unset.

    Field semantics are transformers' (see the `transformers.GenerationConfig` docstring); only the storage
    differs: nested transformers objects are plain data.

    Args:
        watermarking_config (`dict`, *optional*):
            `WatermarkingConfig.to_dict()` (`greenlist_ratio`, `bias`, `hashing_key`, `seeding_scheme`,
            `context_width`) or `SynthIDTextWatermarkingConfig.to_dict()` (`ngram_len`, `keys`, ...). A dict
            with known keys is completed with the class defaults.
        sequence_bias (`list[[list[int], float]]`, *optional*):
            Also accepts transformers' legacy `dict[tuple[int, ...], float]`, stored as the list form.
        compile_config (`dict`, *optional*):
            `CompileConfig` arguments, completed with its defaults.
        constraints (`list[dict]`, *optional*):
            v4.56 constrained beam search constraints as plain data (the mode is not run by specwire).
        seed (`int`, *optional*):
            specwire extension: seeds the sampling generator of this request (not a transformers field).
        extra (`dict[str, Any]`, defaults to `{}`):
            Custom entries, i.e. keys that are not fields; transformers keeps them as attributes.
    """

    # Parameters that control the length of the output
    max_length: int | None = None
    max_new_tokens: int | None = None
    min_length: int | None = None
    min_new_tokens: int | None = None
    early_stopping: bool | str | None = None
    max_time: float | None = None
    stop_strings: str | list[str] | None = None

    # Parameters that control the generation strategy used
    do_sample: bool | None = None
    num_beams: int | None = None
    use_mtp: bool | None = None

    # Parameters that control the cache
    use_cache: bool | None = None
    cache_implementation: str | None = None
    cache_config: dict | None = None
    max_cache_len: int | None = None

    # Parameters for manipulation of the model output logits
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    top_h: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    repetition_penalty: float | None = None
    encoder_repetition_penalty: float | None = None
    length_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    bad_words_ids: list[list[int]] | None = None
    renormalize_logits: bool | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | list[int] | None = None
    remove_invalid_values: bool | None = None
    exponential_decay_length_penalty: tuple[int, float] | list | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    sequence_bias: list | dict | None = None
    token_healing: bool | None = None
    guidance_scale: float | None = None
    watermarking_config: dict | None = None

    # Parameters that define the output variables of `generate`
    num_return_sequences: int | None = None
    output_attentions: bool | None = None
    output_hidden_states: bool | None = None
    output_scores: bool | None = None
    output_logits: bool | None = None
    return_dict_in_generate: bool | None = None

    # Special tokens that can be used at generation time
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    # Generation parameters exclusive to encoder-decoder models
    encoder_no_repeat_ngram_size: int | None = None
    decoder_start_token_id: int | list[int] | None = None

    # Assistant generation (speculative decoding, prompt lookup)
    is_assistant: bool | None = None
    num_assistant_tokens: int | None = None
    num_assistant_tokens_schedule: str | None = None
    assistant_confidence_threshold: float | None = None
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    assistant_early_exit: int | None = None
    assistant_lookbehind: int | None = None
    target_lookbehind: int | None = None
    assistant_ensemble_weight: float | None = None
    speculation_type: str | None = None

    # Performance
    compile_config: dict | None = None
    disable_compile: bool | None = None
    prefill_chunk_size: int | None = None

    # Deprecated: continuous batching settings (transformers 5.13 moved them out of GenerationConfig)
    continuous_batching_config: dict | None = None

    # Deprecated: v4.56 modes moved to the Hub in v5 (contrastive search, DoLa, group and constrained beam
    # search)
    low_memory: bool | None = None
    penalty_alpha: float | None = None
    dola_layers: str | list[int] | None = None
    diversity_penalty: float | None = None
    num_beam_groups: int | None = None
    constraints: list[dict] | None = None
    force_words_ids: list | None = None

    # specwire extension (not a transformers field): seed of this request's sampling generator
    seed: int | None = None

    # Custom entries (keys that are not fields)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._normalize()

    # ----------------------------------------------------------------------------------------------------
    # Field bookkeeping

    def _normalize(self) -> None:
        # Store nested structures in one canonical form, so that equality and round trips do not depend on
        # which equivalent spelling a caller used. Values that cannot be normalized stay as given for
        # validate().
        self.sequence_bias = _normalize_sequence_bias(self.sequence_bias)
        self.watermarking_config = _normalize_watermarking(self.watermarking_config)
        self.compile_config = _normalize_compile_config(self.compile_config)
        if self.extra is None:
            self.extra = {}

    def set_fields(self) -> set[str]:
        """Names of the fields that are set (not `None`); `extra` keys are not included.

        Returns:
            `set[str]`: the set field names.
        """
        return {name for name in FIELD_NAMES if getattr(self, name) is not None}

    def copy(self) -> GenerationConfig:
        """A deep copy.

        Returns:
            `GenerationConfig`: an independent copy.
        """
        return copy.deepcopy(self)

    def update(self, **kwargs: Any) -> dict[str, Any]:
        """Set the fields named in `kwargs` (as transformers' `GenerationConfig.update`).

        Setting a field to `None` unsets it. Nothing is validated: call `validate()`.

        Args:
            kwargs (`dict[str, Any]`):
                Field values to set.

        Returns:
            `dict[str, Any]`: the kwargs that do not name a field, untouched.
        """
        unused = {}
        for key, value in kwargs.items():
            if key in _FIELD_SET:
                setattr(self, key, value)
            else:
                unused[key] = value
        self._normalize()
        return unused

    def with_defaults(self) -> GenerationConfig:
        """A copy with transformers' global defaults (`DEFAULT_GENERATION_PARAMS`) filled in where unset.

        Returns:
            `GenerationConfig`: the completed copy.
        """
        out = self.copy()
        for key, value in DEFAULT_GENERATION_PARAMS.items():
            if getattr(out, key) is None:
                setattr(out, key, copy.deepcopy(value))
        return out

    # ----------------------------------------------------------------------------------------------------
    # Conversions

    def to_dict(self) -> dict[str, Any]:
        """The set fields and the custom entries, in `generation_config.json` form.

        This is what transformers' `to_json_string(use_diff=True)` writes for the same config, without
        `transformers_version` (and with `seed` when set).

        Returns:
            `dict[str, Any]`: a new dict; nested values are copies.
        """
        out = {key: copy.deepcopy(value) for key, value in self.extra.items() if key not in _FIELD_SET}
        for name in FIELD_NAMES:
            value = getattr(self, name)
            if value is not None:
                out[name] = copy.deepcopy(value)
        for key, normalize in (
            ("sequence_bias", _normalize_sequence_bias),
            ("watermarking_config", _normalize_watermarking),
            ("compile_config", _normalize_compile_config),
        ):
            if key in out:
                out[key] = normalize(out[key])
        return out

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any]) -> GenerationConfig:
        """Build a config from a dict such as a parsed `generation_config.json`.

        Metadata keys (`transformers_version`, `_from_model_config`, `_commit_hash`) are dropped. As in
        transformers, custom entries are dropped too when `_from_model_config` is true (the file was derived
        from a model config, whose other keys are not generation parameters).

        Args:
            config_dict (`Mapping[str, Any]`):
                Field values; `None` means unset.

        Returns:
            `GenerationConfig`: the config.
        """
        from_model_config = bool(config_dict.get("_from_model_config"))
        fields_: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in config_dict.items():
            if key in _METADATA_KEYS:
                continue
            if key in _FIELD_SET:
                fields_[key] = copy.deepcopy(value)
            elif not from_model_config:
                extra[key] = copy.deepcopy(value)
        return cls(**fields_, extra=extra)

    def to_json_string(self) -> str:
        """`to_dict()` as JSON, formatted like transformers' `generation_config.json` files.

        Returns:
            `str`: sorted keys, 2-space indent, trailing newline.
        """
        return json.dumps(_json_safe(self.to_dict()), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json_string(cls, json_string: str) -> GenerationConfig:
        """Parse `to_json_string()` output or a `generation_config.json` file's content.

        Args:
            json_string (`str`):
                A JSON object.

        Returns:
            `GenerationConfig`: the config.
        """
        data = json.loads(json_string)
        if not isinstance(data, dict):
            raise ValueError(f"A generation config must be a JSON object, got {type(data).__name__}.")
        return cls.from_dict(data)

    @classmethod
    def from_transformers(cls, config: Any) -> GenerationConfig:
        """Convert a `transformers.GenerationConfig`, keeping only what its user or model set.

        In transformers v5 an unset attribute is `None`; attributes equal to those of a fresh
        `transformers.GenerationConfig()` count as unset. Watermarking and compile configs become their
        `to_dict()`.

        Args:
            config (`transformers.GenerationConfig`):
                The config to convert.

        Returns:
            `GenerationConfig`: the config.
        """
        import transformers

        defaults = transformers.GenerationConfig().to_dict()
        data: dict[str, Any] = {}
        for key, value in config.to_dict().items():
            if key.startswith("_") or key in _METADATA_KEYS:
                continue
            if key in defaults and value == defaults[key]:
                continue
            if dataclasses.is_dataclass(value) and hasattr(value, "to_dict"):
                value = value.to_dict()
            data[key] = value
        return cls.from_dict(data)

    def to_transformers(self) -> Any:
        """Build the equivalent `transformers.GenerationConfig` (`seed` is dropped: transformers has no such
        field).

        Raises:
            ValueError: when transformers refuses the config (see `validate()`).

        Returns:
            `transformers.GenerationConfig`: the config; nested dicts become transformers' config objects.
        """
        import transformers

        kwargs = self.to_dict()
        kwargs.pop("seed", None)
        wm = kwargs.get("watermarking_config")
        if isinstance(wm, dict):
            if _watermark_kind(wm) == "synthid":
                kwargs["watermarking_config"] = transformers.SynthIDTextWatermarkingConfig(**wm)
            else:
                kwargs["watermarking_config"] = transformers.WatermarkingConfig(**wm)
        if isinstance(kwargs.get("compile_config"), dict):
            kwargs["compile_config"] = transformers.CompileConfig(**kwargs["compile_config"])
        return transformers.GenerationConfig(**kwargs)

    # ----------------------------------------------------------------------------------------------------
    # Mode and validation

    def get_generation_mode(self) -> GenerationMode:
        """The decoding mode these flags select, with transformers 5.23's rules (`get_generation_mode`).

        `prompt_lookup_num_tokens`, `assistant_early_exit` or `use_mtp` turn greedy search and sampling into
        assisted generation; `dola_layers` turns them into DoLa. Values of unsupported types count as unset.

        Returns:
            `GenerationMode`: the mode.
        """
        return _generation_mode(self, assisted_triggers=True)

    def validate(self, strict: bool = False) -> list[Violation]:
        """Check the config the way transformers does, without raising, logging or modifying anything.

        Errors are exactly what transformers refuses from the config alone:
        `transformers.GenerationConfig(**cfg)` raising, or `generate()` raising while it resolves the mode,
        special tokens and lengths, builds the logits processors and stopping criteria, and runs the first
        decoding step. Unset fields take `DEFAULT_GENERATION_PARAMS`; an unset `eos_token_id` is assumed to
        come from the model (checks that need its value are skipped). Prompt-dependent failures (prompt length
        >= `max_length`), the environment (cache backends, devices) and model capabilities (MTP heads,
        vocabulary size) are not checked. Modes removed in v5 are not errors (warnings on the fields that
        select them); the rest of such a config is checked as transformers would run it without them. A
        watermarking dict with SynthID keys is checked as a `SynthIDTextWatermarkingConfig` (transformers
        reads every watermarking dict as a `WatermarkingConfig`, so it cannot load SynthID configs from JSON).

        Args:
            strict (`bool`, *optional*, defaults to `False`):
                Report warnings as errors (transformers' `validate(strict=True)` does so for its minor
                issues).

        Returns:
            `list[Violation]`: errors and warnings, in transformers' checking order; empty when all is well.
        """
        checker = _Checker(self)
        try:
            checker.run()
        except Exception as exc:  # noqa: BLE001 -- validate() must never raise; a bug here must not crash callers
            checker.error(
                "<config>", None, f"The config could not be validated ({type(exc).__name__}: {exc})."
            )
        found = checker.violations
        if strict:
            found = [dataclasses.replace(v, severity="error") for v in found]
        return found


FIELD_NAMES: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(GenerationConfig) if f.name != "extra"
)
_FIELD_SET = frozenset(FIELD_NAMES)


def field_suggestion(key: str) -> str:
    """"did you mean `temperature`?" for a key close to a GenerationConfig field, else ""."""
    close = difflib.get_close_matches(key, FIELD_NAMES, n=1, cutoff=0.75)
    return f"did you mean `{close[0]}`?" if close else ""


def unknown_keys(config: GenerationConfig) -> list[Violation]:
    """A warning per `extra` key: transformers keeps unknown keys as custom entries, and uses none of them.

    A misspelled field (`temprature`) lands here and would otherwise change nothing without a word; a
    registry that stores custom entries on purpose says so (`allow_custom`).
    """
    found = []
    for key, value in sorted(config.extra.items()):
        hint = field_suggestion(key)
        found.append(
            Violation(
                key,
                value,
                f"not a GenerationConfig field{'; ' + hint if hint else ''}: generation ignores it (transformers "
                "keeps it as a custom entry); fix the name, or store it on purpose with allow_custom",
                "warning",
            )
        )
    return found


def merge(*layers: GenerationConfig | None) -> GenerationConfig:
    """Combine configs, highest priority first: for each field, the first layer that sets it wins.

    `merge(overrides, request_config, model_config)` gives the effective config before global defaults (which
    `with_defaults()` applies). Custom entries in `extra` are merged the same way, key by key.

    Args:
        layers (`GenerationConfig | None`):
            Configs in priority order; `None` layers are skipped.

    Returns:
        `GenerationConfig`: a new config; the layers are not modified.
    """
    merged: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for layer in layers:
        if layer is None:
            continue
        for name in FIELD_NAMES:
            value = getattr(layer, name)
            if value is not None and name not in merged:
                merged[name] = copy.deepcopy(value)
        for key, value in layer.extra.items():
            if key not in extra:
                extra[key] = copy.deepcopy(value)
    return GenerationConfig(**merged, extra=extra)


# ----------------------------------------------------------------------------------------------------
# Normalization helpers


def _normalize_sequence_bias(value: Any) -> Any:
    # transformers' legacy dict form `{(ids...): bias}` becomes its list form `[[ids], bias]`, which survives
    # JSON (transformers writes tuple keys as "(1, 2)" strings that it cannot read back). Only dicts whose
    # keys are non-empty tuples convert: the two forms then accept exactly the same values.
    if isinstance(value, dict) and value and all(isinstance(k, tuple) and len(k) > 0 for k in value):
        return [[list(k), v] for k, v in value.items()]
    return value


def _watermark_kind(config: Mapping[str, Any]) -> str:
    # A SynthID config is recognised by its own keys; everything else is read as a WatermarkingConfig.
    return "synthid" if any(key in _SYNTHID_KEYS for key in config) else "watermark"


def is_synthid_watermark(value: Any) -> bool:
    """Whether a `watermarking_config` value is a SynthID text watermark (it has `ngram_len`/`keys`).

    specwire validates SynthID configs as transformers does but does not run the SynthID processor, so
    `generate()` refuses them with UNIMPLEMENTED before any decoding work.
    """
    return isinstance(value, Mapping) and _watermark_kind(value) == "synthid"


def _normalize_watermarking(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if _watermark_kind(value) == "synthid":
        if set(value) <= _SYNTHID_KEYS and all(k in value for k in _SYNTHID_REQUIRED):
            return {**_SYNTHID_DEFAULTS, **value}
        return value
    if set(value) <= set(_WATERMARK_DEFAULTS):
        return {**_WATERMARK_DEFAULTS, **value}
    return value


def _normalize_compile_config(value: Any) -> Any:
    if isinstance(value, dict) and set(value) <= set(_COMPILE_DEFAULTS):
        return {**_COMPILE_DEFAULTS, **value}
    return value


def _json_safe(obj: Any) -> Any:
    # Same conversion as transformers' to_json_string: dict keys become strings, tuples become lists.
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------------
# Python-level mirrors of what transformers does with values (no torch import)

_FAIL = object()


def _safe(fn: Callable[[], Any]) -> Any:
    """`fn()`, or `_FAIL` when transformers' identical expression would raise (e.g. str < float)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 -- any exception means transformers would raise too
        return _FAIL


def _is_int(value: Any) -> bool:
    # transformers' `isinstance(x, int)` checks accept bools, so do we.
    return isinstance(value, int)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


def _tensor_scalars(value: Any, *, as_long: bool = False) -> list[Any] | None:
    """The scalars of `torch.tensor(value)` in order, or `None` when torch would refuse `value`.

    torch accepts bools, ints (within int64), floats and rectangular nested lists/tuples of them; with
    `dtype=torch.long` (`as_long`), floats must also fit in int64 (no nan or inf).
    """

    def shape_of(v: Any, out: list[Any]) -> tuple[int, ...] | None:
        if isinstance(v, float) and as_long and not (math.isfinite(v) and _INT64_MIN <= v <= _INT64_MAX):
            return None
        if isinstance(v, bool) or isinstance(v, float):
            out.append(v)
            return ()
        if isinstance(v, int):
            if not _INT64_MIN <= v <= _INT64_MAX:
                return None
            out.append(v)
            return ()
        if isinstance(v, (list, tuple)):
            shapes = set()
            for item in v:
                s = shape_of(item, out)
                if s is None:
                    return None
                shapes.add(s)
            if len(shapes) > 1:
                return None
            return (len(v), *(shapes.pop() if shapes else ()))
        return None

    scalars: list[Any] = []
    return scalars if shape_of(value, scalars) is not None else None


def _tensor_dtype(scalars: list[Any]) -> str:
    # torch's inferred dtype: float if any float (and for an empty list), bool if all bools, else int64.
    if not scalars or any(isinstance(s, float) for s in scalars):
        return "float"
    if all(isinstance(s, bool) for s in scalars):
        return "bool"
    return "int"


def _as_list(value: Any) -> list[Any] | None:
    """`list(value)` for the containers transformers passes through `list()` / `set()`; `None` otherwise."""
    if isinstance(value, (list, tuple, set, frozenset, dict, str)):
        return list(value)
    return None


def _eos_ids(eos: Any) -> list[Any] | None:
    """The eos ids as transformers holds them after `torch.tensor(eos, dtype=long)` (1-D for a scalar)."""
    scalars = _tensor_scalars(eos, as_long=True)
    if scalars is None:
        return None

    def to_long(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [to_long(x) for x in v]
        return int(v)

    if isinstance(eos, (list, tuple)):
        return [to_long(v) for v in eos]
    return [to_long(eos)]


def _generation_mode(cfg: Any, *, assisted_triggers: bool) -> GenerationMode:
    """transformers 5.23 `GenerationConfig.get_generation_mode()` on any object with the config's fields."""

    def gt(value: Any, bound: Any) -> bool:
        result = _safe(lambda: bool(value > bound))
        return result is True

    if cfg.constraints is not None or cfg.force_words_ids is not None:
        mode = GenerationMode.CONSTRAINED_BEAM_SEARCH
    elif cfg.num_beams is None or cfg.num_beams == 1:
        if cfg.do_sample is not True:
            if (
                cfg.top_k is not None
                and gt(cfg.top_k, 1)
                and cfg.penalty_alpha is not None
                and gt(cfg.penalty_alpha, 0)
            ):
                mode = GenerationMode.CONTRASTIVE_SEARCH
            else:
                mode = GenerationMode.GREEDY_SEARCH
        else:
            mode = GenerationMode.SAMPLE
    elif cfg.num_beam_groups is not None and gt(cfg.num_beam_groups, 1):
        mode = GenerationMode.GROUP_BEAM_SEARCH
    elif cfg.do_sample is True:
        mode = GenerationMode.BEAM_SAMPLE
    else:
        mode = GenerationMode.BEAM_SEARCH
    if assisted_triggers and _assisted_requested(cfg):
        if mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            mode = GenerationMode.ASSISTED_GENERATION
    if cfg.dola_layers is not None and mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        mode = GenerationMode.DOLA_GENERATION
    return mode


def _assisted_requested(cfg: Any) -> bool:
    return (
        bool(cfg.use_mtp) or cfg.prompt_lookup_num_tokens is not None or cfg.assistant_early_exit is not None
    )


# ----------------------------------------------------------------------------------------------------
# Validation


class _Effective:
    """Attribute view of a config as `generate()` sees it: unset fields take the global defaults, and the
    fields that select modes removed in v5 are dropped (transformers would refuse those modes before anything
    else;
    specwire answers UNIMPLEMENTED, so the remaining flags are checked as if they were absent)."""

    _DROPPED = ("constraints", "force_words_ids", "penalty_alpha", "dola_layers", "num_beam_groups")

    def __init__(self, config: GenerationConfig):
        for name in FIELD_NAMES:
            value = getattr(config, name)
            if value is None:
                value = DEFAULT_GENERATION_PARAMS.get(name)
            setattr(self, name, value)
        for name in self._DROPPED:
            setattr(self, name, None)
        # transformers unsets this deprecated default when it reaches generate() (_prepare_generation_config).
        if self.cache_implementation == "hybrid":
            self.cache_implementation = None


class _Checker:
    """Runs transformers' checks in its order, collecting violations (at most one error per field)."""

    def __init__(self, config: GenerationConfig):
        self.cfg = config
        self.violations: list[Violation] = []
        self._error_fields: set[str] = set()

    # -- recording
    # ------------------------------------------------------------------------------------------------

    def error(self, name: str, value: Any, message: str) -> None:
        if name in self._error_fields:
            return
        self._error_fields.add(name)
        self.violations.append(Violation(name, value, message, "error"))

    def warn(self, name: str, value: Any, message: str) -> None:
        self.violations.append(Violation(name, value, message, "warning"))

    def run(self) -> None:
        self.check_constructor()
        self.check_generate()

    # -- transformers.GenerationConfig(**kwargs): configuration_utils.py validate()
    # -------------------------------

    def check_constructor(self) -> None:
        c = self.cfg
        if _safe(lambda: c.early_stopping in {None, True, False, "never"}) is not True:
            self.error(
                "early_stopping",
                c.early_stopping,
                f"`early_stopping` (={c.early_stopping!r}) must be a boolean or 'never'. Use True, False or "
                "'never'.",
            )
        if c.max_new_tokens is not None:
            bad = _safe(lambda: bool(c.max_new_tokens <= 0))
            if bad is not False:
                self.error(
                    "max_new_tokens",
                    c.max_new_tokens,
                    f"`max_new_tokens` (={c.max_new_tokens!r}) must be greater than 0. Set a positive "
                    "integer, or "
                    "unset it to use `max_length`.",
                )
        if c.assistant_ensemble_weight is not None:
            if _safe(lambda: bool(0.0 < c.assistant_ensemble_weight < 1.0)) is not True:
                self.error(
                    "assistant_ensemble_weight",
                    c.assistant_ensemble_weight,
                    f"`assistant_ensemble_weight` (={c.assistant_ensemble_weight!r}) must be in the open "
                    "interval "
                    "(0.0, 1.0). Unset it for standard (lossless) speculative decoding.",
                )
        if c.pad_token_id is not None:
            negative = _safe(lambda: bool(c.pad_token_id < 0))
            if negative is _FAIL:
                self.error(
                    "pad_token_id",
                    c.pad_token_id,
                    f"`pad_token_id` (={c.pad_token_id!r}) must be a non-negative integer token id.",
                )
            elif negative:
                self.warn(
                    "pad_token_id",
                    c.pad_token_id,
                    f"`pad_token_id` should be positive but got {c.pad_token_id}. This will cause errors "
                    "when "
                    "batch "
                    "generating with padding. Set `pad_token_id` to the id of the tokenizer's pad token.",
                )
        if (
            c.cache_implementation is not None
            and _safe(lambda: c.cache_implementation in _VALID_CACHE_IMPLEMENTATIONS) is not True
        ):
            self.error(
                "cache_implementation",
                c.cache_implementation,
                f"Invalid `cache_implementation` (={c.cache_implementation!r}). Choose one of: "
                f"{_VALID_CACHE_IMPLEMENTATIONS}.",
            )
        if (
            c.max_cache_len is not None
            and _safe(lambda: c.cache_implementation in _ALL_STATIC_CACHE_IMPLEMENTATIONS) is not True
        ):
            self.warn(
                "max_cache_len",
                c.max_cache_len,
                f"`max_cache_len` is only used with static caches {_STATIC_CACHE_IMPLEMENTATIONS}; it will "
                "be "
                f"ignored with `cache_implementation={c.cache_implementation!r}`. Set a static "
                "`cache_implementation` or unset `max_cache_len`.",
            )
        if c.compile_config is not None:
            cc = c.compile_config
            if not isinstance(cc, dict) or not set(cc) <= set(_COMPILE_DEFAULTS):
                self.error(
                    "compile_config",
                    cc,
                    f"`compile_config` (={cc!r}) must be a dict of `CompileConfig` arguments "
                    f"({sorted(_COMPILE_DEFAULTS)}).",
                )
        if c.watermarking_config is not None:
            self.check_watermarking_config_validate(c.watermarking_config)

        if c.do_sample is not True:
            greedy_msg = (
                "`do_sample` is not set to `True`. However, `{name}` is set to `{value}` -- this flag is "
                "only "
                "used "
                "in sample-based generation modes. You should set `do_sample=True` or unset `{name}`."
            )
            for name, neutral in (
                ("temperature", 1.0),
                ("top_p", 1.0),
                ("min_p", _FAIL),
                ("top_h", _FAIL),
                ("typical_p", 1.0),
                ("top_k", 50),
                ("epsilon_cutoff", 0.0),
                ("eta_cutoff", 0.0),
            ):
                value = getattr(c, name)
                if value is not None and (
                    neutral is _FAIL or _safe(lambda v=value, n=neutral: v != n) is not False
                ):
                    self.warn(name, value, greedy_msg.format(name=name, value=value))
        if c.num_beams is None or c.num_beams == 1:
            beam_msg = (
                "`num_beams` is set to {beams}. However, `{name}` is set to `{value}` -- this flag is only "
                "used in "
                "beam-based generation modes. You should set `num_beams>1` or unset `{name}`."
            )
            if c.early_stopping is not None and c.early_stopping is not False:
                self.warn(
                    "early_stopping",
                    c.early_stopping,
                    beam_msg.format(beams=c.num_beams, name="early_stopping", value=c.early_stopping),
                )
            if c.length_penalty is not None and _safe(lambda: c.length_penalty != 1.0) is not False:
                self.warn(
                    "length_penalty",
                    c.length_penalty,
                    beam_msg.format(beams=c.num_beams, name="length_penalty", value=c.length_penalty),
                )
        if c.num_return_sequences is not None:
            nrs = c.num_return_sequences
            several = _safe(lambda: bool(nrs > 1))
            if several is _FAIL:
                self.error(
                    "num_return_sequences",
                    nrs,
                    f"`num_return_sequences` (={nrs!r}) must be a positive integer.",
                )
            elif several:
                if c.num_beams is None or c.num_beams == 1:
                    if not c.do_sample:
                        self.error(
                            "num_return_sequences",
                            nrs,
                            "Greedy methods (do_sample != True) without beam search do not support "
                            f"`num_return_sequences` different than 1 (got {nrs}). Set `do_sample=True`, or "
                            "`num_beams` >= `num_return_sequences`.",
                        )
                else:
                    more = _safe(lambda: bool(nrs > c.num_beams))
                    if more is not False:
                        self.error(
                            "num_return_sequences",
                            nrs,
                            f"`num_return_sequences` ({nrs}) has to be smaller or equal to `num_beams` "
                            f"({c.num_beams}). Raise `num_beams` or lower `num_return_sequences`.",
                        )
        if c.use_cache is False:
            for name in ("cache_implementation", "cache_config"):
                value = getattr(c, name)
                if value is not None:
                    self.warn(
                        name,
                        value,
                        f"You have not set `use_cache` to `True`, but {name} is set to {value}. {name} will "
                        "have no "
                        "effect. Set `use_cache=True` or unset it.",
                    )
        if c.return_dict_in_generate is not True:
            for name in _OUTPUT_FLAGS:
                if getattr(c, name) is True:
                    self.warn(
                        name,
                        True,
                        f"`return_dict_in_generate` is NOT set to `True`, but `{name}` is. When "
                        f"`return_dict_in_generate` is not `True`, `{name}` is ignored. Set "
                        "`return_dict_in_generate=True` to get these outputs.",
                    )
        if c.suppress_tokens is not None:
            suppressed = _safe(lambda: set(c.suppress_tokens))
            if suppressed is _FAIL:
                self.error(
                    "suppress_tokens",
                    c.suppress_tokens,
                    f"`suppress_tokens` (={c.suppress_tokens!r}) must be a list of token ids.",
                )
            else:
                for name in ("forced_bos_token_id", "forced_eos_token_id"):
                    forced = getattr(c, name)
                    if forced is None:
                        continue
                    tokens = {forced} if _is_int(forced) else _safe(lambda f=forced: set(f))
                    if tokens is _FAIL:
                        self.error(
                            name, forced, f"`{name}` (={forced!r}) must be a token id or a list of ids."
                        )
                    elif tokens and tokens <= suppressed:
                        self.error(
                            name,
                            forced,
                            f"Every token in `{name}` ({sorted(tokens, key=repr)}) is also in "
                            "`suppress_tokens`. "
                            "Forcing a token while suppressing it sets all logits to `-inf` at the forcing "
                            "step. "
                            f"Remove the overlapping token(s) from either `{name}` or `suppress_tokens` (to "
                            "prevent "
                            "an early EOS token, use `min_new_tokens` instead).",
                        )
        for name in _GENERATE_ARGUMENTS:
            if name in c.extra:
                self.error(
                    name,
                    c.extra[name],
                    f"`{name}` is not a valid argument of `GenerationConfig`. It is an argument of "
                    "`generate()`; "
                    "remove it from the config.",
                )
        self.check_deprecated()

    def check_watermarking_config_validate(self, wm: Any) -> None:
        name = "watermarking_config"
        if not isinstance(wm, dict):
            self.error(
                name, wm, f"`watermarking_config` (={wm!r}) must be a dict (WatermarkingConfig fields)."
            )
            return
        if _watermark_kind(wm) == "synthid":
            unknown = sorted(set(wm) - _SYNTHID_KEYS)
            missing = [k for k in _SYNTHID_REQUIRED if k not in wm]
            if unknown or missing:
                self.error(
                    name,
                    wm,
                    "`watermarking_config` looks like a SynthIDTextWatermarkingConfig but has unknown keys "
                    f"{unknown} "
                    f"or lacks required keys {missing}. Allowed keys: {sorted(_SYNTHID_KEYS)}.",
                )
                return
            if _safe(lambda: bool(wm.get("sampling_table_size", 2**16) > 2**24)) is not False:
                self.error(
                    name,
                    wm,
                    "`watermarking_config.sampling_table_size` must be an integer < 2**24, but is "
                    f"{wm.get('sampling_table_size')!r}.",
                )
            return
        unknown = sorted(set(wm) - set(_WATERMARK_DEFAULTS))
        if unknown:
            self.error(
                name,
                wm,
                f"`watermarking_config` has unknown keys {unknown}. WatermarkingConfig accepts "
                f"{sorted(_WATERMARK_DEFAULTS)}; SynthID configs need `ngram_len` and `keys`.",
            )
            return
        full = {**_WATERMARK_DEFAULTS, **wm}
        if _safe(lambda: full["seeding_scheme"] in ["selfhash", "lefthash"]) is not True:
            self.error(
                name,
                wm,
                f"`watermarking_config.seeding_scheme` must be 'selfhash' or 'lefthash', but is "
                f"{full['seeding_scheme']!r}.",
            )
        elif _safe(lambda: bool(0.0 <= full["greenlist_ratio"] <= 1.0)) is not True:
            self.error(
                name,
                wm,
                "`watermarking_config.greenlist_ratio` must be in range between 0.0 and 1.0, but is "
                f"{full['greenlist_ratio']!r}.",
            )
        elif _safe(lambda: bool(full["context_width"] >= 1)) is not True:
            self.error(
                name,
                wm,
                "`watermarking_config.context_width` must be a positive integer, but is "
                f"{full['context_width']!r}.",
            )

    def check_deprecated(self) -> None:
        c = self.cfg
        mode = _generation_mode(c, assisted_triggers=True)
        for name in DEPRECATED_FIELDS:
            value = getattr(c, name)
            if value is None:
                continue
            if name == "continuous_batching_config":
                message = (
                    "`continuous_batching_config` in a generation config is deprecated since transformers "
                    "5.13 and "
                    "ignored by `generate()`. Remove it."
                )
            elif mode in REMOVED_MODES and name in _MODE_TRIGGERS.get(mode, ()):
                message = (
                    f"`{name}` (={value!r}) selects `{mode.value}`, a decoding mode transformers v5 moved to "
                    "a Hub "
                    "`custom_generate` repository; specwire does not run it. Unset it."
                )
            else:
                message = (
                    f"`{name}` (={value!r}) belongs to a decoding mode transformers v5 removed; it has no "
                    "effect "
                    "here"
                    + (" and beam search refuses `low_memory=True`" if name == "low_memory" else "")
                    + ". Unset it."
                )
            self.warn(name, value, message)

    # -- generate(): utils.py, logits_process.py, stopping_criteria.py, first decoding step
    # -----------------------

    def check_generate(self) -> None:
        c = self.cfg
        e = _Effective(c)
        if (e.num_beams is None or e.num_beams == 1) and e.do_sample is not True and e.top_k is not None:
            # get_generation_mode() compares top_k with 1 (contrastive search test) outside sampling.
            if _safe(lambda: bool(e.top_k > 1)) is _FAIL:
                self.error("top_k", c.top_k, f"`top_k` (={c.top_k!r}) has to be an integer (0 disables it).")
        mode = _generation_mode(e, assisted_triggers=True)

        # get_generation_mode(): assisted triggers with a beam mode are logged and ignored.
        if _assisted_requested(e) and _generation_mode(e, assisted_triggers=False) not in (
            GenerationMode.GREEDY_SEARCH,
            GenerationMode.SAMPLE,
        ):
            for name in ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp"):
                value = getattr(c, name)
                if value is not None and (name != "use_mtp" or value):
                    self.warn(
                        name,
                        value,
                        f"`{name}` triggers assisted generation, which only supports greedy search and "
                        "sampling; "
                        f"with the current flags (mode {_generation_mode(e, assisted_triggers=False).value}) "
                        "it is "
                        "ignored. Set `num_beams=1` or unset it.",
                    )

        # _validate_generation_mode()
        if (
            mode == GenerationMode.ASSISTED_GENERATION
            and _safe(lambda: bool(e.num_return_sequences > 1)) is True
        ):
            self.error(
                "num_return_sequences",
                c.num_return_sequences,
                "`num_return_sequences` has to be 1 when doing assisted generation, but is "
                f"{e.num_return_sequences}. "
                "Unset the assisted-generation flags or return one sequence.",
            )

        # _prepare_special_tokens(): ids become int64 tensors.
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            value = getattr(c, name)
            if value is not None and _tensor_scalars(value, as_long=True) is None:
                self.error(
                    name, value, f"`{name}` (={value!r}) must be an integer token id (or a list of ids)."
                )
        eos = _eos_ids(c.eos_token_id) if c.eos_token_id is not None else None
        if eos is not None and any(v < 0 for v in _flatten(eos)):
            self.warn(
                "eos_token_id",
                c.eos_token_id,
                f"`eos_token_id` should consist of positive integers, but is {c.eos_token_id!r}. Generation "
                "will not "
                "stop until the maximum length is reached, and other flags may make it crash. Use the "
                "tokenizer's "
                "eos token id.",
            )

        # _expand_inputs_for_generation(): rows are repeated max(num_beams, num_return_sequences) times.
        expand = _safe(lambda: max(e.num_beams, e.num_return_sequences))
        if expand is _FAIL or not _is_int(expand) or expand < 0:
            culprit = "num_beams" if expand is _FAIL or expand is e.num_beams else "num_return_sequences"
            self.error(
                culprit,
                getattr(c, culprit),
                f"`{culprit}` (={getattr(e, culprit)!r}) must be a positive integer (inputs are repeated "
                "max(num_beams, num_return_sequences) times).",
            )

        self.check_lengths(e)
        self.check_logits_processors(e, eos)
        self.check_stopping_criteria(e)
        self.check_decoding(e, mode)

    def check_lengths(self, e: _Effective) -> None:
        # _prepare_generated_length() / _validate_generated_length(): lengths are added to and compared with
        # the prompt length. Whether the prompt fits (prompt length >= max_length) is not a config error.
        c = self.cfg
        if e.max_new_tokens is None and c.max_length is not None and not _is_number(c.max_length):
            self.error(
                "max_length",
                c.max_length,
                f"`max_length` (={c.max_length!r}) must be an integer number of tokens.",
            )
        if e.min_new_tokens is not None:
            if not _is_number(e.min_new_tokens):
                self.error(
                    "min_new_tokens",
                    e.min_new_tokens,
                    f"`min_new_tokens` (={e.min_new_tokens!r}) must be a non-negative integer.",
                )
        elif e.min_length is not None and not _is_number(e.min_length):
            self.error(
                "min_length",
                e.min_length,
                f"`min_length` (={e.min_length!r}) must be a non-negative integer.",
            )

    def check_logits_processors(self, e: _Effective, eos: list[Any] | None) -> None:
        # _get_logits_processor(), in its order. Each processor is checked only under the condition that makes
        # transformers build it, with the checks of its __init__ (and of its first call, where config-only).
        if e.sequence_bias is not None:
            problem = _sequence_bias_problem(e.sequence_bias)
            if problem:
                self.error("sequence_bias", e.sequence_bias, problem)
        for name in ("encoder_repetition_penalty", "repetition_penalty"):
            # The encoder penalty applies to decoder-only prompts too (the prompt is the "encoder input").
            value = getattr(e, name)
            if value is not None and _safe(lambda v=value: v != 1.0) is not False:
                if not isinstance(value, float) or not value > 0:
                    self.error(
                        name,
                        value,
                        f"`{name}` (={value!r}) has to be a strictly positive float (1.0 means no penalty). "
                        f"Write it as a float, e.g. {_float_hint(value)}.",
                    )
        for name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size"):
            value = getattr(e, name)
            if value is None:
                continue
            positive = _safe(lambda v=value: bool(v > 0))
            # torch's unfold() refuses a bool n-gram size (the encoder variant never unfolds with it).
            is_bool = isinstance(value, bool) and name == "no_repeat_ngram_size"
            if positive is _FAIL or (positive and (not _is_int(value) or is_bool)):
                self.error(
                    name,
                    value,
                    f"`{name}` (={value!r}) has to be an integer (0 disables it; n > 0 bans repeated "
                    "n-grams).",
                )
        if e.bad_words_ids is not None:
            problem = _bad_words_problem(e.bad_words_ids, eos)
            if problem:
                self.error("bad_words_ids", e.bad_words_ids, problem)
        if e.min_new_tokens is None and e.min_length is not None and _is_number(e.min_length):
            # MinLengthLogitsProcessor, built when min_length > 0 (min_new_tokens replaces min_length
            # otherwise).
            if e.min_length > 0 and not _is_int(e.min_length):
                self.error(
                    "min_length",
                    e.min_length,
                    f"`min_length` has to be a non-negative integer, but is {e.min_length!r}.",
                )
        if e.min_new_tokens is not None and _is_number(e.min_new_tokens) and not _is_int(e.min_new_tokens):
            # min_length becomes min_new_tokens + prompt length: a float fails for any prompt longer than
            # -min_new_tokens, so a float is refused whatever its value.
            self.error(
                "min_new_tokens",
                e.min_new_tokens,
                f"`min_new_tokens` has to be a non-negative integer, but is {e.min_new_tokens!r}.",
            )
        if e.forced_eos_token_id is not None:
            forced = [e.forced_eos_token_id] if _is_int(e.forced_eos_token_id) else e.forced_eos_token_id
            scalars = _tensor_scalars(forced)
            if scalars is None or _tensor_dtype(scalars) == "float" or any(s < 0 for s in scalars):
                self.error(
                    "forced_eos_token_id",
                    e.forced_eos_token_id,
                    "`forced_eos_token_id` has to be a non-negative integer token id or a non-empty list of "
                    "them, "
                    f"but is {e.forced_eos_token_id!r}.",
                )
        if e.exponential_decay_length_penalty is not None:
            value = e.exponential_decay_length_penalty
            start = _safe(lambda: value[0] + 0)
            factor = _safe(lambda: value[1])
            if start is _FAIL or factor is _FAIL or not isinstance(start, (int, float)):
                self.error(
                    "exponential_decay_length_penalty",
                    value,
                    f"`exponential_decay_length_penalty` (={value!r}) must be a pair (start_index: int, "
                    "decay_factor: float).",
                )
            elif eos is not None and any(v < 0 for v in _flatten(eos)):
                self.error(
                    "eos_token_id",
                    self.cfg.eos_token_id,
                    "`exponential_decay_length_penalty` needs non-negative `eos_token_id` values, but "
                    f"`eos_token_id` is {self.cfg.eos_token_id!r}. Use the tokenizer's eos token id.",
                )
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            value = getattr(e, name)
            if value is None:
                continue
            items = _as_list(value)
            if items is None or _tensor_scalars(items) is None:
                self.error(name, value, f"`{name}` (={value!r}) must be a list of integer token ids.")
        if e.do_sample:
            self.check_warpers(e)
        if e.watermarking_config is not None and "watermarking_config" not in self._error_fields:
            self.check_watermark_processor(e.watermarking_config)

    def check_warpers(self, e: _Effective) -> None:
        # Warpers are built only when sampling (`if generation_config.do_sample:`, a truthiness test).
        if _safe(lambda: bool(e.num_beams is not None and e.num_beams > 1)) is _FAIL:
            self.error(
                "num_beams", e.num_beams, f"`num_beams` (={e.num_beams!r}) must be a positive integer."
            )
        if e.temperature is not None and _safe(lambda: e.temperature != 1.0) is not False:
            t = e.temperature
            if not isinstance(t, float) or not t > 0:
                hint = (
                    " If you're looking for greedy decoding strategies, set `do_sample=False`."
                    if t == 0
                    else ""
                )
                self.error(
                    "temperature",
                    t,
                    f"`temperature` (={t!r}) has to be a strictly positive float, otherwise your next token "
                    "scores "
                    f"will be invalid. Write it as a float, e.g. {_float_hint(t)}.{hint}",
                )
        if e.top_h is not None and _safe(lambda: bool(0 < e.top_h <= 1)) is not True:
            self.error("top_h", e.top_h, f"`top_h` (={e.top_h!r}) must be in the range (0, 1].")
        if e.top_k is not None and _safe(lambda: e.top_k != 0) is not False:
            # TopKLogitsWarper keeps max(top_k, min_tokens_to_keep) tokens, and torch.topk refuses a bool k
            # (min_tokens_to_keep is 1 without beams).
            beams = _safe(lambda: bool(e.num_beams > 1)) is True
            if not _is_int(e.top_k) or not e.top_k > 0 or (isinstance(e.top_k, bool) and not beams):
                self.error(
                    "top_k",
                    e.top_k,
                    f"`top_k` (={e.top_k!r}) has to be a strictly positive integer (0 disables top-k "
                    "filtering).",
                )
        for name, low_open in (("top_p", False), ("typical_p", True)):
            value = getattr(e, name)
            if value is None:
                continue
            applies = _safe(lambda v=value: bool(v < 1.0))
            as_float = _safe(lambda v=value: float(v))
            if applies is _FAIL or (
                applies and (as_float is _FAIL or as_float < 0 or (low_open and as_float <= 0))
            ):
                bounds = "in (0, 1)" if low_open else "in [0, 1]"
                self.error(
                    name, value, f"`{name}` (={value!r}) has to be a float {bounds} (1.0 disables it)."
                )
        if e.min_p is not None and _safe(lambda: bool(0 <= e.min_p <= 1.0)) is not True:
            self.error("min_p", e.min_p, f"`min_p` (={e.min_p!r}) has to be a float in the [0, 1] interval.")
        for name in ("epsilon_cutoff", "eta_cutoff"):
            # Built only for values strictly inside (0, 1), so other numbers are accepted (and ignored).
            value = getattr(e, name)
            if value is not None and _safe(lambda v=value: bool(0.0 < v < 1.0)) is _FAIL:
                self.error(
                    name, value, f"`{name}` (={value!r}) has to be a float in (0, 1) (0.0 disables it)."
                )

    def check_watermark_processor(self, wm: dict) -> None:
        name = "watermarking_config"
        if _watermark_kind(wm) == "synthid":
            full = {**_SYNTHID_DEFAULTS, **wm}
            keys = _tensor_scalars(full["keys"])
            checks = (
                (
                    _is_int(full["ngram_len"]) and full["ngram_len"] >= 1,
                    "`ngram_len` must be a positive integer",
                ),
                (
                    keys is not None
                    and isinstance(full["keys"], (list, tuple))
                    and len(keys) > 0
                    and _tensor_dtype(keys) == "int",
                    "`keys` must be a non-empty list of integers",
                ),
                (_is_int(full["sampling_table_seed"]), "`sampling_table_seed` must be an integer"),
                (
                    _is_int(full["sampling_table_size"]) and full["sampling_table_size"] >= 1,
                    "`sampling_table_size` must be a positive integer",
                ),
                (
                    _is_int(full["context_history_size"]) and full["context_history_size"] >= 1,
                    "`context_history_size` must be a positive integer",
                ),
            )
        else:
            full = {**_WATERMARK_DEFAULTS, **wm}
            ratio = full["greenlist_ratio"]
            checks = (
                (
                    _safe(lambda: bool(0.0 < ratio < 1.0)) is True,
                    "`greenlist_ratio` has to be in range between 0.0 and 1.0, exclusively",
                ),
                (_is_int(full["hashing_key"]), "`hashing_key` must be an integer"),
                (_is_int(full["context_width"]), "`context_width` must be an integer"),
                (_is_number(full["bias"]), "`bias` must be a number"),
            )
        for ok, message in checks:
            if not ok:
                self.error(name, wm, f"`watermarking_config`: {message}, got {wm!r}.")
                return

    def check_stopping_criteria(self, e: _Effective) -> None:
        # _get_stopping_criteria(), and the criteria's first call.
        if e.max_time is not None and not _is_number(e.max_time):
            self.error("max_time", e.max_time, f"`max_time` (={e.max_time!r}) must be a number of seconds.")
        if e.stop_strings is not None:
            value = e.stop_strings
            items = [value] if isinstance(value, str) else _as_list(value)
            if items is None or not items or not all(isinstance(s, str) for s in items):
                self.error(
                    "stop_strings",
                    value,
                    f"`stop_strings` (={value!r}) must be a string or a non-empty list of strings.",
                )
        if e.is_assistant and e.assistant_confidence_threshold is not None:
            above = _safe(lambda: bool(e.assistant_confidence_threshold > 0))
            if above is _FAIL:
                self.error(
                    "assistant_confidence_threshold",
                    e.assistant_confidence_threshold,
                    f"`assistant_confidence_threshold` (={e.assistant_confidence_threshold!r}) must be a "
                    "float.",
                )
            elif above:
                # ConfidenceCriteria reads the draft's scores, which only exist inside assisted decoding.
                self.error(
                    "is_assistant",
                    e.is_assistant,
                    "`is_assistant=True` marks the config of a draft model inside assisted generation; with "
                    "`assistant_confidence_threshold` > 0 a stand-alone generate() fails. Unset "
                    "`is_assistant`.",
                )

    def check_decoding(self, e: _Effective, mode: GenerationMode) -> None:
        # Checks of the decoding methods (_prefill, _beam_search, _assisted_decoding) up to the first step.
        c = self.cfg
        chunked = mode != GenerationMode.ASSISTED_GENERATION or e.assistant_early_exit is not None
        if e.prefill_chunk_size is not None and chunked:
            # Prefill chunking happens in _sample and _beam_search: not in assisted decoding, but in the
            # early-exit draft's own generate().
            if (
                not _is_int(e.prefill_chunk_size)
                or isinstance(e.prefill_chunk_size, bool)
                or e.prefill_chunk_size <= 0
            ):
                self.error(
                    "prefill_chunk_size",
                    c.prefill_chunk_size,
                    f"`prefill_chunk_size` (={c.prefill_chunk_size!r}) must be a positive number of tokens.",
                )
            elif not e.use_cache:
                self.error(
                    "prefill_chunk_size",
                    c.prefill_chunk_size,
                    "Prefill chunking needs the KV cache: set `use_cache=True` or unset prefill_chunk_size.",
                )
        if mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE):
            # Beam search allocates [batch, beams, max_length] buffers, so the final length must be an int.
            if (
                e.max_new_tokens is not None
                and _is_number(e.max_new_tokens)
                and not _is_int(e.max_new_tokens)
            ):
                self.error(
                    "max_new_tokens",
                    c.max_new_tokens,
                    f"`max_new_tokens` (={c.max_new_tokens!r}) must be an integer with beam search.",
                )
            elif e.max_new_tokens is None and _is_number(c.max_length) and not _is_int(c.max_length):
                self.error(
                    "max_length",
                    c.max_length,
                    f"`max_length` (={c.max_length!r}) must be an integer with beam search.",
                )
            # Finished beams are padded with `pad_token_id or eos_token_id[0]`.
            eos = _eos_ids(e.eos_token_id) if e.eos_token_id is not None else None
            pad = _eos_ids(e.pad_token_id) if e.pad_token_id is not None else None
            pad_is_zero = pad is not None and len(pad) == 1 and pad[0] == 0
            if eos is not None and pad_is_zero and (not eos or isinstance(eos[0], list)):
                self.error(
                    "eos_token_id",
                    c.eos_token_id,
                    f"`eos_token_id` (={c.eos_token_id!r}) must be a token id or a flat non-empty id list: "
                    "beam search pads finished beams with the first eos id when `pad_token_id` is 0.",
                )
            if _is_int(e.num_beams) and e.num_beams <= 0:
                self.error(
                    "num_beams",
                    e.num_beams,
                    f"`num_beams` (={e.num_beams!r}) must be a positive integer (1 = no beams).",
                )
            if e.low_memory:
                self.error(
                    "low_memory",
                    e.low_memory,
                    "`low_memory=True` is not supported by beam search since transformers v5. Unset it.",
                )
            if not _is_int(e.num_return_sequences) or e.num_return_sequences == 0:
                # Beam search returns its best `num_return_sequences` hypotheses by slicing.
                self.error(
                    "num_return_sequences",
                    c.num_return_sequences,
                    f"`num_return_sequences` (={e.num_return_sequences!r}) must be a positive integer.",
                )
            if e.length_penalty is not None and not _is_number(e.length_penalty):
                self.error(
                    "length_penalty",
                    c.length_penalty,
                    f"`length_penalty` (={e.length_penalty!r}) must be a float: beam scores are divided by "
                    "length ** length_penalty.",
                )
        if mode == GenerationMode.ASSISTED_GENERATION:
            if e.assistant_early_exit is not None:
                self.check_early_exit(e)
            if not e.use_cache:
                self.error(
                    "use_cache",
                    c.use_cache,
                    "Assisted generation (prompt lookup, early exit, MTP) requires `use_cache=True`.",
                )
            elif e.cache_implementation in ("static", "hybrid", "sliding_window"):
                self.error(
                    "cache_implementation",
                    c.cache_implementation,
                    f"Assisted generation does not support static caches (`cache_implementation="
                    f"{e.cache_implementation!r}`). Unset `cache_implementation`.",
                )
            elif e.assistant_early_exit is None and e.prompt_lookup_num_tokens is not None:
                if e.assistant_ensemble_weight is not None:
                    self.error(
                        "assistant_ensemble_weight",
                        c.assistant_ensemble_weight,
                        "`assistant_ensemble_weight` requires candidate logits from an assistant model; it "
                        "is "
                        "not "
                        "supported with prompt lookup decoding. Unset it.",
                    )
                    return
                ngram = e.max_matching_ngram_size or 2
                if _is_number(ngram) and not _is_int(ngram):
                    # The n-gram sizes to try are a range().
                    self.error(
                        "max_matching_ngram_size",
                        c.max_matching_ngram_size,
                        f"`max_matching_ngram_size` (={ngram!r}) must be a positive integer.",
                    )
                for name, value in (
                    ("max_matching_ngram_size", ngram),
                    ("prompt_lookup_num_tokens", e.prompt_lookup_num_tokens),
                ):
                    if _safe(lambda v=value: bool(v <= 0)) is not False:
                        self.error(
                            name, getattr(c, name), f"`{name}` (={value!r}) must be a positive integer."
                        )

    def check_early_exit(self, e: _Effective) -> None:
        # The early-exit draft is the model itself with `num_hidden_layers` set to `assistant_early_exit`,
        # running its own generate() with the same flags but without a tokenizer.
        c = self.cfg
        if not _is_int(e.assistant_early_exit) or e.assistant_early_exit < 0:
            self.error(
                "assistant_early_exit",
                c.assistant_early_exit,
                f"`assistant_early_exit` (={c.assistant_early_exit!r}) must be a non-negative layer count.",
            )
        for name, used in (
            ("stop_strings", e.stop_strings is not None),
            ("token_healing", bool(e.token_healing)),
        ):
            if used:
                self.error(
                    name,
                    getattr(c, name),
                    f"`{name}` cannot be combined with `assistant_early_exit`: the early-exit draft "
                    "generates without a tokenizer. Unset one of them.",
                )


_MODE_TRIGGERS = {
    GenerationMode.CONSTRAINED_BEAM_SEARCH: ("constraints", "force_words_ids"),
    GenerationMode.CONTRASTIVE_SEARCH: ("penalty_alpha",),
    GenerationMode.GROUP_BEAM_SEARCH: ("num_beam_groups",),
    GenerationMode.DOLA_GENERATION: ("dola_layers",),
}


def _flatten(values: Any) -> list[Any]:
    if isinstance(values, (list, tuple)):
        return [x for v in values for x in _flatten(v)]
    return [values]


def _float_hint(value: Any) -> str:
    as_float = _safe(lambda: float(value))
    return f"{as_float!r}" if as_float is not _FAIL and math.isfinite(as_float) and as_float > 0 else "0.7"


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _sequence_bias_problem(bias: Any) -> str | None:
    """Why transformers' SequenceBiasLogitsProcessor refuses `bias`, or None (its `_validate_arguments`)."""
    if not isinstance(bias, (dict, list)) or len(bias) == 0:
        return f"`sequence_bias` has to be a non-empty list of [token_ids, bias] pairs, but is {bias!r}."
    if isinstance(bias, dict):
        if any(not isinstance(key, tuple) for key in bias):
            return f"`sequence_bias` as a dict has to have tuples of token ids as keys, but is {bias!r}."
        if any(len(key) == 0 or not all(_is_token_id(t) for t in key) for key in bias):
            return f"Each key of `sequence_bias` has to be a non-empty tuple of non-negative ids: {bias!r}."
        if any(not isinstance(v, float) for v in bias.values()):
            return f"`sequence_bias` biases have to be floats (1.0, not 1), but are {list(bias.values())!r}."
        return _bool_ids_problem("sequence_bias", [list(key) for key in bias])
    for pair in bias:
        valid = _safe(
            lambda p=pair: (
                isinstance(p[0], list) and all(_is_token_id(t) for t in p[0]) and isinstance(p[1], float)
            )
        )
        if valid is not True:
            return (
                "Each element of `sequence_bias` has to be a pair [list of non-negative token ids, float "
                "bias] "
                f"(e.g. [[12, 7], -2.0]), but got {pair!r}."
            )
    return _bool_ids_problem("sequence_bias", [list(pair[0]) for pair in bias])


def _bool_ids_problem(name: str, sequences: list[list[Any]]) -> str | None:
    """The first-call failure of SequenceBiasLogitsProcessor when the ids it indexes with are all bools.

    Last tokens are gathered per group (single tokens; then sequences by prefix length) into a tensor used as
    an index; a tensor of bools is read as a mask and fails.
    """
    groups: dict[int, list[Any]] = {}
    for seq in {tuple(s): None for s in sequences}:
        if seq:
            groups.setdefault(len(seq), []).append(seq[-1])
    for lasts in groups.values():
        if all(isinstance(t, bool) for t in lasts):
            return f"`{name}` token ids must be integers, not booleans: {sequences!r}."
    return None


def _bad_words_problem(bad_words: Any, eos: list[Any] | None) -> str | None:
    """Why transformers' NoBadWordsLogitsProcessor refuses `bad_words` with these eos ids, or None."""
    if not isinstance(bad_words, list) or len(bad_words) == 0:
        return f"`bad_words_ids` has to be a non-empty list of lists of token ids, but is {bad_words!r}."
    if any(not isinstance(word, list) for word in bad_words):
        return (
            f"`bad_words_ids` has to be a list of lists of ids (e.g. [[12], [7, 9]]), but is {bad_words!r}."
        )
    if any(not all(_is_token_id(t) for t in word) for word in bad_words):
        return (
            f"Each list in `bad_words_ids` has to be a list of non-negative token ids, but is {bad_words!r}."
        )
    # transformers drops single-token sequences equal to an eos id (eos is never banned), keeps empty ones,
    # and fails on its first call when the ids it indexes with are all bools (torch reads them as a mask).
    kept = bad_words if eos is None else [word for word in bad_words if all(word != [i] for i in eos)]
    return _bool_ids_problem("bad_words_ids", kept)
    return None
