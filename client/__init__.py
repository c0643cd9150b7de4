"""specwire Python client: `ConfigClient`/`AsyncConfigClient` for the registry and
`TargetClient`/`AsyncTargetClient` for generation. Imported lazily so that using the registry
client does not import torch."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "ConfigClient": "client.config_client",
    "AsyncConfigClient": "client.config_client",
    "ConfigRecord": "client.config_client",
    "ValidationResult": "client.config_client",
    "SpecwireRpcError": "client.errors",
    "Violation": "client.errors",
    "TargetClient": "client.target_client",
    "AsyncTargetClient": "client.target_client",
    "GenerateOutput": "client.target_client",
    "StreamDelta": "client.target_client",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'client' has no attribute {name!r}")
