"""Decoding modes: transformers' `GenerationMode`, how a config selects one, and the ONE table of fields
that select a mode specwire does not run.

`MODE_FIELDS` is the only list of removed, deprecated and unserved generation options; everything else
(the warnings of `validate()`, the fields `validate()` ignores, the UNIMPLEMENTED refusal of the decoding
loop and of the target service) is derived from it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEPRECATED_FIELDS",
    "STATIC_CACHES",
    "uses_static_cache",
    "MODE_FIELDS",
    "REMOVED_MODES",
    "REMOVED_MODE_FIELDS",
    "REMOVED_MODE_NAMES",
    "V4_MODE_FIELDS",
    "FieldStatus",
    "GenerationMode",
    "ModeField",
    "assisted_requested",
    "generation_mode",
]


class GenerationMode(enum.StrEnum):
    """Decoding modes, with transformers' `GenerationMode` values.

    `group_beam_search`, `constrained_beam_search`, `contrastive_search` and `dola_generation` were moved to
    Hub `custom_generate` repositories in transformers v5; specwire runs `group_beam_search`,
    `contrastive_search` and `dola_generation` with transformers 4.55.4's semantics and refuses
    `constrained_beam_search`.
    """

    CONTRASTIVE_SEARCH = "contrastive_search"
    GREEDY_SEARCH = "greedy_search"
    SAMPLE = "sample"
    ASSISTED_GENERATION = "assisted_generation"
    DOLA_GENERATION = "dola_generation"
    BEAM_SEARCH = "beam_search"
    BEAM_SAMPLE = "beam_sample"
    CONSTRAINED_BEAM_SEARCH = "constrained_beam_search"
    GROUP_BEAM_SEARCH = "group_beam_search"

    def __str__(self) -> str:
        return self.value


class FieldStatus(enum.Enum):
    """Why specwire does not act on a field of `MODE_FIELDS`."""

    # Selects a mode transformers v5 moved to a Hub `custom_generate` repository: `validate()` warns and
    # checks the rest of the config as if it were unset; the decoding loop answers UNIMPLEMENTED.
    REMOVED_MODE = "removed_mode"
    # An option of a removed mode (or of v4's sequential beam search): no effect; `validate()` warns.
    REMOVED_OPTION = "removed_option"
    # Moved out of `GenerationConfig` by transformers 5.13 and ignored by `generate()`; `validate()` warns.
    MOVED_OUT = "moved_out"
    # Selects or configures a mode transformers v5 moved to a Hub `custom_generate` repository, which
    # specwire runs with transformers 4.55.4's semantics (the last release with it in core): `validate()`
    # still warns, as transformers 5 does, and checks the rest of the config as if it were unset.
    SERVED_V4 = "served_v4"


@dataclass(frozen=True)
class ModeField:
    """One row of `MODE_FIELDS`.

    Args:
        field (`str`):
            The GenerationConfig field.
        status (`FieldStatus`):
            Why specwire does not act on it.
        mode (`GenerationMode`, *optional*):
            The removed mode the field selects (`FieldStatus.REMOVED_MODE` only).
    """

    field: str
    status: FieldStatus
    mode: GenerationMode | None = None


# In the order `validate()` reports its warnings.
MODE_FIELDS: tuple[ModeField, ...] = (
    ModeField("low_memory", FieldStatus.REMOVED_OPTION),
    ModeField("penalty_alpha", FieldStatus.SERVED_V4, GenerationMode.CONTRASTIVE_SEARCH),
    ModeField("dola_layers", FieldStatus.SERVED_V4, GenerationMode.DOLA_GENERATION),
    ModeField("diversity_penalty", FieldStatus.SERVED_V4),
    ModeField("num_beam_groups", FieldStatus.SERVED_V4, GenerationMode.GROUP_BEAM_SEARCH),
    ModeField("constraints", FieldStatus.SERVED_V4, GenerationMode.CONSTRAINED_BEAM_SEARCH),
    ModeField("force_words_ids", FieldStatus.SERVED_V4, GenerationMode.CONSTRAINED_BEAM_SEARCH),
    ModeField("continuous_batching_config", FieldStatus.MOVED_OUT),
)

# Fields that select a mode v5 moved to the Hub, or that v5 ignores: `validate()` warns whenever one is set.
DEPRECATED_FIELDS: tuple[str, ...] = tuple(f.field for f in MODE_FIELDS)

# Each removed mode and the fields that select it, first field first (it is named when none is set, as
# for contrastive search selected by the default `top_k` and a `penalty_alpha`).
REMOVED_MODE_FIELDS: dict[GenerationMode, tuple[str, ...]] = {}
# The same for the modes transformers v5 moved out and specwire runs with 4.55.4's semantics.
V4_MODE_FIELDS: dict[GenerationMode, tuple[str, ...]] = {}
for _row in MODE_FIELDS:
    if _row.mode is not None:
        _table = V4_MODE_FIELDS if _row.status is FieldStatus.SERVED_V4 else REMOVED_MODE_FIELDS
        _table[_row.mode] = (*_table.get(_row.mode, ()), _row.field)
del _row, _table

REMOVED_MODES = frozenset(REMOVED_MODE_FIELDS)

REMOVED_MODE_NAMES = {
    GenerationMode.CONSTRAINED_BEAM_SEARCH: "constrained beam search",
    GenerationMode.GROUP_BEAM_SEARCH: "group (diverse) beam search",
    GenerationMode.CONTRASTIVE_SEARCH: "contrastive search",
    GenerationMode.DOLA_GENERATION: "DoLa decoding",
}


def _greater(value: Any, bound: Any) -> bool:
    # transformers compares these fields with numbers; any other value would raise there, and counts as
    # unset here.
    return isinstance(value, (int, float)) and value > bound


# The `cache_implementation` values for which transformers 5.23's `generate()` builds a `StaticCache` on any
# device: "static", and the deprecated aliases whose layer structure it now infers from the model config.
# (`"hybrid"` is unset before generation, a dynamic cache; the `offloaded*` ones need CUDA to offload.)
STATIC_CACHES = ("static", "sliding_window", "hybrid_chunked")


def uses_static_cache(cfg: Any) -> bool:
    """Whether a config decodes with a `StaticCache` (a static `cache_implementation` and `use_cache`)."""
    return cfg.cache_implementation in STATIC_CACHES and cfg.use_cache is not False


def generation_mode(cfg: Any, *, assisted_triggers: bool) -> GenerationMode:
    """transformers 5.23 `GenerationConfig.get_generation_mode()` on any object with the config's fields.

    Args:
        cfg (`Any`):
            A `GenerationConfig`, or a view of one with the same attributes.
        assisted_triggers (`bool`):
            Whether `prompt_lookup_num_tokens`, `assistant_early_exit` and `use_mtp` turn greedy search and
            sampling into assisted generation.

    Returns:
        `GenerationMode`: the mode.
    """
    if cfg.constraints is not None or cfg.force_words_ids is not None:
        mode = GenerationMode.CONSTRAINED_BEAM_SEARCH
    elif cfg.num_beams is None or cfg.num_beams == 1:
        if cfg.do_sample is not True:
            if (
                cfg.top_k is not None
                and _greater(cfg.top_k, 1)
                and cfg.penalty_alpha is not None
                and _greater(cfg.penalty_alpha, 0)
            ):
                mode = GenerationMode.CONTRASTIVE_SEARCH
            else:
                mode = GenerationMode.GREEDY_SEARCH
        else:
            mode = GenerationMode.SAMPLE
    elif cfg.num_beam_groups is not None and _greater(cfg.num_beam_groups, 1):
        mode = GenerationMode.GROUP_BEAM_SEARCH
    elif cfg.do_sample is True:
        mode = GenerationMode.BEAM_SAMPLE
    else:
        mode = GenerationMode.BEAM_SEARCH
    if assisted_triggers and assisted_requested(cfg):
        if mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            mode = GenerationMode.ASSISTED_GENERATION
    if cfg.dola_layers is not None and mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        mode = GenerationMode.DOLA_GENERATION
    return mode


def assisted_requested(cfg: Any) -> bool:
    """Whether the config asks for assisted generation (prompt lookup, early exit or MTP)."""
    return bool(cfg.use_mtp) or cfg.prompt_lookup_num_tokens is not None or cfg.assistant_early_exit is not None
