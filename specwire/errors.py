"""Domain errors shared by every service, with no gRPC import.

Servers raise these; one mapping layer (`specwire.serving`) turns them into gRPC status codes.
Anything else escaping a handler is a bug and becomes INTERNAL.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

# An error travels in the response's trailing metadata (grpc-message and the status details), which
# clients refuse above 8-16 KB ("received metadata size exceeds ..."): an error echoing a request's
# 1000 stop strings would reach the caller as RESOURCE_EXHAUSTED from its own channel instead of the
# error. So messages, echoed values and the number of violations are bounded.
MAX_MESSAGE_CHARS = 1000
MAX_PROBLEM_MESSAGE_CHARS = 300
MAX_VIOLATIONS = 6

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 3, 6, 6, 6
_SHORT.maxset, _SHORT.maxfrozenset, _SHORT.maxdeque, _SHORT.maxarray = 6, 6, 6, 6
_SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 40, 40, 60


class Abbreviated(str):
    """A value too large to echo, replaced by a short repr of it (`repr()` gives that text back)."""

    def __repr__(self) -> str:
        return str(self)


def short_value(value: Any) -> Any:
    """`value` itself when its repr is short, else an `Abbreviated` repr (bounded, also for deep nesting)."""
    if isinstance(value, (bool, int, float, type(None))) and len(_SHORT.repr(value)) <= 40:
        return value
    text = _SHORT.repr(value)
    return Abbreviated(text) if "..." in text or len(text) > 160 else value


def clip(text: str, limit: int) -> str:
    """`text` cut in the middle to at most about `limit` characters (the end says how to fix it)."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]} ... ({len(text) - limit} characters cut) ... {text[len(text) - (limit - head) :]}"


@dataclass(frozen=True)
class FieldProblem:
    """One bad field: where, the value (abbreviated when large), and how to fix it."""

    field: str
    value: Any
    message: str
    severity: str = "error"

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", short_value(self.value))
        object.__setattr__(self, "message", clip(self.message, MAX_PROBLEM_MESSAGE_CHARS))


class SpecwireError(Exception):
    """Base of the errors a caller can cause or must handle. `code` names a gRPC status code."""

    code = "INTERNAL"

    def __init__(self, message: str, violations: list[Any] | tuple[Any, ...] = (), retry_after_s: float | None = None):
        violations = list(violations)
        if len(violations) > MAX_VIOLATIONS:
            message = f"{message} ({len(violations) - MAX_VIOLATIONS} more problems not listed)"
            violations = violations[:MAX_VIOLATIONS]
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.violations = violations
        self.retry_after_s = retry_after_s


class InvalidArgument(SpecwireError):
    code = "INVALID_ARGUMENT"

    @classmethod
    def for_field(cls, field: str, value: Any, message: str) -> InvalidArgument:
        """A single bad field, with the message naming field, value and fix."""
        problem = FieldProblem(field, value, message)
        return cls(f"{field}={problem.value!r}: {message}", [problem])


class NotFound(SpecwireError):
    code = "NOT_FOUND"


class AlreadyExists(SpecwireError):
    code = "ALREADY_EXISTS"


class Aborted(SpecwireError):
    code = "ABORTED"


class FailedPrecondition(SpecwireError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(SpecwireError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(SpecwireError):
    code = "UNAVAILABLE"


class Unimplemented(SpecwireError):
    code = "UNIMPLEMENTED"


class DeadlineExceeded(SpecwireError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(SpecwireError):
    code = "CANCELLED"
