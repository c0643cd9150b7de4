"""The canonical stored form of a config's nested values, and the pieces of its dict, JSON and transformers
conversions (`GenerationConfig.to_dict`, `from_dict`, `to_json_string`, `to_transformers`, ...).

Pure Python: transformers is imported only inside `transformers_objects()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "COMPILE_ALL_DEVICES",
    "COMPILE_DEFAULTS",
    "COMPILE_KEYS",
    "METADATA_KEYS",
    "SYNTHID_DEFAULTS",
    "SYNTHID_KEYS",
    "SYNTHID_REQUIRED",
    "WATERMARK_DEFAULTS",
    "is_synthid_watermark",
    "json_safe",
    "normalize_nested",
    "transformers_objects",
    "watermark_kind",
]

# Keys of a `generation_config.json` that describe the file, not the generation.
METADATA_KEYS = ("transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash")

# Constructor arguments (and defaults) of transformers' WatermarkingConfig, SynthIDTextWatermarkingConfig and
# CompileConfig: the dict forms stored here are their `to_dict()` outputs.
WATERMARK_DEFAULTS = MappingProxyType(
    {
        "greenlist_ratio": 0.25,
        "bias": 2.0,
        "hashing_key": 15485863,
        "seeding_scheme": "lefthash",
        "context_width": 1,
    }
)
SYNTHID_DEFAULTS = MappingProxyType(
    {
        "context_history_size": 1024,
        "sampling_table_seed": 0,
        "sampling_table_size": 2**16,
        "skip_first_ngram_calls": False,
        "debug_mode": False,
    }
)
SYNTHID_REQUIRED = ("ngram_len", "keys")
SYNTHID_KEYS = frozenset(SYNTHID_DEFAULTS) | frozenset(SYNTHID_REQUIRED)
COMPILE_DEFAULTS = MappingProxyType(
    {"fullgraph": False, "dynamic": None, "backend": "inductor", "mode": "reduce-overhead", "options": None}
)
# transformers' `CompileConfig._compile_all_devices` (compile on the CPU too): an attribute, not a dataclass
# field, so it has no default to complete and `to_dict()` leaves it out; the dict form carries it as a key.
COMPILE_ALL_DEVICES = "_compile_all_devices"
COMPILE_KEYS = frozenset(COMPILE_DEFAULTS) | {COMPILE_ALL_DEVICES}


def normalize_sequence_bias(value: Any) -> Any:
    """transformers' legacy dict form `{(ids...): bias}` as its list form `[[ids], bias]`; other values as given.

    The list form survives JSON (transformers writes tuple keys as "(1, 2)" strings that it cannot read back).
    Only dicts whose keys are non-empty tuples convert: the two forms then accept exactly the same values.
    """
    if isinstance(value, dict) and value and all(isinstance(k, tuple) and len(k) > 0 for k in value):
        return [[list(k), v] for k, v in value.items()]
    return value


def watermark_kind(config: Mapping[str, Any]) -> str:
    """`"synthid"` for a dict with SynthID keys; everything else is read as a WatermarkingConfig."""
    return "synthid" if any(key in SYNTHID_KEYS for key in config) else "watermark"


def is_synthid_watermark(value: Any) -> bool:
    """Whether a `watermarking_config` value is a SynthID text watermark (it has `ngram_len`/`keys`).

    specwire validates SynthID configs as transformers does but does not run the SynthID processor, so
    `generate()` refuses them with UNIMPLEMENTED before any decoding work.
    """
    return isinstance(value, Mapping) and watermark_kind(value) == "synthid"


def normalize_watermarking(value: Any) -> Any:
    """A watermarking dict with only known keys, completed with its class's defaults; others as given."""
    if not isinstance(value, dict):
        return value
    if watermark_kind(value) == "synthid":
        if set(value) <= SYNTHID_KEYS and all(k in value for k in SYNTHID_REQUIRED):
            return {**SYNTHID_DEFAULTS, **value}
        return value
    if set(value) <= set(WATERMARK_DEFAULTS):
        return {**WATERMARK_DEFAULTS, **value}
    return value


def normalize_compile_config(value: Any) -> Any:
    """A compile-config dict with only known keys, completed with `CompileConfig`'s defaults."""
    if isinstance(value, dict) and set(value) <= COMPILE_KEYS:
        return {**COMPILE_DEFAULTS, **value}
    return value


# Nested fields and the function giving their canonical form, so that equality and round trips do not depend
# on which equivalent spelling a caller used. Values that cannot be normalized stay as given for validate().
_NORMALIZERS = (
    ("sequence_bias", normalize_sequence_bias),
    ("watermarking_config", normalize_watermarking),
    ("compile_config", normalize_compile_config),
)


def normalize_nested(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (field name -> value) with the nested fields in canonical form, in place.

    Args:
        values (`dict[str, Any]`):
            Field values; missing keys are skipped.

    Returns:
        `dict[str, Any]`: `values` itself.
    """
    for key, normalize in _NORMALIZERS:
        if key in values:
            values[key] = normalize(values[key])
    return values


def json_safe(obj: Any) -> Any:
    """transformers' `to_json_string` conversion: dict keys become strings, tuples become lists."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def transformers_objects(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`to_dict()` output ready for `transformers.GenerationConfig(**kwargs)`, in place.

    `seed` is dropped (transformers has no such field); watermarking and compile dicts become transformers'
    config objects.

    Args:
        kwargs (`dict[str, Any]`):
            A config's `to_dict()`.

    Returns:
        `dict[str, Any]`: `kwargs` itself.
    """
    import transformers

    kwargs.pop("seed", None)
    wm = kwargs.get("watermarking_config")
    if isinstance(wm, dict):
        if watermark_kind(wm) == "synthid":
            kwargs["watermarking_config"] = transformers.SynthIDTextWatermarkingConfig(**wm)
        else:
            kwargs["watermarking_config"] = transformers.WatermarkingConfig(**wm)
    if isinstance(kwargs.get("compile_config"), dict):
        given = dict(kwargs["compile_config"])
        all_devices = given.pop(COMPILE_ALL_DEVICES, None)
        kwargs["compile_config"] = transformers.CompileConfig(**given)
        if all_devices is not None:
            kwargs["compile_config"]._compile_all_devices = all_devices
    return kwargs
