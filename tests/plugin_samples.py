"""Test-only server plugins (declared by `tests.plugin_packages`): failures a plugin can have."""

from __future__ import annotations

from typing import Any


class _Raising:
    def __call__(self, input_ids, scores):
        raise RuntimeError("secret internal detail of the raising plugin")


def make_raising(args: dict, context: Any) -> _Raising:
    """A processor that raises at its first call (a plugin's bug)."""
    return _Raising()


def make_buggy(args: dict, context: Any) -> Any:
    """A factory with a bug (not a refusal of its arguments)."""
    raise ZeroDivisionError("bug in the factory")
