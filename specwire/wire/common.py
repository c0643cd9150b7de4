"""Conversions for `specwire.common.v1` messages: finish reasons and field violations."""

from __future__ import annotations

from typing import Any

from specwire.common.v1 import common_pb2
from specwire.errors import MAX_PROBLEM_MESSAGE_CHARS, clip, short_value

FINISH_REASONS = {
    "length": common_pb2.FINISH_REASON_LENGTH,
    "eos": common_pb2.FINISH_REASON_EOS,
    "stop_string": common_pb2.FINISH_REASON_STOP_STRING,
    "time": common_pb2.FINISH_REASON_TIME,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def violation_to_proto(violation: Any, prefix: str = "") -> common_pb2.FieldViolation:
    """Any object with `field`, `value`, `message`, `severity` as a wire FieldViolation."""
    severity = common_pb2.SEVERITY_WARNING if violation.severity == "warning" else common_pb2.SEVERITY_ERROR
    return common_pb2.FieldViolation(
        field=f"{prefix}{violation.field}",
        # Bounded: a violation may echo a huge or deeply nested request value.
        value=repr(short_value(violation.value)),
        message=clip(violation.message, MAX_PROBLEM_MESSAGE_CHARS),
        severity=severity,
    )
