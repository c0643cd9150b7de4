"""Where specwire keeps state on a user's machine: the registry, converted models, service logs.

One root overrides everything: `SPECWIRE_HOME` (then `registry.db`, `cache/` and `logs/` live under
it). Without it the platform's conventions apply (platformdirs: on Linux `~/.local/share/specwire`,
`~/.cache/specwire`, `~/.local/state/specwire/log`, honouring the XDG_* variables). The older
`SPECWIRE_CACHE_DIR` still names the model cache alone. Nothing lands in the current directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

HOME_ENV = "SPECWIRE_HOME"
CACHE_ENV = "SPECWIRE_CACHE_DIR"
_APP = "specwire"


def _home() -> Path | None:
    value = os.environ.get(HOME_ENV)
    return Path(value).expanduser() if value else None


def data_dir() -> Path:
    """Persistent state: the local registry of `specwire serve`."""
    home = _home()
    return home if home is not None else Path(platformdirs.user_data_dir(_APP))


def cache_dir() -> Path:
    """Rebuildable state: GGUF models converted to safetensors."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    home = _home()
    return home / "cache" if home is not None else Path(platformdirs.user_cache_dir(_APP))


def log_dir() -> Path:
    """Service logs written by `specwire serve`."""
    home = _home()
    return home / "logs" if home is not None else Path(platformdirs.user_log_dir(_APP))


def default_registry() -> Path:
    """The SQLite registry `specwire serve` uses when no `--db` is given."""
    return data_dir() / "registry.db"
