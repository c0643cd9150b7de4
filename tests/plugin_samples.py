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


def make_raising_method(args: dict, context: Any) -> Any:
    """A generate method that raises when it runs (a plugin's bug)."""

    def method(inputs):
        inputs.check()
        raise RuntimeError("secret internal detail of the raising method")

    return method


def make_bad_output_method(args: dict, context: Any) -> Any:
    """A generate method that returns rows with the prompt cut off (a contract breach)."""
    return lambda inputs: inputs.input_ids[:, 1:]


# What the slow method saw: a start per run, and the exception its check() raised.
SLOW_METHOD_STARTS: list[float] = []
SLOW_METHOD_STOPS: list[str] = []


def make_slow_method(args: dict, context: Any) -> Any:
    """A generate method that does not finish on its own: it calls check() every 20 ms until it raises (and
    gives up after 20 s, so that a broken check fails the test instead of hanging it)."""
    import time

    def method(inputs):
        started = time.monotonic()
        SLOW_METHOD_STARTS.append(started)
        try:
            while time.monotonic() - started < 20:
                inputs.check()
                time.sleep(0.02)
            raise RuntimeError("check() never raised")
        except Exception as exc:
            SLOW_METHOD_STOPS.append(type(exc).__name__)
            raise

    return method
