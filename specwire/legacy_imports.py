"""The import names before 0.2 (`client`, `config_service`, `draft_service`, `target_service`), kept for
one release as aliases of `specwire.client`, `specwire.config_service`, ... with a warning.

Nothing is installed under the old names: `specwire-legacy-imports.pth` (installed next to the
package, see `setup.py`) runs `install()` at interpreter start, which puts `LegacyImportFinder` first
on `sys.meta_path`. An old name then resolves to the very module object of the new name (one copy,
so classes and module state are shared), and `python -m target_service` still runs. Removed in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

LEGACY_PACKAGES = ("client", "config_service", "draft_service", "target_service")
REMOVED_IN = "0.3"


def new_name(fullname: str) -> str | None:
    """`specwire.<fullname>` when `fullname` is an old name or one of its submodules, else None."""
    top = fullname.partition(".")[0]
    return f"specwire.{fullname}" if top in LEGACY_PACKAGES else None


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module of its new name, imported once under the new name."""

    def __init__(self, new: str, real: importlib.machinery.ModuleSpec):
        self.new, self.real = new, real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # executed under its new name by create_module

    def get_code(self, fullname: str) -> CodeType | None:
        # `python -m target_service` (runpy) runs the code of `specwire.target_service.__main__`.
        return self.real.loader.get_code(self.new)  # type: ignore[union-attr]


class LegacyImportFinder(importlib.abc.MetaPathFinder):
    """Finds old names (see the module docstring); warns once per old top-level package.

    An old name that another distribution provides (a top-level `client` package, say) is left to it.
    """

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        top = fullname.partition(".")[0]
        if "." in fullname:
            if sys.modules.get(top) is not sys.modules.get(f"specwire.{top}"):
                return None  # `top` is another distribution's package, not our alias
        elif any(f.find_spec(fullname, path, target) for f in sys.meta_path if f is not self):
            return None  # another distribution owns the name: it wins, as if we were not here
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        if top not in self.warned:
            self.warned.add(top)
            warnings.warn(
                f"`{top}` is now `specwire.{top}`: import `{new}` instead "
                f"(the old name is an alias that goes away in specwire {REMOVED_IN})",
                FutureWarning,
                stacklevel=2,
            )
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(new, real), origin=real.origin)
        spec.submodule_search_locations = real.submodule_search_locations
        return spec


def install() -> None:
    """Puts the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, LegacyImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, LegacyImportFinder())
