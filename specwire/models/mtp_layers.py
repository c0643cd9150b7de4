"""The served model's multi-token prediction layers (`use_mtp`), loaded once per model on first use.

transformers loads them as an `MtpModel` (`MtpModel.from_pretrained(model)`: the MTP weights of the model's
checkpoint folder, which a plain load of the model skips, sharing the model's embedding, LM head and rotary
embedding). `speculation.mtp.MtpDrafter` drafts with it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.speculation.mtp import mtp_layer_count
from specwire.models.loader import _TRANSFORMERS_LOAD_LOCK

__all__ = ["mtp_model_for"]

FIELD = "config.use_mtp"

# One MtpModel per served model, loaded on first use (the MTP weights stay unused otherwise); a model whose
# checkpoint lacks them keeps its refusal, so a retry does not reload anything.
_LOADED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_LOAD_LOCK = threading.Lock()


def mtp_model_for(model: Any) -> Any:
    """The `MtpModel` of `model` (transformers' `MtpModel.from_pretrained(model)`), loaded once per model.

    Args:
        model (`PreTrainedModel`): the served model, loaded from a folder whose safetensors hold its MTP layers.

    Raises:
        `InvalidGenerationArgument` (field `config.use_mtp`): the model has no MTP layers, or its checkpoint
        lacks their weights (transformers raises `ValueError` / `RuntimeError` there).
    """
    with _LOAD_LOCK:
        known = _LOADED.get(model)
        if known is None:
            known = _load(model)
            _LOADED[model] = known
    if isinstance(known, InvalidGenerationArgument):
        raise InvalidGenerationArgument(known.message, known.violations)  # a fresh one: tracebacks pile up
    return known


def _load(model: Any) -> Any:
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    if mtp_layer_count(model) is None:
        return InvalidGenerationArgument.for_field(
            FIELD,
            True,
            f"the served model {name} ({type(model).__name__}) has no multi-token prediction layers "
            "(its config sets no num_mtp_layers; transformers raises ValueError too): serve a checkpoint with MTP "
            "layers (DeepSeek-V3, GLM-4.5, ...) or unset use_mtp",
        )
    from transformers.modeling_layers import MtpModel

    decoder = model.get_decoder()
    device = next(decoder.layers[-1].parameters()).device  # transformers' choice: the last layer's device
    try:
        with _TRANSFORMERS_LOAD_LOCK:  # transformers' loads take turns (see the loader)
            mtp = MtpModel.from_pretrained(model, device_map={"": device})
    except (ValueError, RuntimeError, OSError) as error:
        return InvalidGenerationArgument.for_field(
            FIELD,
            True,
            f"the served model {name} declares {mtp_layer_count(model)} MTP layer(s) but their weights could not "
            f"be loaded from its checkpoint ({error}); serve a checkpoint that keeps them or unset use_mtp",
        )
    mtp.eval()
    mtp.requires_grad_(False)
    return mtp
