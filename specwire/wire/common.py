"""Conversions for `specwire.common.v1` messages: finish reasons and field violations."""

from __future__ import annotations

from typing import Any

from specwire.common.v1 import common_pb2
from specwire.errors import MAX_PROBLEM_MESSAGE_CHARS, clip, short_value
from specwire.vocabulary import FINISH_CANCELLED, FINISH_REASONS

# Finish reason name -> `FinishReason` enum value, by the enum's naming rule (`FINISH_REASON_<NAME>`).
FINISH_REASON_TO_PROTO: dict[str, common_pb2.FinishReason] = {
    name: common_pb2.FinishReason.Value(f"FINISH_REASON_{name.upper()}") for name in (*FINISH_REASONS, FINISH_CANCELLED)
}
FINISH_REASON_FROM_PROTO: dict[int, str] = {value: name for name, value in FINISH_REASON_TO_PROTO.items()}


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
