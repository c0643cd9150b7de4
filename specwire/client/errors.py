"""Client-side errors: a failed RPC with its status code and structured field violations."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2

from specwire.common.v1 import common_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"
RETRY_AFTER_KEY = "retry-after-s"


@dataclass(frozen=True)
class Violation:
    """One problem with one field, as the server reported it."""

    field: str
    value: str
    message: str
    severity: str  # "error" or "warning"

    @classmethod
    def from_proto(cls, message: common_pb2.FieldViolation) -> Violation:
        severity = "warning" if message.severity == common_pb2.SEVERITY_WARNING else "error"
        return cls(message.field, message.value, message.message, severity)


class SpecwireRpcError(Exception):
    """An RPC failed. `.code()` is the `grpc.StatusCode`; `.violations` the field problems, if any.

    Args:
        code (`grpc.StatusCode`): the status code.
        message (`str`): the server's message.
        violations (`list[Violation]`): structured field violations from the status details.
        retry_after_s (`float`, *optional*): the server's retry hint for RESOURCE_EXHAUSTED.
    """

    def __init__(self, code: grpc.StatusCode, message: str, violations=(), retry_after_s: float | None = None):
        super().__init__(f"{code.name}: {message}")
        self._code = code
        self.message = message
        self.violations = list(violations)
        self.retry_after_s = retry_after_s

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> SpecwireRpcError:
        """Wrap a grpc error (sync or aio), decoding the rich status details the server attached."""
        metadata = error.trailing_metadata() or ()
        violations, retry_after = [], None
        for key, value in metadata:
            if key == STATUS_DETAILS_KEY:
                status = status_pb2.Status.FromString(value)
                for detail in status.details:
                    violation = common_pb2.FieldViolation()
                    if detail.Is(common_pb2.FieldViolation.DESCRIPTOR) and detail.Unpack(violation):
                        violations.append(Violation.from_proto(violation))
                if not violations:
                    for detail in status.details:
                        bad = error_details_pb2.BadRequest()
                        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR) and detail.Unpack(bad):
                            violations += [Violation(v.field, "", v.description, "error") for v in bad.field_violations]
            elif key == RETRY_AFTER_KEY:
                retry_after = float(value)
        return cls(error.code(), error.details() or "", violations, retry_after)


def raises_rpc_errors(method):
    """Decorate a client method (sync or async) so a failed RPC raises `SpecwireRpcError`."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def async_wrapper(*args, **kwargs):
            try:
                return await method(*args, **kwargs)
            except grpc.RpcError as exc:
                raise SpecwireRpcError.from_rpc_error(exc) from None

        return async_wrapper

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except grpc.RpcError as exc:
            raise SpecwireRpcError.from_rpc_error(exc) from None

    return wrapper
