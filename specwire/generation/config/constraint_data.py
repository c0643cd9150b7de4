"""Constrained beam search's constraints as plain data (the config carries no constraint objects)."""

from __future__ import annotations

from typing import Any

__all__ = ["constraint_parts"]


def constraint_parts(item: Any) -> tuple[str, Any] | None:
    """`("phrasal", ids)` or `("disjunctive", [ids, ...])` of a constraint given as plain data, `None` if it is not one.

    Accepted: `{"type": "phrasal" | "disjunctive", "token_ids": ...}` (transformers' class and attribute
    names) or `{"phrasal": ids}` / `{"disjunctive": [ids, ...]}`.
    """
    if not isinstance(item, dict):
        return None
    if set(item) == {"type", "token_ids"} and item["type"] in ("phrasal", "disjunctive"):
        return item["type"], item["token_ids"]
    if len(item) == 1 and next(iter(item)) in ("phrasal", "disjunctive"):
        kind = next(iter(item))
        return kind, item[kind]
    return None
