"""`speculation_type`: which requests draft with the DFlash assistant, and which are refused.

transformers 5.23 reads one value, `"dflash"`, and only with an `assistant_model` of a DFlash class; any other
value, or `"dflash"` beside `assistant_early_exit`, `prompt_lookup_num_tokens` or `use_mtp` (which its candidate
generator picks first), it ignores without a word. specwire ignores nothing silently: those are INVALID_ARGUMENT
naming `config.speculation_type`, as is `"dflash"` on a server with no DFlash assistant (`--dflash-model`).
"""

from __future__ import annotations

from typing import Any

from specwire.errors import InvalidArgument
from specwire.vocabulary import PROPOSER_DFLASH, PROPOSER_NONE

__all__ = ["FIELD", "dflash_proposer"]

FIELD = "config.speculation_type"


def dflash_proposer(requested: str | None, config: Any, assistant_loaded: bool) -> str | None:
    """`"dflash"` when the request drafts with the DFlash assistant, None when `speculation_type` is unset.

    Args:
        requested (`str`, *optional*): the proposer the request names (None: it names none).
        config (`GenerationConfig`): the request's effective config.
        assistant_loaded (`bool`): whether the server loaded a DFlash assistant.

    Raises:
        `InvalidArgument` (field `config.speculation_type`): a value other than `"dflash"`, no assistant loaded,
            another drafting method set beside it, or a proposer that contradicts it.
    """
    value = config.speculation_type
    if value is None:
        if requested == PROPOSER_DFLASH:
            raise InvalidArgument.for_field(
                FIELD, None, "proposer dflash drafts with the server's DFlash assistant: set speculation_type='dflash'"
            )
        return None
    if value != "dflash":
        raise InvalidArgument.for_field(
            FIELD,
            value,
            "the only speculation type is 'dflash' (transformers ignores any other value); set 'dflash' or unset it",
        )
    if not assistant_loaded:
        raise InvalidArgument.for_field(
            FIELD,
            value,
            "it drafts with a DFlash assistant loaded next to the target (target-service --dflash-model M), and this "
            "server has none: unset speculation_type, or serve one",
        )
    others = [
        name for name in ("assistant_early_exit", "prompt_lookup_num_tokens") if getattr(config, name) is not None
    ] + (["use_mtp"] if config.use_mtp else [])
    if others:
        raise InvalidArgument.for_field(
            FIELD,
            value,
            f"{others[0]} selects another draft (transformers would draft with it and ignore speculation_type): "
            "unset one of them",
        )
    if requested not in (None, PROPOSER_DFLASH, PROPOSER_NONE):
        raise InvalidArgument.for_field(
            FIELD,
            value,
            f"it selects the DFlash draft and the request asks for proposer {requested}: unset one of them",
        )
    return PROPOSER_NONE if requested == PROPOSER_NONE else PROPOSER_DFLASH
