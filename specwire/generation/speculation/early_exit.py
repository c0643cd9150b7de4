"""Self-speculation (`assistant_early_exit`): the target's first N decoder layers and its LM head draft.

transformers' `EarlyExitCandidateGenerator` drafts with the target model itself, its base model's
`config.num_hidden_layers` set to `assistant_early_exit` while it drafts (the decoder loops of Llama-family
models run `self.layers[: self.config.num_hidden_layers]`, then the final norm and the LM head). Setting that
on the served model would change the forwards that other requests run at the same time, so
`early_exit_model` builds a *view* instead: a shallow copy of the model and of its base model whose config
(a copy) says N layers, and whose every weight, layer and buffer is the target's own (nothing is copied but
two module objects and a config). A `ModelDrafter` over the view drafts as transformers' assistant does, with
its own KV cache of N layers; the speculative loop's acceptance keeps the output the target's (identical
tokens for greedy search, the target's distribution for sampling).
"""

from __future__ import annotations

import copy
from typing import Any

from specwire.generation.argument_errors import InvalidGenerationArgument

__all__ = ["early_exit_model", "num_decoder_layers"]


def num_decoder_layers(model: Any) -> int:
    """The number of decoder layers of `model` (its text config's `num_hidden_layers`)."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


def _module_view(module: Any) -> Any:
    """A new module object sharing `module`'s attributes, parameters and submodules; its own `_modules`
    dict, so that replacing a child in the view leaves `module` as it was."""
    view = module.__class__.__new__(module.__class__)
    view.__dict__ = dict(module.__dict__)
    view.__dict__["_modules"] = dict(module._modules)
    return view


def early_exit_model(model: Any, num_layers: int, field: str = "assistant_early_exit") -> Any:
    """The early-exit draft of `model`: its first `num_layers` decoder layers, final norm and LM head.

    Args:
        model (`PreTrainedModel`):
            The target, a transformers causal LM whose base model reads `config.num_hidden_layers` in its
            decoder loop (Llama, Qwen2, Mistral, ...; with other models every layer runs, as in transformers).
        num_layers (`int`):
            The request's `assistant_early_exit`: 1 to the model's layer count - 1.
        field (`str`, *optional*, defaults to `"assistant_early_exit"`):
            The field named in errors.

    Returns:
        A model that shares every weight with `model` and runs only the first `num_layers` layers.

    Raises:
        `InvalidGenerationArgument`: `num_layers` is not between 1 and the layer count - 1.
    """
    total = num_decoder_layers(model)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 < num_layers < total:
        raise InvalidGenerationArgument.for_field(
            field,
            num_layers,
            f"the early-exit draft runs the first N of the served model's {total} decoder layers: give N from 1 "
            f"to {total - 1} (with {total} or more it is the target itself and drafts nothing new)",
        )
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if base is None or not hasattr(base, "config"):
        raise InvalidGenerationArgument.for_field(
            field,
            num_layers,
            f"the served model ({type(model).__name__}) has no base model whose layers can be cut; unset it",
        )
    config = copy.deepcopy(model.config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    text.num_hidden_layers = num_layers
    view = _module_view(model)
    view.__dict__["config"] = config
    base_view = _module_view(base)
    base_view.__dict__["config"] = text if base.config is not model.config else config
    view._modules[prefix] = base_view
    return view
