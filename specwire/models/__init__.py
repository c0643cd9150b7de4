"""Loading causal LMs and tokenizers: the embedded default, local folders, GGUF files, Hub ids."""

from specwire.models.default import DEFAULT_GGUF_FILENAME, DEFAULT_MODEL_ID, default_gguf_path
from specwire.models.loader import (
    LoadedModel,
    ModelLoadError,
    load_model,
    model_config,
    quantize_int8,
    resolve_device,
    resolve_dtype,
)

__all__ = [
    "DEFAULT_GGUF_FILENAME",
    "DEFAULT_MODEL_ID",
    "LoadedModel",
    "ModelLoadError",
    "default_gguf_path",
    "load_model",
    "model_config",
    "quantize_int8",
    "resolve_device",
    "resolve_dtype",
]
