"""Domain errors shared by every service, with no gRPC import.

Servers raise these; one mapping layer (`specwire.serving`) turns them into gRPC status codes.
Anything else escaping a handler is a bug and becomes INTERNAL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldProblem:
    """One bad field: where, the value, and how to fix it."""

    field: str
    value: Any
    message: str
    severity: str = "error"


class SpecwireError(Exception):
    """Base of the errors a caller can cause or must handle. `code` names a gRPC status code."""

    code = "INTERNAL"

    def __init__(
        self, message: str, violations: list[Any] | tuple[Any, ...] = (), retry_after_s: float | None = None
    ):
        super().__init__(message)
        self.message = message
        self.violations = list(violations)
        self.retry_after_s = retry_after_s


class InvalidArgument(SpecwireError):
    code = "INVALID_ARGUMENT"

    @classmethod
    def for_field(cls, field: str, value: Any, message: str) -> InvalidArgument:
        """A single bad field, with the message naming field, value and fix."""
        return cls(f"{field}={value!r}: {message}", [FieldProblem(field, value, message)])


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
