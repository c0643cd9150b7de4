"""JSON documents from callers (`ImportConfig`'s `json`, a Hub `generation_config.json`), parsed safely.

`json.loads` recurses once per nesting level: a document of a few thousand `[` raises `RecursionError`
(a bug-looking INTERNAL before this module), and a less deep one parses but then overflows the code
that walks it (validation, the protobuf `Struct` conversion, whose parsers stop at 100 message
levels). A generation config is a flat object whose deepest values (`sequence_bias`) nest 4 levels,
so documents deeper than `MAX_JSON_DEPTH` are refused as INVALID_ARGUMENT, naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from specwire.errors import InvalidArgument

# Objects and lists inside one another, the document's top level counting as 1. Deep enough for any
# generation_config.json (at most 4) with room for nested `extra` values; shallow enough that every
# parser on the way (protobuf's Struct included) handles the stored config.
MAX_JSON_DEPTH = 20


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0, `[]` and `{}` are 1), computed without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def parse_json_document(text: str, field: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """
    Parse `text` as JSON, refusing malformed and over-deep documents with INVALID_ARGUMENT on `field`.

    Args:
        text (`str`):
            The document.
        field (`str`):
            The request field it came from, named in the error (e.g. `"json"`).
        max_depth (`int`, *optional*, defaults to `MAX_JSON_DEPTH`):
            The deepest nesting of objects and lists accepted.

    Returns:
        The parsed value.

    Raises:
        `InvalidArgument`: not JSON, or nested deeper than `max_depth`.
    """
    excerpt = text[:200]
    try:
        value = json.loads(text)
    except RecursionError as exc:
        raise InvalidArgument.for_field(
            field, excerpt, f"the JSON nests too deeply; at most {max_depth} levels of objects and lists"
        ) from exc
    except ValueError as exc:  # JSONDecodeError, and numbers too long to convert
        raise InvalidArgument.for_field(field, excerpt, f"not valid JSON: {exc}") from exc
    depth = json_depth(value)
    if depth > max_depth:
        raise InvalidArgument.for_field(
            field,
            excerpt,
            f"the JSON nests {depth} levels of objects and lists; at most {max_depth} are accepted "
            "(a generation_config.json needs 4)",
        )
    return value
