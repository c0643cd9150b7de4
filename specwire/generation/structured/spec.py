"""What a request asks its output to match: one JSON schema, regex, Lark grammar or list of choices."""

from __future__ import annotations

import dataclasses
import json
from typing import Final

from specwire.generation.argument_errors import InvalidGenerationArgument

__all__ = ["STRUCTURED_KINDS", "StructuredOutput"]

# The kinds, as the wire's oneof and the client's dict keys name them.
STRUCTURED_KINDS: Final = ("json_schema", "regex", "grammar", "choice")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """
    One request's structured-output spec (hashable: it keys the compiled-grammar cache).

    Args:
        kind (`str`):
            `"json_schema"` (a JSON Schema document as text), `"regex"` (the whole output must match),
            `"grammar"` (a Lark grammar as llguidance takes it, `start` being the whole output) or
            `"choice"` (the output is exactly one of the strings).
        value (`str` or `tuple[str, ...]`):
            The schema, regex or grammar text, or the choices (a tuple for `"choice"`).
    """

    kind: str
    value: str | tuple[str, ...]

    @property
    def field(self) -> str:
        """The request field this spec came from, for error messages."""
        return f"structured_output.{self.kind}"

    def check(self) -> None:
        """Refuses a malformed spec (unknown kind, empty text, no choices, schema that is not JSON).

        Raises:
            `InvalidGenerationArgument`: naming `structured_output.<kind>`, the value and the fix.
        """
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidGenerationArgument.for_field(
                "structured_output", self.kind, f"the kind must be one of {list(STRUCTURED_KINDS)}"
            )
        if self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value:
                raise InvalidGenerationArgument.for_field(
                    self.field, self.value, "give at least one choice (a list of non-empty strings)"
                )
            if not all(isinstance(c, str) and c for c in self.value):
                raise InvalidGenerationArgument.for_field(
                    self.field, list(self.value), "every choice must be a non-empty string"
                )
            return
        if not isinstance(self.value, str) or not self.value.strip():
            raise InvalidGenerationArgument.for_field(self.field, self.value, f"give a non-empty {self.kind}")
        if self.kind == "json_schema":
            try:
                document = json.loads(self.value)
            except json.JSONDecodeError as error:
                raise InvalidGenerationArgument.for_field(
                    self.field, self.value, f"the schema is not valid JSON ({error}); send a JSON Schema object"
                ) from None
            if not isinstance(document, (dict, bool)):
                raise InvalidGenerationArgument.for_field(
                    self.field, self.value, "a JSON Schema is an object (or true/false); send a JSON object"
                )
