"""`GenerationConfig`: transformers' generation parameters as a plain dataclass, its field table and merging.

The dataclass mirrors `transformers.GenerationConfig` (v5.23) field for field, plus the v4.56 fields that v5
still accepts (`num_beam_groups`, `diversity_penalty`, `force_words_ids`, `constraints`, `penalty_alpha`,
`dola_layers`, `low_memory`) and one extension, `seed`. As in transformers v5, **every field defaults to
`None`, meaning unset**: an unset field takes the model's `generation_config.json` value, then transformers'
global default (`DEFAULT_GENERATION_PARAMS`), and `merge()` keeps that priority order. Keys that are not
fields ("custom entries", which transformers keeps as attributes) live in `extra`.

`FIELD_TYPES` is the type table read from the field annotations; validation uses it to tell a value of
the field's type from one that transformers would trip over.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from specwire.generation.config.modes import GenerationMode, generation_mode
from specwire.generation.config.serialization import (
    COMPILE_ALL_DEVICES,
    METADATA_KEYS,
    json_safe,
    normalize_compile_config,
    normalize_nested,
    normalize_sequence_bias,
    normalize_watermarking,
    transformers_objects,
)

if typing.TYPE_CHECKING:
    from specwire.generation.config.violations import Violation

__all__ = ["DEFAULT_GENERATION_PARAMS", "FIELD_NAMES", "FIELD_TYPES", "GenerationConfig", "merge"]

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
            `CompileConfig` arguments, completed with its defaults; `"_compile_all_devices": True` is
            transformers' `CompileConfig._compile_all_devices` (compile on the CPU too).
        constraints (`list[dict]`, *optional*):
            Constrained beam search constraints as plain data: `{"type": "phrasal", "token_ids": [ids]}` or
            `{"type": "disjunctive", "token_ids": [[ids], ...]}` (run with transformers 4.55.4's semantics).
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
    cache_config: dict[str, Any] | None = None
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
    exponential_decay_length_penalty: tuple[int, float] | list[Any] | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    sequence_bias: list[Any] | dict[Any, Any] | None = None
    token_healing: bool | None = None
    guidance_scale: float | None = None
    watermarking_config: dict[str, Any] | None = None

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
    compile_config: dict[str, Any] | None = None
    disable_compile: bool | None = None
    prefill_chunk_size: int | None = None

    # Deprecated: continuous batching settings (transformers 5.13 moved them out of GenerationConfig)
    continuous_batching_config: dict[str, Any] | None = None

    # Deprecated: v4.56 modes moved to the Hub in v5 (contrastive search, DoLa, group and constrained beam
    # search)
    low_memory: bool | None = None
    penalty_alpha: float | None = None
    dola_layers: str | list[int] | None = None
    diversity_penalty: float | None = None
    num_beam_groups: int | None = None
    constraints: list[dict[str, Any]] | None = None
    force_words_ids: list[Any] | None = None

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
        self.sequence_bias = normalize_sequence_bias(self.sequence_bias)
        self.watermarking_config = normalize_watermarking(self.watermarking_config)
        self.compile_config = normalize_compile_config(self.compile_config)
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
        return normalize_nested(out)

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
            if key in METADATA_KEYS:
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
        return json.dumps(json_safe(self.to_dict()), indent=2, sort_keys=True) + "\n"

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
            if key.startswith("_") or key in METADATA_KEYS:
                continue
            if key in defaults and value == defaults[key]:
                continue
            if dataclasses.is_dataclass(value) and hasattr(value, "to_dict"):
                all_devices = getattr(value, COMPILE_ALL_DEVICES, None) if key == "compile_config" else None
                value = value.to_dict()
                if all_devices is not None:  # an attribute that `CompileConfig.to_dict()` leaves out
                    value[COMPILE_ALL_DEVICES] = all_devices
            data[key] = value
        return cls.from_dict(data)

    def to_transformers(self) -> Any:
        """Build the equivalent `transformers.GenerationConfig` (`seed` is dropped: transformers has no such field).

        Raises:
            ValueError: when transformers refuses the config (see `validate()`).

        Returns:
            `transformers.GenerationConfig`: the config; nested dicts become transformers' config objects.
        """
        import transformers

        kwargs = transformers_objects(self.to_dict())
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
        return generation_mode(self, assisted_triggers=True)

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
        # Imported here: the validation modules import this one (the field table below).
        from specwire.generation.config.validation import validate

        return validate(self, strict=strict)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GenerationConfig) if f.name != "extra")
_FIELD_SET = frozenset(FIELD_NAMES)


def _annotation_types(annotation: Any) -> tuple[type, ...]:
    # `int | list[int] | None` -> (int, list): the runtime classes a value of the field may have.
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    found: list[type] = []
    for member in members:
        if member is type(None):
            continue
        cls = typing.get_origin(member) or member
        # A float field takes ints too: transformers compares and computes with them as numbers.
        found.extend((int, float) if cls is float else (cls,))
    return tuple(dict.fromkeys(found))


# The type table: field name -> the classes its annotation allows (bools count as ints, as in Python and in
# transformers' `isinstance(x, int)` checks). Validation reads it to tell a value of the field's type from
# one that transformers would trip over.
FIELD_TYPES: Mapping[str, tuple[type, ...]] = MappingProxyType(
    {
        name: _annotation_types(hint)
        for name, hint in typing.get_type_hints(GenerationConfig).items()
        if name in _FIELD_SET
    }
)


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
