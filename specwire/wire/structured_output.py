"""The wire's `specwire.target.v1.StructuredOutput` -> the core's `StructuredOutput` (the target's side).

The client builds the message itself (`specwire.client.structured_output`): importing the client must
not load the grammar library.
"""

from __future__ import annotations

from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.structured.spec import StructuredOutput
from specwire.target.v1 import target_service_pb2 as pb

__all__ = ["structured_output_from_proto"]


def structured_output_from_proto(request: pb.GenerateRequest | pb.GenerateStreamRequest) -> StructuredOutput | None:
    """
    The request's structured-output spec, checked for shape (the library checks the rest), or `None`.

    Args:
        request (`GenerateRequest` or `GenerateStreamRequest`): the wire request.

    Returns:
        `StructuredOutput` or `None` when the request has no `structured_output`.

    Raises:
        `InvalidGenerationArgument`: the message is set with no spec in it, or a spec is malformed.
    """
    if not request.HasField("structured_output"):
        return None
    message = request.structured_output
    kind = message.WhichOneof("spec")
    if kind is None:
        raise InvalidGenerationArgument.for_field(
            "structured_output",
            "{}",
            "set one of json_schema, regex, grammar or choice, or leave structured_output unset",
        )
    if kind == "choice":
        spec = StructuredOutput("choice", tuple(message.choice.values))
    else:
        spec = StructuredOutput(kind, getattr(message, kind))
    spec.check()
    return spec
