"""The errors generation code raises for a bad request, importable by every generation module.

They subclass both the servers' `InvalidArgument` (so the mapping layer answers INVALID_ARGUMENT,
or UNIMPLEMENTED for `UnsupportedModeError`) and `ValueError` (what transformers raises for the
same input, so library callers catch them as they would transformers' errors). They live apart
from the planning and the loops so that processors and stopping criteria, which those import, can
raise them too.
"""

from __future__ import annotations

from typing import Any

from specwire.errors import FieldProblem, InvalidArgument


class InvalidGenerationArgument(InvalidArgument, ValueError):
    """A bad generation argument: `InvalidArgument` for the servers, `ValueError` as transformers raises."""


class UnsupportedModeError(InvalidGenerationArgument):
    """
    A decoding mode or option that transformers 5 removed from `generate()` (or that specwire does not run).

    Args:
        field (`str`):
            The GenerationConfig field that selects the mode.
        message (`str`):
            Why it is refused and what to use instead.
        value (`Any`, *optional*):
            The field's value.
    """

    # A mode we do not run is not the caller's mistake in form: the servers answer UNIMPLEMENTED.
    code = "UNIMPLEMENTED"

    def __init__(self, field: str, message: str, value: Any = None):
        problem = FieldProblem(field, value, message)
        self.field = field
        self.value = problem.value
        super().__init__(f"{field}={problem.value!r}: {message}", [problem])
