"""Telemetry tests: the process' telemetry is set up per test module and shut down after it.

specwire's code uses the providers `specwire.telemetry` holds (never OpenTelemetry's globals) and these
modules set up with `set_global=False`, so nothing leaks into the other tests once a module's fixture
has called `shutdown_telemetry()`.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from specwire import telemetry
from specwire.models import load_model

# A repetitive prompt: prompt lookup finds matches, the draft model (the target's own weights) agrees.
PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]
BATCH = [
    PROMPT,
    [20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21],
    [40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41],
]


@contextmanager
def telemetry_for_module(service_name: str, **kwargs):
    """Fresh telemetry for one test module (whatever an earlier module left), shut down afterwards."""
    telemetry.shutdown_telemetry()
    state = telemetry.setup_telemetry(service_name, set_global=False, **kwargs)
    try:
        yield state
    finally:
        telemetry.shutdown_telemetry()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)
