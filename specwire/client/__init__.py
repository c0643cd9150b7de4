"""specwire Python client: `ConfigClient`/`AsyncConfigClient` for the registry and
`TargetClient`/`AsyncTargetClient` for generation. Imported lazily so that using the registry
client does not import torch."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "ConfigClient": "specwire.client.config_client",
    "AsyncConfigClient": "specwire.client.config_client",
    "ConfigRecord": "specwire.client.config_client",
    "ValidationResult": "specwire.client.config_client",
    "ConfigHistory": "specwire.client.config_client",
    "HistoryEntry": "specwire.client.config_client",
    "SpecwireRpcError": "specwire.client.errors",
    "Violation": "specwire.client.errors",
    "TargetClient": "specwire.client.target_client",
    "AsyncTargetClient": "specwire.client.target_client",
    "GenerateOutput": "specwire.client.target_client",
    "StreamDelta": "specwire.client.target_client",
    "WatermarkDetection": "specwire.client.watermark",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specwire.client' has no attribute {name!r}")
