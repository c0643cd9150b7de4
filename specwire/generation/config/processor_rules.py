"""The rules of `generate()`'s logits processors and warpers (`_get_logits_processor()`), in its order.

Each processor is checked only under the condition that makes transformers build it, with the checks of its
`__init__` (and of its first call, where they depend on the config alone). Values are compared only after a
type test, so no rule evaluates an expression that could raise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from specwire.generation.config.serialization import SYNTHID_DEFAULTS, WATERMARK_DEFAULTS, watermark_kind
from specwire.generation.config.value_types import (
    as_float,
    as_list,
    flatten,
    float_hint,
    has_field_type,
    is_int,
    is_number,
    is_token_id,
    tensor_dtype,
    tensor_scalars,
)
from specwire.generation.config.violations import Effective, Recorder

__all__ = ["check_logits_processors"]


def check_logits_processors(r: Recorder, e: Effective, eos: list[Any] | None) -> None:
    """The processors of `_get_logits_processor()`, then the warpers when sampling.

    Args:
        r (`Recorder`):
            Where violations go.
        e (`Effective`):
            The config as `generate()` sees it.
        eos (`list`, *optional*):
            The eos ids as transformers holds them, `None` when unset or not convertible.
    """
    check_penalties(r, e, eos)
    check_min_lengths(r, e)
    check_forced_and_decay(r, e, eos)
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        value = getattr(e, name)
        if value is None:
            continue
        items = as_list(value)
        if items is None or tensor_scalars(items) is None:
            r.error(name, value, f"`{name}` (={value!r}) must be a list of integer token ids.")
    if e.do_sample:
        check_warpers(r, e)
    if e.watermarking_config is not None and "watermarking_config" not in r.error_fields:
        check_watermark_processor(r, e.watermarking_config)


def check_penalties(r: Recorder, e: Effective, eos: list[Any] | None) -> None:
    """Sequence bias, repetition penalties, n-gram bans and bad words."""
    if e.sequence_bias is not None:
        problem = _sequence_bias_problem(e.sequence_bias)
        if problem:
            r.error("sequence_bias", e.sequence_bias, problem)
    for name in ("encoder_repetition_penalty", "repetition_penalty"):
        # The encoder penalty applies to decoder-only prompts too (the prompt is the "encoder input").
        value = getattr(e, name)
        if value is not None and value != 1.0 and (not isinstance(value, float) or not value > 0):
            r.error(
                name,
                value,
                f"`{name}` (={value!r}) has to be a strictly positive float (1.0 means no penalty). Write it as "
                f"a float, e.g. {float_hint(value)}.",
            )
    for name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size"):
        value = getattr(e, name)
        if value is None:
            continue
        # torch's unfold() refuses a bool n-gram size (the encoder variant never unfolds with it).
        is_bool = isinstance(value, bool) and name == "no_repeat_ngram_size"
        if not is_number(value) or (value > 0 and (not is_int(value) or is_bool)):
            r.error(
                name,
                value,
                f"`{name}` (={value!r}) has to be an integer (0 disables it; n > 0 bans repeated n-grams).",
            )
    if e.bad_words_ids is not None:
        problem = _bad_words_problem(e.bad_words_ids, eos)
        if problem:
            r.error("bad_words_ids", e.bad_words_ids, problem)


def check_min_lengths(r: Recorder, e: Effective) -> None:
    """MinLengthLogitsProcessor and MinNewTokensLengthLogitsProcessor."""
    if e.min_new_tokens is None and is_number(e.min_length):
        # Built when min_length > 0 (min_new_tokens replaces min_length otherwise).
        if e.min_length > 0 and not is_int(e.min_length):
            r.error(
                "min_length", e.min_length, f"`min_length` has to be a non-negative integer, but is {e.min_length!r}."
            )
    if is_number(e.min_new_tokens) and not is_int(e.min_new_tokens):
        # min_length becomes min_new_tokens + prompt length: a float fails for any prompt longer than
        # -min_new_tokens, so a float is refused whatever its value.
        r.error(
            "min_new_tokens",
            e.min_new_tokens,
            f"`min_new_tokens` has to be a non-negative integer, but is {e.min_new_tokens!r}.",
        )


def check_forced_and_decay(r: Recorder, e: Effective, eos: list[Any] | None) -> None:
    """ForcedEOSTokenLogitsProcessor and ExponentialDecayLengthPenalty."""
    if e.forced_eos_token_id is not None:
        forced = [e.forced_eos_token_id] if is_int(e.forced_eos_token_id) else e.forced_eos_token_id
        scalars = tensor_scalars(forced)
        if scalars is None or tensor_dtype(scalars) == "float" or any(s < 0 for s in scalars):
            r.error(
                "forced_eos_token_id",
                e.forced_eos_token_id,
                "`forced_eos_token_id` has to be a non-negative integer token id or a non-empty list of them, "
                f"but is {e.forced_eos_token_id!r}.",
            )
    value = e.exponential_decay_length_penalty
    if value is None:
        return
    # The processor reads `value[0] + prompt_length` and `value[1]`.
    if not (has_field_type("exponential_decay_length_penalty", value) and len(value) >= 2 and is_number(value[0])):
        r.error(
            "exponential_decay_length_penalty",
            value,
            f"`exponential_decay_length_penalty` (={value!r}) must be a pair (start_index: int, decay_factor: float).",
        )
    elif eos is not None and any(v < 0 for v in flatten(eos)):
        r.error(
            "eos_token_id",
            r.cfg.eos_token_id,
            "`exponential_decay_length_penalty` needs non-negative `eos_token_id` values, but `eos_token_id` is "
            f"{r.cfg.eos_token_id!r}. Use the tokenizer's eos token id.",
        )


def check_warpers(r: Recorder, e: Effective) -> None:
    """The warpers, built only when sampling (`if generation_config.do_sample:`, a truthiness test)."""
    if e.num_beams is not None and not is_number(e.num_beams):
        r.error("num_beams", e.num_beams, f"`num_beams` (={e.num_beams!r}) must be a positive integer.")
    t = e.temperature
    if t is not None and t != 1.0 and (not isinstance(t, float) or not t > 0):
        hint = " If you're looking for greedy decoding strategies, set `do_sample=False`." if t == 0 else ""
        r.error(
            "temperature",
            t,
            f"`temperature` (={t!r}) has to be a strictly positive float, otherwise your next token scores will "
            f"be invalid. Write it as a float, e.g. {float_hint(t)}.{hint}",
        )
    if e.top_h is not None and not (has_field_type("top_h", e.top_h) and 0 < e.top_h <= 1):
        r.error("top_h", e.top_h, f"`top_h` (={e.top_h!r}) must be in the range (0, 1].")
    if e.top_k is not None and e.top_k != 0:
        # TopKLogitsWarper keeps max(top_k, min_tokens_to_keep) tokens, and torch.topk refuses a bool k
        # (min_tokens_to_keep is 1 without beams).
        beams = is_number(e.num_beams) and e.num_beams > 1
        if not is_int(e.top_k) or not e.top_k > 0 or (isinstance(e.top_k, bool) and not beams):
            r.error(
                "top_k",
                e.top_k,
                f"`top_k` (={e.top_k!r}) has to be a strictly positive integer (0 disables top-k filtering).",
            )
    for name, low_open in (("top_p", False), ("typical_p", True)):
        value = getattr(e, name)
        if value is None:
            continue
        # Built for values below 1.0, which are then read with float().
        number = as_float(value)
        if not has_field_type(name, value) or (
            value < 1.0 and (number is None or number < 0 or (low_open and number <= 0))
        ):
            bounds = "in (0, 1)" if low_open else "in [0, 1]"
            r.error(name, value, f"`{name}` (={value!r}) has to be a float {bounds} (1.0 disables it).")
    if e.min_p is not None and not (has_field_type("min_p", e.min_p) and 0 <= e.min_p <= 1.0):
        r.error("min_p", e.min_p, f"`min_p` (={e.min_p!r}) has to be a float in the [0, 1] interval.")
    for name in ("epsilon_cutoff", "eta_cutoff"):
        # Built only for values strictly inside (0, 1), so other numbers are accepted (and ignored).
        value = getattr(e, name)
        if value is not None and not has_field_type(name, value):
            r.error(name, value, f"`{name}` (={value!r}) has to be a float in (0, 1) (0.0 disables it).")


_SYNTHID_MAX_NGRAM = 1024
_SYNTHID_MAX_KEYS = 256
_SYNTHID_MAX_HISTORY = 1 << 20


def check_watermark_processor(r: Recorder, wm: dict[str, Any]) -> None:
    """What the watermarking processor's constructor refuses (the dict's keys were checked before)."""
    checks: Iterable[tuple[bool, str]]
    if watermark_kind(wm) == "synthid":
        full = {**SYNTHID_DEFAULTS, **wm}
        keys = tensor_scalars(full["keys"])
        checks = _synthid_checks(full, keys)
    else:
        full = {**WATERMARK_DEFAULTS, **wm}
        ratio = full["greenlist_ratio"]
        checks = (
            (
                is_number(ratio) and 0.0 < ratio < 1.0,
                "`greenlist_ratio` has to be in range between 0.0 and 1.0, exclusively",
            ),
            (is_int(full["hashing_key"]), "`hashing_key` must be an integer"),
            (is_int(full["context_width"]), "`context_width` must be an integer"),
            (is_number(full["bias"]), "`bias` must be a number"),
        )
    for ok, message in checks:
        if not ok:
            r.error("watermarking_config", wm, f"`watermarking_config`: {message}, got {wm!r}.")
            return


def _synthid_checks(full: dict[str, Any], keys: Any) -> Iterator[tuple[bool, str]]:
    """The SynthID checks in order, each evaluated only when the ones before it passed (the caller stops
    at the first failure), so the later bounds can assume integers."""
    yield is_int(full["ngram_len"]) and full["ngram_len"] >= 1, "`ngram_len` must be a positive integer"
    yield (
        keys is not None
        and isinstance(full["keys"], (list, tuple))
        and 0 < len(keys) == len(full["keys"])  # flat
        and tensor_dtype(keys) == "int",
        "`keys` must be a non-empty list of integers",
    )
    yield is_int(full["sampling_table_seed"]), "`sampling_table_seed` must be an integer"
    yield (
        is_int(full["sampling_table_size"]) and full["sampling_table_size"] >= 1,
        "`sampling_table_size` must be a positive integer",
    )
    yield (
        is_int(full["context_history_size"]) and full["context_history_size"] >= 1,
        "`context_history_size` must be a positive integer",
    )
    # specwire's own bounds (transformers has none): the state and g-values are sized by them, so larger
    # values only exhaust memory; keys and seed must fit int64 tensors and a torch.Generator.
    yield full["ngram_len"] <= _SYNTHID_MAX_NGRAM, f"`ngram_len` must be at most {_SYNTHID_MAX_NGRAM}"
    yield (
        len(keys) <= _SYNTHID_MAX_KEYS and all(-(2**63) <= int(k) < 2**63 for k in keys),
        f"`keys` may hold at most {_SYNTHID_MAX_KEYS} keys, each within int64",
    )
    yield (
        full["context_history_size"] <= _SYNTHID_MAX_HISTORY,
        f"`context_history_size` must be at most {_SYNTHID_MAX_HISTORY}",
    )
    yield (
        -(2**63) <= full["sampling_table_seed"] < 2**64,
        "`sampling_table_seed` must fit in 64 bits (a torch.Generator seed)",
    )


def _sequence_bias_problem(bias: Any) -> str | None:
    """Why transformers' SequenceBiasLogitsProcessor refuses `bias`, or None (its `_validate_arguments`)."""
    if not isinstance(bias, (dict, list)) or len(bias) == 0:
        return f"`sequence_bias` has to be a non-empty list of [token_ids, bias] pairs, but is {bias!r}."
    if isinstance(bias, dict):
        if any(not isinstance(key, tuple) for key in bias):
            return f"`sequence_bias` as a dict has to have tuples of token ids as keys, but is {bias!r}."
        if any(len(key) == 0 or not all(is_token_id(t) for t in key) for key in bias):
            return f"Each key of `sequence_bias` has to be a non-empty tuple of non-negative ids: {bias!r}."
        if any(not isinstance(v, float) for v in bias.values()):
            return f"`sequence_bias` biases have to be floats (1.0, not 1), but are {list(bias.values())!r}."
        return _bool_ids_problem("sequence_bias", [list(key) for key in bias])
    for pair in bias:
        valid = (
            isinstance(pair, (list, tuple))
            and len(pair) >= 2
            and isinstance(pair[0], list)
            and all(is_token_id(t) for t in pair[0])
            and isinstance(pair[1], float)
        )
        if not valid:
            return (
                "Each element of `sequence_bias` has to be a pair [list of non-negative token ids, float bias] "
                f"(e.g. [[12, 7], -2.0]), but got {pair!r}."
            )
    return _bool_ids_problem("sequence_bias", [list(pair[0]) for pair in bias])


def _bool_ids_problem(name: str, sequences: list[list[Any]]) -> str | None:
    """The first-call failure of SequenceBiasLogitsProcessor when the ids it indexes with are all bools.

    Last tokens are gathered per group (single tokens; then sequences by prefix length) into a tensor used as
    an index; a tensor of bools is read as a mask and fails.
    """
    groups: dict[int, list[Any]] = {}
    for seq in {tuple(s): None for s in sequences}:
        if seq:
            groups.setdefault(len(seq), []).append(seq[-1])
    for lasts in groups.values():
        if all(isinstance(t, bool) for t in lasts):
            return f"`{name}` token ids must be integers, not booleans: {sequences!r}."
    return None


def _bad_words_problem(bad_words: Any, eos: list[Any] | None) -> str | None:
    """Why transformers' NoBadWordsLogitsProcessor refuses `bad_words` with these eos ids, or None."""
    if not isinstance(bad_words, list) or len(bad_words) == 0:
        return f"`bad_words_ids` has to be a non-empty list of lists of token ids, but is {bad_words!r}."
    if any(not isinstance(word, list) for word in bad_words):
        return f"`bad_words_ids` has to be a list of lists of ids (e.g. [[12], [7, 9]]), but is {bad_words!r}."
    if any(not all(is_token_id(t) for t in word) for word in bad_words):
        return f"Each list in `bad_words_ids` has to be a list of non-negative token ids, but is {bad_words!r}."
    # transformers drops single-token sequences equal to an eos id (eos is never banned), keeps empty ones,
    # and fails on its first call when the ids it indexes with are all bools (torch reads them as a mask).
    kept = bad_words if eos is None else [word for word in bad_words if all(word != [i] for i in eos)]
    return _bool_ids_problem("bad_words_ids", kept)
