"""What transformers and torch do with a config value, in plain Python (no torch import).

The rules compare, index and convert values as transformers does; these helpers answer "would that
expression work, and with what result" from the value's type, so that the rules never evaluate an
expression that could raise. `has_field_type()` reads the field table (`FIELD_TYPES`) built from the
dataclass annotations.
"""

from __future__ import annotations

import math
from typing import Any

from specwire.generation.config.fields import FIELD_TYPES

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def has_field_type(name: str, value: Any) -> bool:
    """Whether `value` has one of the types of field `name`'s annotation (an int is a float, a bool an int).

    Args:
        name (`str`):
            A GenerationConfig field.
        value (`Any`):
            Its value (not `None`).

    Returns:
        `bool`
    """
    return isinstance(value, FIELD_TYPES[name])


def is_int(value: Any) -> bool:
    """transformers' `isinstance(x, int)`: bools count."""
    return isinstance(value, int)


def is_number(value: Any) -> bool:
    """Whether `value` compares with numbers (`<`, `>`) without raising: ints, floats and bools."""
    return isinstance(value, (int, float))


def is_token_id(value: Any) -> bool:
    """A non-negative integer."""
    return is_int(value) and value >= 0


def float_hint(value: Any) -> str:
    """The float spelling of a positive finite number (`2` -> `2.0`), else `0.7`: for "write it as" hints."""
    try:
        as_float = float(value)
    except (TypeError, ValueError, OverflowError):
        return "0.7"
    return f"{as_float!r}" if math.isfinite(as_float) and as_float > 0 else "0.7"


def as_float(value: Any) -> float | None:
    """`float(value)` (strings such as "0.9" included), or `None` where it raises."""
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def as_set(value: Any) -> set[Any] | None:
    """`set(value)`, or `None` where it raises (not iterable, or unhashable items)."""
    try:
        return set(value)
    except TypeError:
        return None


def flatten(values: Any) -> list[Any]:
    """The leaves of nested lists and tuples."""
    if isinstance(values, (list, tuple)):
        return [x for v in values for x in flatten(v)]
    return [values]


def tensor_scalars(value: Any, *, as_long: bool = False) -> list[Any] | None:
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


def tensor_dtype(scalars: list[Any]) -> str:
    """torch's inferred dtype of these scalars: float if any float (and for an empty list), bool if all bools,
    else int64."""
    if not scalars or any(isinstance(s, float) for s in scalars):
        return "float"
    if all(isinstance(s, bool) for s in scalars):
        return "bool"
    return "int"


def as_list(value: Any) -> list[Any] | None:
    """`list(value)` for the containers transformers passes through `list()` / `set()`; `None` otherwise."""
    if isinstance(value, (list, tuple, set, frozenset, dict, str)):
        return list(value)
    return None


def eos_ids(eos: Any) -> list[Any] | None:
    """The eos ids as transformers holds them after `torch.tensor(eos, dtype=long)` (1-D for a scalar)."""
    scalars = tensor_scalars(eos, as_long=True)
    if scalars is None:
        return None

    def to_long(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [to_long(x) for x in v]
        return int(v)

    if isinstance(eos, (list, tuple)):
        return [to_long(v) for v in eos]
    return [to_long(eos)]
