"""The client's `structured_output=` argument -> the wire's `StructuredOutput` message.

Accepted forms (exactly one key):

- `{"json_schema": schema}`: a dict, a JSON string, or a pydantic model class (its `model_json_schema()`);
- `{"regex": "..."}`: the whole output matches it;
- `{"grammar": "..."}`: a Lark grammar (llguidance's dialect), `start` being the whole output;
- `{"choice": ["a", "b", ...]}`: the output is one of the strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from specwire.target.v1 import target_service_pb2 as pb

__all__ = ["STRUCTURED_OUTPUT_KINDS", "structured_output_to_proto"]

STRUCTURED_OUTPUT_KINDS = ("json_schema", "regex", "grammar", "choice")


def _schema_text(schema: Any) -> str:
    """A JSON Schema as JSON text, from a dict, a string or a pydantic model class."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # pydantic v2 model class
        return json.dumps(schema.model_json_schema())
    if isinstance(schema, Mapping):
        return json.dumps(schema)
    raise ValueError(
        f"structured_output['json_schema'] must be a dict, a JSON string or a pydantic model class, "
        f"not {type(schema).__name__}"
    )


def structured_output_to_proto(value: Mapping[str, Any]) -> pb.StructuredOutput:
    """
    Builds the wire message of a `structured_output=` argument.

    Args:
        value (`Mapping[str, Any]`): one of the forms in the module docstring.

    Returns:
        `StructuredOutput`

    Raises:
        `ValueError`: not exactly one known key, or a value of the wrong type.
    """
    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in STRUCTURED_OUTPUT_KINDS:
        raise ValueError(
            f"structured_output must be a dict with exactly one of the keys {list(STRUCTURED_OUTPUT_KINDS)}, "
            f"e.g. {{'json_schema': {{...}}}} or {{'choice': ['yes', 'no']}}; got {value!r}"
        )
    kind, spec = next(iter(value.items()))
    if kind == "json_schema":
        return pb.StructuredOutput(json_schema=_schema_text(spec))
    if kind == "choice":
        if isinstance(spec, str) or not all(isinstance(choice, str) for choice in spec):
            raise ValueError(f"structured_output['choice'] must be a list of strings, got {spec!r}")
        return pb.StructuredOutput(choice=pb.StructuredOutputChoices(values=list(spec)))
    if not isinstance(spec, str):
        raise ValueError(f"structured_output[{kind!r}] must be a string, got {type(spec).__name__}")
    message = pb.StructuredOutput()
    setattr(message, kind, spec)  # regex or grammar: a string field of the oneof
    return message
