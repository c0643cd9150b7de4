"""The one owner of the rules a generation config must follow, and of how their violations reach a caller.

- `validate(config)` reports, without raising, exactly what transformers refuses from the config alone (the
  rules of `constructor_rules`, then of `generate_rules` and `processor_rules`, in transformers' order), and
  transformers' "minor issues" as warnings. `tests/parity/test_validation_battery.py` checks the verdicts
  against the installed transformers.
- `unknown_keys(config)` warns about custom entries (a misspelled field lands there).
- `check_runnable(config)` is what the decoding loop runs before its first forward: the modes specwire does
  not run (`UnsupportedModeError`, UNIMPLEMENTED), `validate()`'s errors, and specwire's own limits on the
  values that shape the loop.
- `raise_for_errors(violations)` is the one place where violations become an `InvalidArgument`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any

from specwire.errors import FieldProblem
from specwire.generation.argument_errors import InvalidGenerationArgument, UnsupportedModeError
from specwire.generation.config.constraint_data import constraint_parts
from specwire.generation.config.constructor_rules import check_constructor
from specwire.generation.config.fields import FIELD_NAMES, GenerationConfig
from specwire.generation.config.generate_rules import check_generate
from specwire.generation.config.modes import REMOVED_MODE_FIELDS, REMOVED_MODE_NAMES, GenerationMode
from specwire.generation.config.value_types import is_int
from specwire.generation.config.violations import Recorder, Violation, errors

__all__ = ["check_runnable", "field_suggestion", "raise_for_errors", "unknown_keys", "v4_mode_violations", "validate"]


def validate(config: GenerationConfig, strict: bool = False) -> list[Violation]:
    """Check the config the way transformers does, without raising, logging or modifying anything.

    See `GenerationConfig.validate()`, which calls this.

    Args:
        config (`GenerationConfig`):
            The config as given (unset fields take `DEFAULT_GENERATION_PARAMS`).
        strict (`bool`, *optional*, defaults to `False`):
            Report warnings as errors.

    Returns:
        `list[Violation]`: errors and warnings, in transformers' checking order; empty when all is well.
    """
    recorder = Recorder(config)
    check_constructor(recorder)
    check_generate(recorder)
    found = recorder.violations
    if strict:
        found = [dataclasses.replace(v, severity="error") for v in found]
    return found


def field_suggestion(key: str) -> str:
    """ "did you mean `temperature`?" for a key close to a GenerationConfig field, else ""."""
    close = difflib.get_close_matches(key, FIELD_NAMES, n=1, cutoff=0.75)
    return f"did you mean `{close[0]}`?" if close else ""


def unknown_keys(config: GenerationConfig) -> list[Violation]:
    """A warning per `extra` key: transformers keeps unknown keys as custom entries, and uses none of them.

    A misspelled field (`temprature`) lands here and would otherwise change nothing without a word; a
    registry that stores custom entries on purpose says so (`allow_custom`).
    """
    found = []
    for key, value in sorted(config.extra.items()):
        hint = field_suggestion(key)
        found.append(
            Violation(
                key,
                value,
                f"not a GenerationConfig field{'; ' + hint if hint else ''}: generation ignores it (transformers "
                "keeps it as a custom entry); fix the name, or store it on purpose with allow_custom",
                "warning",
            )
        )
    return found


def raise_for_errors(violations: Iterable[Violation], *, field_prefix: str = "", summary: str = "") -> None:
    """Raise `InvalidGenerationArgument` (INVALID_ARGUMENT) listing the errors among `violations`, if any.

    Args:
        violations (`Iterable[Violation]`):
            What `validate()` (or another rule) returned; warnings are ignored.
        field_prefix (`str`, *optional*, defaults to `""`):
            Put before each field name, to name it inside the request (`"config."`).
        summary (`str`, *optional*, defaults to `""`):
            Put before the list of problems in the message (`"invalid generation config"`).

    Raises:
        `InvalidGenerationArgument`: one field violation per error; the message lists them as
        `field=value: message`.
    """
    problems = [FieldProblem(f"{field_prefix}{v.field}", v.value, v.message) for v in errors(violations)]
    if not problems:
        return
    # Values and messages as the problems bound them, so a long list still fits the response metadata.
    listed = "; ".join(f"{p.field}={p.value!r}: {p.message}" for p in problems)
    raise InvalidGenerationArgument(f"{summary}: {listed}" if summary else listed, problems)


def check_runnable(config: GenerationConfig) -> GenerationConfig:
    """Raise what stops the decoding loop from running `config`, before any forward pass.

    In order: a mode specwire does not run, what transformers refuses (`validate()`), and specwire's own
    limits on the values that shape the loop.

    Args:
        config (`GenerationConfig`):
            The merged request/model config (unset fields allowed).

    Returns:
        `GenerationConfig`: the config with the global defaults applied.

    Raises:
        `UnsupportedModeError`: a mode transformers 5 removed or specwire does not run is selected.
        `InvalidGenerationArgument`: any other error, one field violation each.
    """
    resolved = config.with_defaults()
    refuse_unsupported_modes(resolved)
    raise_for_errors(config.validate())
    raise_for_errors(v4_mode_violations(resolved))
    raise_for_errors(_loop_shape_violations(resolved))
    return resolved


def refuse_unsupported_modes(config: GenerationConfig) -> None:
    """Refuse the modes transformers 5 removed from `generate()` (now Hub recipes) and those specwire does not run.

    Args:
        config (`GenerationConfig`):
            The config with the global defaults applied (contrastive search depends on the default `top_k=50`).

    Raises:
        `UnsupportedModeError`: naming the field that selects the mode.
    """
    mode = config.get_generation_mode()
    if mode in REMOVED_MODE_FIELDS:
        fields = REMOVED_MODE_FIELDS[mode]
        field = next((name for name in fields if getattr(config, name) is not None), fields[0])
        raise UnsupportedModeError(
            field,
            f"{REMOVED_MODE_NAMES[mode]} is not supported: transformers 5 moved it out of generate() to a Hub "
            f"custom_generate recipe, and specwire does not run those; unset {field}",
            getattr(config, field),
        )
    beams = config.num_beams
    if config.low_memory and isinstance(beams, (int, float)) and beams > 1:
        raise UnsupportedModeError(
            "low_memory",
            "sequential (low_memory) beam search was removed in transformers 5; unset low_memory",
            config.low_memory,
        )


def v4_mode_violations(config: GenerationConfig) -> list[Violation]:
    """transformers 4.55.4's rules for the v4 modes specwire runs (group beam search: its `validate()` and
    `BeamSearchScorer`), on a config with the global defaults applied; one error violation each."""
    mode = config.get_generation_mode()
    if mode is GenerationMode.CONTRASTIVE_SEARCH:
        return _contrastive_violations(config)
    if mode is GenerationMode.DOLA_GENERATION:
        layers: Any = config.dola_layers
        if layers in ("low", "high") or (isinstance(layers, list) and all(is_int(i) for i in layers)):
            return []
        return [
            Violation(
                "dola_layers",
                layers,
                "`dola_layers` selects DoLa decoding and must be 'low', 'high' or a list of layer indices.",
                "error",
            )
        ]
    if mode is GenerationMode.CONSTRAINED_BEAM_SEARCH:
        return _constrained_violations(config)
    if mode is not GenerationMode.GROUP_BEAM_SEARCH:
        return []
    prefix = "`num_beam_groups` > 1 selects group (diverse) beam search, in which "
    groups: Any = config.num_beam_groups
    beams: Any = config.num_beams
    penalty: Any = config.diversity_penalty
    found = []
    if not is_int(groups) or not is_int(beams) or groups > beams or beams % groups:
        found.append(
            Violation(
                "num_beam_groups",
                groups,
                prefix + f"`num_beams` (={beams!r}) must be a multiple of `num_beam_groups`; pick a divisor of it.",
                "error",
            )
        )
    if config.do_sample is True:
        found.append(Violation("do_sample", True, prefix + "`do_sample` must be False; unset it.", "error"))
    if not isinstance(penalty, (int, float)) or not penalty > 0.0:
        found.append(
            Violation(
                "diversity_penalty",
                penalty,
                prefix + "`diversity_penalty` must be greater than 0.0, otherwise the groups are identical; set it, "
                "e.g. 1.0.",
                "error",
            )
        )
    return found


def _contrastive_violations(config: GenerationConfig) -> list[Violation]:
    """What contrastive search cannot run with: no cache (transformers 4.55.4 refuses it too), and what would
    change or return the hidden states it ranks its candidates by."""
    prefix = "`penalty_alpha` > 0 with `top_k` > 1 selects contrastive search, which "
    found = []
    if not config.use_cache:
        found.append(Violation("use_cache", config.use_cache, prefix + "needs the KV cache; unset use_cache.", "error"))
    if config.prefill_chunk_size is not None:
        found.append(
            Violation(
                "prefill_chunk_size",
                config.prefill_chunk_size,
                prefix + "needs the hidden states of every prompt position in one forward; unset prefill_chunk_size.",
                "error",
            )
        )
    if config.cache_implementation not in (None, "dynamic"):
        found.append(
            Violation(
                "cache_implementation",
                config.cache_implementation,
                prefix + "repeats and selects rows of a dynamic cache; unset cache_implementation.",
                "error",
            )
        )
    for name in ("output_attentions", "output_hidden_states"):
        if config.return_dict_in_generate and getattr(config, name):
            found.append(Violation(name, True, prefix + f"does not return them in specwire; unset {name}.", "error"))
    return found


def _loop_shape_violations(config: GenerationConfig) -> list[Violation]:
    """specwire's limits on the values that size the loop's rows, beyond transformers' own.

    transformers repeats each prompt `max(num_beams, num_return_sequences)` times and so accepts, for example,
    `num_return_sequences=0` without beams; the loop wants both counts to be whole and positive.
    """
    found = []
    for name in ("num_beams", "num_return_sequences"):
        value: Any = getattr(config, name)
        if not is_int(value) or value < 1:
            found.append(
                Violation(
                    name,
                    value,
                    f"`{name}` (={value!r}) must be a positive integer: each prompt runs as max(num_beams, "
                    "num_return_sequences) rows.",
                    "error",
                )
            )
    return found


def _token_lists(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(is_int(t) and t >= 0 for t in value)


def _disjunctive_ok(value: Any) -> bool:
    # Non-empty token lists, none a prefix of another (4.55.4's `DisjunctiveTrie` refuses subsets).
    if not isinstance(value, list) or not value or not all(_token_lists(s) for s in value):
        return False
    return not any(a != b and b[: len(a)] == a for a in value for b in value) and len(set(map(tuple, value))) == len(
        value
    )


def _constraint_ok(parts: tuple[str, Any] | None) -> bool:
    if parts is None:
        return False
    return _token_lists(parts[1]) if parts[0] == "phrasal" else _disjunctive_ok(parts[1])


def _constrained_violations(config: GenerationConfig) -> list[Violation]:
    """4.55.4's rules for constrained beam search: its `validate()`, `generate()` and constraint classes."""
    suffix = "constraints / force_words_ids select constrained beam search, in which "
    found = []
    beams: Any = config.num_beams
    if not is_int(beams) or beams < 2:
        found.append(Violation("num_beams", beams, suffix + "`num_beams` must be > 1; set num_beams.", "error"))
    if config.do_sample is True:
        found.append(Violation("do_sample", True, suffix + "`do_sample` must be False; unset it.", "error"))
    groups: Any = config.num_beam_groups
    if groups is not None and groups != 1:
        found.append(Violation("num_beam_groups", groups, suffix + "`num_beam_groups` must be 1; unset it.", "error"))
    words: Any = config.force_words_ids
    if words is not None and not (
        isinstance(words, list)
        and words
        and all(
            _disjunctive_ok(w) if isinstance(w, list) and w and isinstance(w[0], list) else _token_lists(w)
            for w in words
        )
    ):
        found.append(
            Violation(
                "force_words_ids",
                words,
                "`force_words_ids` must be a non-empty list of token-id lists (each a phrase) or of lists of "
                "token-id lists (each a choice of phrases, none a prefix of another).",
                "error",
            )
        )
    items: Any = config.constraints
    if items is not None and not (
        isinstance(items, list) and items and all(_constraint_ok(constraint_parts(c)) for c in items)
    ):
        found.append(
            Violation(
                "constraints",
                items,
                "`constraints` must be a non-empty list of {'type': 'phrasal', 'token_ids': [ids]} or "
                "{'type': 'disjunctive', 'token_ids': [[ids], ...]} (PhrasalConstraint / DisjunctiveConstraint as "
                "plain data; {'phrasal': ...} / {'disjunctive': ...} too).",
                "error",
            )
        )
    return found
