"""`GenerationConfig`: transformers' generation parameters as a plain dataclass, with validation.

As in transformers v5, every field defaults to `None` (unset); `merge()` layers configs and
`with_defaults()` applies transformers' global defaults. `validate()` reports, without raising, exactly
what transformers refuses from the config alone, and its "minor issues" as warnings.

The package is pure Python: torch and transformers are imported only inside `from_transformers()` and
`to_transformers()`, so config registries can use it without loading either. Its modules:

- `fields`: the `GenerationConfig` dataclass, the field table (`FIELD_NAMES`, `FIELD_TYPES` read from the
  annotations), `DEFAULT_GENERATION_PARAMS` and `merge()`.
- `serialization`: the canonical stored form of nested values and the pieces of the dict / JSON /
  transformers conversions.
- `modes`: `GenerationMode`, how flags select a mode, and `MODE_FIELDS`, the one table of removed,
  deprecated and unserved options.
- `validation`: the one owner of the rules (`validate`, `check_runnable`, `unknown_keys`) and of how
  violations become an `InvalidArgument` (`raise_for_errors`); it runs the rules of `constructor_rules`
  (`transformers.GenerationConfig(**kwargs)`), `generate_rules` and `processor_rules` (`generate()`).
- `treatment`: `FIELD_TREATMENT`, how every field is treated (honoured, warned about, refused), and
  `not_honoured`, the warnings for fields accepted and not acted on.
- `violations`: `Violation`, the `Recorder` the rules write to, and the `Effective` view they read.
- `value_types`: what transformers and torch do with a value, in plain Python.
"""

from specwire.generation.config.fields import (
    DEFAULT_GENERATION_PARAMS,
    FIELD_NAMES,
    FIELD_TYPES,
    GenerationConfig,
    merge,
)
from specwire.generation.config.modes import (
    DEPRECATED_FIELDS,
    MODE_FIELDS,
    REMOVED_MODE_FIELDS,
    REMOVED_MODES,
    STATIC_CACHES,
    V4_MODE_FIELDS,
    FieldStatus,
    GenerationMode,
    uses_static_cache,
)
from specwire.generation.config.serialization import is_synthid_watermark
from specwire.generation.config.treatment import FIELD_TREATMENT, FieldTreatment, Treatment, not_honoured
from specwire.generation.config.validation import (
    check_runnable,
    field_suggestion,
    raise_for_errors,
    unknown_keys,
    v4_mode_violations,
    validate,
)
from specwire.generation.config.violations import Violation, errors

__all__ = [
    "DEFAULT_GENERATION_PARAMS",
    "DEPRECATED_FIELDS",
    "FIELD_TREATMENT",
    "FIELD_NAMES",
    "FIELD_TYPES",
    "MODE_FIELDS",
    "REMOVED_MODES",
    "REMOVED_MODE_FIELDS",
    "STATIC_CACHES",
    "V4_MODE_FIELDS",
    "FieldStatus",
    "FieldTreatment",
    "GenerationConfig",
    "GenerationMode",
    "Treatment",
    "Violation",
    "check_runnable",
    "errors",
    "field_suggestion",
    "is_synthid_watermark",
    "merge",
    "not_honoured",
    "raise_for_errors",
    "unknown_keys",
    "uses_static_cache",
    "v4_mode_violations",
    "validate",
]
