"""What validation reports (`Violation`), and the two things every rule reads or writes: the `Recorder`
that collects violations and the `Effective` view of the config that `generate()` sees.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from specwire.generation.config.fields import DEFAULT_GENERATION_PARAMS, FIELD_NAMES, GenerationConfig
from specwire.generation.config.modes import MODE_FIELDS, FieldStatus

__all__ = ["Effective", "Recorder", "Violation", "errors"]


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


class Recorder:
    """Collects the violations of one config, at most one error per field (transformers stops at the first).

    Args:
        config (`GenerationConfig`):
            The config as given (unset fields are `None`).
    """

    def __init__(self, config: GenerationConfig):
        self.cfg = config
        self.violations: list[Violation] = []
        self.error_fields: set[str] = set()

    def error(self, name: str, value: Any, message: str) -> None:
        """Record an error on `name`, unless that field already has one."""
        if name in self.error_fields:
            return
        self.error_fields.add(name)
        self.violations.append(Violation(name, value, message, "error"))

    def warn(self, name: str, value: Any, message: str) -> None:
        """Record a warning on `name`."""
        self.violations.append(Violation(name, value, message, "warning"))


# The fields that select modes removed in v5: transformers would refuse those modes before anything else,
# and specwire answers UNIMPLEMENTED, so the remaining flags are checked as if they were absent.
# Those of the modes specwire runs with 4.55.4's semantics too: transformers 5's rules do not know them.
_DROPPED = tuple(row.field for row in MODE_FIELDS if row.status is FieldStatus.REMOVED_MODE or row.mode is not None)


class Effective:
    """Attribute view of a config as `generate()` sees it: unset fields take the global defaults, and the
    fields that select modes removed in v5 are dropped.

    Args:
        config (`GenerationConfig`):
            The config as given.
    """

    cache_implementation: Any  # read below; every other field is set the same way

    def __init__(self, config: GenerationConfig):
        for name in FIELD_NAMES:
            value = getattr(config, name)
            if value is None:
                value = DEFAULT_GENERATION_PARAMS.get(name)
            setattr(self, name, value)
        for name in _DROPPED:
            setattr(self, name, None)
        # transformers unsets this deprecated default when it reaches generate() (_prepare_generation_config).
        if self.cache_implementation == "hybrid":
            self.cache_implementation = None

    def __getattr__(self, name: str) -> Any:  # for type checkers: every field is set in __init__
        raise AttributeError(name)
