"""A DFlash assistant (`target-service --dflash-model M`), loaded next to the target and checked against it.

A DFlash assistant (transformers 5.23 ships `MuseGlimmerAssistantModel`) is an `AutoModel` without LM head: it
reads the target's hidden states at its config's `target_layer_ids`, embeds its noise window (the newest token and
`block_size - 1` tokens `mask_token_id`) with the target's input embeddings and drafts through the target's LM head
(`speculation.dflash`). So it loads with `AutoModel`, needs no tokenizer of its own, and must fit the target: the
same hidden size, layer ids within the target's layers, a mask token inside the target's vocabulary.
"""

from __future__ import annotations

import time
from typing import Any

from specwire.generation.speculation.dflash import DFLASH_CONFIG_KEYS, is_dflash_assistant
from specwire.models.loader import (
    _TRANSFORMERS_LOAD_LOCK,
    LoadedModel,
    ModelLoadError,
    _find_source,
    _library_progress_bars,
    _Progress,
    resolve_device,
    resolve_dtype,
)

__all__ = ["check_dflash_assistant", "load_dflash_assistant"]


def load_dflash_assistant(
    name: str,
    target: LoadedModel,
    *,
    revision: str | None = None,
    progress: bool = True,
) -> Any:
    """Load the DFlash assistant `name` (a local folder or a Hub repo id) on the target's device and dtype.

    Args:
        name (`str`): a folder with the assistant's `config.json` and safetensors, or a Hub repo id.
        target (`LoadedModel`): the served model it drafts for.
        revision (`str`, *optional*): branch, tag or commit of a Hub repo.
        progress (`bool`, *optional*, defaults to `True`): write progress lines to stderr.

    Returns:
        The assistant (`PreTrainedModel`), in eval mode with gradients disabled.

    Raises:
        `ModelLoadError`: the name cannot be resolved, the files cannot be loaded, the model is not a DFlash
            assistant, or it does not fit the target (the message says why and how to fix it).
    """
    from transformers import AutoConfig, AutoModel

    report = _Progress(progress)
    tried: list[str] = []
    started = time.perf_counter()
    with _library_progress_bars(progress):
        source = _find_source(str(name), revision, tried, report)
        if source.gguf_file is not None:
            raise ModelLoadError(
                name, "a DFlash assistant is loaded from safetensors, not GGUF", tried=tried, hint="give its folder"
            )
        folder = str(source.folder)
        try:
            config = AutoConfig.from_pretrained(folder)
        except Exception as error:  # noqa: BLE001 -- any library failure becomes one clear load error
            raise ModelLoadError(name, f"its config could not be read: {error}", tried=tried) from error
        missing = [key for key in DFLASH_CONFIG_KEYS if getattr(config, key, None) is None]
        if missing:
            raise ModelLoadError(
                name,
                f"it is no DFlash assistant: its config ({config.model_type}) sets no {', '.join(missing)}",
                tried=tried,
                hint="give a DFlash assistant (e.g. a muse_glimmer_assistant checkpoint); an ordinary draft model "
                "goes to --draft-model",
            )
        try:
            with _TRANSFORMERS_LOAD_LOCK:  # transformers' loads take turns (see the loader)
                assistant = AutoModel.from_pretrained(folder, dtype=resolve_dtype(target.dtype))
        except Exception as error:  # noqa: BLE001 -- e.g. SafetensorError, which is no OSError
            raise ModelLoadError(name, f"its weights could not be loaded: {error}", tried=tried) from error
    assistant = assistant.to(resolve_device(target.device))
    assistant.eval()
    assistant.requires_grad_(False)
    try:
        check_dflash_assistant(target.model, assistant)
    except ValueError as error:
        raise ModelLoadError(name, str(error), tried=tried) from None
    report(
        f"loaded DFlash assistant {source.model_id}: {type(assistant).__name__}, block {config.block_size}, "
        f"target layers {list(config.target_layer_ids)}, in {time.perf_counter() - started:.1f}s"
    )
    return assistant


def check_dflash_assistant(target: Any, assistant: Any) -> None:
    """Refuse an assistant that cannot draft for `target` (ValueError with the reason and the fix).

    Args:
        target (`PreTrainedModel`): the served model.
        assistant (`PreTrainedModel`): the DFlash assistant.
    """
    if not is_dflash_assistant(assistant):
        raise ValueError(
            f"{type(assistant).__name__} is no DFlash assistant: its config sets no {' / '.join(DFLASH_CONFIG_KEYS)}"
        )
    text = target.config.get_text_config(decoder=True)
    config = assistant.config
    name = type(target).__name__
    if int(config.hidden_size) != int(text.hidden_size):
        raise ValueError(
            f"its hidden size {config.hidden_size} differs from the target's ({name}: {text.hidden_size}); it embeds "
            "with the target's embeddings and reads its hidden states: give the assistant trained for this target"
        )
    layers = int(text.num_hidden_layers)
    outside = [i for i in config.target_layer_ids if not 0 <= int(i) < layers]
    if outside or not config.target_layer_ids:
        raise ValueError(
            f"its target_layer_ids {list(config.target_layer_ids)} are not all layers of the target ({name} has "
            f"{layers} decoder layers, 0 to {layers - 1}): give the assistant trained for this target"
        )
    if int(config.block_size) < 2:
        raise ValueError(f"its block_size {config.block_size} drafts nothing (it drafts block_size - 1 tokens)")
    vocab = int(text.vocab_size)
    if not 0 <= int(config.mask_token_id) < vocab:
        raise ValueError(
            f"its mask_token_id {config.mask_token_id} is outside the target's vocabulary (0 to {vocab - 1}): give "
            "the assistant trained for this target's tokenizer"
        )
    if target.get_output_embeddings() is None:
        raise ValueError(f"the target {name} has no LM head for the assistant to draft through")
