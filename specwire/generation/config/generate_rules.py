"""The rules of `generate()` up to its first decoding step (utils.py, stopping_criteria.py), in its order:
mode resolution, special tokens, row expansion, lengths, processors (`processor_rules`), stopping criteria
and the decoding methods' own checks.

Values are compared only after a type test, so no rule evaluates an expression that could raise.
"""

from __future__ import annotations

from typing import Any

from specwire.generation.config.modes import GenerationMode, assisted_requested, generation_mode
from specwire.generation.config.processor_rules import check_logits_processors
from specwire.generation.config.value_types import as_list, eos_ids, flatten, is_int, is_number, tensor_scalars
from specwire.generation.config.violations import Effective, Recorder

__all__ = ["check_generate"]

_ASSISTED_TRIGGERS = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


def check_generate(r: Recorder) -> None:
    """Everything `generate()` refuses or warns about from the config alone, in its order."""
    c = r.cfg
    e = Effective(c)
    if (e.num_beams is None or e.num_beams == 1) and e.do_sample is not True and e.top_k is not None:
        # get_generation_mode() compares top_k with 1 (contrastive search test) outside sampling.
        if not is_number(e.top_k):
            r.error("top_k", c.top_k, f"`top_k` (={c.top_k!r}) has to be an integer (0 disables it).")
    mode = generation_mode(e, assisted_triggers=True)
    check_assisted_triggers(r, e, mode)
    eos = check_special_tokens_and_rows(r, e)
    check_lengths(r, e)
    check_logits_processors(r, e, eos)
    check_stopping_criteria(r, e)
    check_decoding(r, e, mode)


def check_assisted_triggers(r: Recorder, e: Effective, mode: GenerationMode) -> None:
    """get_generation_mode() and _validate_generation_mode() on the assisted-generation flags."""
    c = r.cfg
    # Assisted triggers with a beam mode are logged and ignored.
    plain_mode = generation_mode(e, assisted_triggers=False)
    if assisted_requested(e) and plain_mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        for name in _ASSISTED_TRIGGERS:
            value = getattr(c, name)
            if value is not None and (name != "use_mtp" or value):
                r.warn(
                    name,
                    value,
                    f"`{name}` triggers assisted generation, which only supports greedy search and sampling; with "
                    f"the current flags (mode {plain_mode.value}) it is ignored. Set `num_beams=1` or unset it.",
                )
    nrs = e.num_return_sequences
    if mode == GenerationMode.ASSISTED_GENERATION and is_number(nrs) and nrs > 1:
        r.error(
            "num_return_sequences",
            c.num_return_sequences,
            f"`num_return_sequences` has to be 1 when doing assisted generation, but is {nrs}. Unset the "
            "assisted-generation flags or return one sequence.",
        )


def check_special_tokens_and_rows(r: Recorder, e: Effective) -> list[Any] | None:
    """_prepare_special_tokens() and _expand_inputs_for_generation().

    Returns:
        `list`, *optional*: the eos ids as transformers holds them (`None` when unset or not convertible).
    """
    c = r.cfg
    # Special token ids become int64 tensors.
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = getattr(c, name)
        if value is not None and tensor_scalars(value, as_long=True) is None:
            r.error(name, value, f"`{name}` (={value!r}) must be an integer token id (or a list of ids).")
    eos = eos_ids(c.eos_token_id) if c.eos_token_id is not None else None
    if eos is not None and any(v < 0 for v in flatten(eos)):
        r.warn(
            "eos_token_id",
            c.eos_token_id,
            f"`eos_token_id` should consist of positive integers, but is {c.eos_token_id!r}. Generation will not stop "
            "until the maximum length is reached, and other flags may make it crash. Use the tokenizer's eos token id.",
        )
    # Rows are repeated max(num_beams, num_return_sequences) times.
    beams, nrs = e.num_beams, e.num_return_sequences
    culprit = None
    if not is_number(beams):
        culprit = "num_beams"
    elif not is_number(nrs):
        culprit = "num_return_sequences"
    else:
        expand = max(beams, nrs)
        if not is_int(expand) or expand < 0:
            culprit = "num_beams" if expand is beams else "num_return_sequences"
    if culprit is not None:
        r.error(
            culprit,
            getattr(c, culprit),
            f"`{culprit}` (={getattr(e, culprit)!r}) must be a positive integer (inputs are repeated "
            "max(num_beams, num_return_sequences) times).",
        )
    return eos


def check_lengths(r: Recorder, e: Effective) -> None:
    """_prepare_generated_length() / _validate_generated_length().

    Lengths are added to and compared with the prompt length. Whether the prompt fits (prompt length >=
    max_length) is not a config error.
    """
    c = r.cfg
    if e.max_new_tokens is None and c.max_length is not None and not is_number(c.max_length):
        r.error("max_length", c.max_length, f"`max_length` (={c.max_length!r}) must be an integer number of tokens.")
    if e.min_new_tokens is not None:
        if not is_number(e.min_new_tokens):
            r.error(
                "min_new_tokens",
                e.min_new_tokens,
                f"`min_new_tokens` (={e.min_new_tokens!r}) must be a non-negative integer.",
            )
    elif e.min_length is not None and not is_number(e.min_length):
        r.error("min_length", e.min_length, f"`min_length` (={e.min_length!r}) must be a non-negative integer.")


def check_stopping_criteria(r: Recorder, e: Effective) -> None:
    """_get_stopping_criteria(), and the criteria's first call."""
    if e.max_time is not None and not is_number(e.max_time):
        r.error("max_time", e.max_time, f"`max_time` (={e.max_time!r}) must be a number of seconds.")
    if e.stop_strings is not None:
        value = e.stop_strings
        items = [value] if isinstance(value, str) else as_list(value)
        if items is None or not items or not all(isinstance(s, str) for s in items):
            r.error(
                "stop_strings", value, f"`stop_strings` (={value!r}) must be a string or a non-empty list of strings."
            )
    threshold = e.assistant_confidence_threshold
    if e.is_assistant and threshold is not None:
        if not is_number(threshold):
            r.error(
                "assistant_confidence_threshold",
                threshold,
                f"`assistant_confidence_threshold` (={threshold!r}) must be a float.",
            )
        elif threshold > 0:
            # ConfidenceCriteria reads the draft's scores, which only exist inside assisted decoding.
            r.error(
                "is_assistant",
                e.is_assistant,
                "`is_assistant=True` marks the config of a draft model inside assisted generation; with "
                "`assistant_confidence_threshold` > 0 a stand-alone generate() fails. Unset `is_assistant`.",
            )


def check_decoding(r: Recorder, e: Effective, mode: GenerationMode) -> None:
    """Checks of the decoding methods (_prefill, _beam_search, _assisted_decoding) up to the first step."""
    c = r.cfg
    chunked = mode != GenerationMode.ASSISTED_GENERATION or e.assistant_early_exit is not None
    if e.prefill_chunk_size is not None and chunked:
        # Prefill chunking happens in _sample and _beam_search: not in assisted decoding, but in the
        # early-exit draft's own generate().
        size = e.prefill_chunk_size
        if not is_int(size) or isinstance(size, bool) or size <= 0:
            r.error(
                "prefill_chunk_size",
                c.prefill_chunk_size,
                f"`prefill_chunk_size` (={c.prefill_chunk_size!r}) must be a positive number of tokens.",
            )
        elif not e.use_cache:
            r.error(
                "prefill_chunk_size",
                c.prefill_chunk_size,
                "Prefill chunking needs the KV cache: set `use_cache=True` or unset prefill_chunk_size.",
            )
    if mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE):
        check_beam_search(r, e)
    if mode == GenerationMode.ASSISTED_GENERATION:
        check_assisted_decoding(r, e)


def check_beam_search(r: Recorder, e: Effective) -> None:
    """_beam_search(): buffers, padding of finished beams, and the returned hypotheses."""
    c = r.cfg
    # Beam search allocates [batch, beams, max_length] buffers, so the final length must be an int.
    if is_number(e.max_new_tokens) and not is_int(e.max_new_tokens):
        r.error(
            "max_new_tokens",
            c.max_new_tokens,
            f"`max_new_tokens` (={c.max_new_tokens!r}) must be an integer with beam search.",
        )
    elif e.max_new_tokens is None and is_number(c.max_length) and not is_int(c.max_length):
        r.error("max_length", c.max_length, f"`max_length` (={c.max_length!r}) must be an integer with beam search.")
    # Finished beams are padded with `pad_token_id or eos_token_id[0]`.
    eos = eos_ids(e.eos_token_id) if e.eos_token_id is not None else None
    pad = eos_ids(e.pad_token_id) if e.pad_token_id is not None else None
    pad_is_zero = pad is not None and len(pad) == 1 and pad[0] == 0
    if eos is not None and pad_is_zero and (not eos or isinstance(eos[0], list)):
        r.error(
            "eos_token_id",
            c.eos_token_id,
            f"`eos_token_id` (={c.eos_token_id!r}) must be a token id or a flat non-empty id list: beam search "
            "pads finished beams with the first eos id when `pad_token_id` is 0.",
        )
    if is_int(e.num_beams) and e.num_beams <= 0:
        r.error("num_beams", e.num_beams, f"`num_beams` (={e.num_beams!r}) must be a positive integer (1 = no beams).")
    if e.low_memory:
        r.error(
            "low_memory",
            e.low_memory,
            "`low_memory=True` is not supported by beam search since transformers v5. Unset it.",
        )
    if not is_int(e.num_return_sequences) or e.num_return_sequences == 0:
        # Beam search returns its best `num_return_sequences` hypotheses by slicing.
        r.error(
            "num_return_sequences",
            c.num_return_sequences,
            f"`num_return_sequences` (={e.num_return_sequences!r}) must be a positive integer.",
        )
    if e.length_penalty is not None and not is_number(e.length_penalty):
        r.error(
            "length_penalty",
            c.length_penalty,
            f"`length_penalty` (={e.length_penalty!r}) must be a float: beam scores are divided by length ** "
            "length_penalty.",
        )


def check_assisted_decoding(r: Recorder, e: Effective) -> None:
    """_assisted_decoding(): the cache it needs, and the prompt-lookup candidate generator."""
    c = r.cfg
    if e.assistant_early_exit is not None:
        check_early_exit(r, e)
    if not e.use_cache:
        r.error(
            "use_cache", c.use_cache, "Assisted generation (prompt lookup, early exit, MTP) requires `use_cache=True`."
        )
    elif e.cache_implementation in ("static", "hybrid", "sliding_window"):
        r.error(
            "cache_implementation",
            c.cache_implementation,
            f"Assisted generation does not support static caches (`cache_implementation={e.cache_implementation!r}`). "
            "Unset `cache_implementation`.",
        )
    elif e.assistant_early_exit is None and e.prompt_lookup_num_tokens is not None:
        if e.assistant_ensemble_weight is not None:
            r.error(
                "assistant_ensemble_weight",
                c.assistant_ensemble_weight,
                "`assistant_ensemble_weight` requires candidate logits from an assistant model; it is not "
                "supported with prompt lookup decoding. Unset it.",
            )
            return
        ngram = e.max_matching_ngram_size or 2
        if is_number(ngram) and not is_int(ngram):
            # The n-gram sizes to try are a range().
            r.error(
                "max_matching_ngram_size",
                c.max_matching_ngram_size,
                f"`max_matching_ngram_size` (={ngram!r}) must be a positive integer.",
            )
        for name, value in (
            ("max_matching_ngram_size", ngram),
            ("prompt_lookup_num_tokens", e.prompt_lookup_num_tokens),
        ):
            if not is_number(value) or value <= 0:
                r.error(name, getattr(c, name), f"`{name}` (={value!r}) must be a positive integer.")


def check_early_exit(r: Recorder, e: Effective) -> None:
    """The early-exit draft: the model itself with `num_hidden_layers` set to `assistant_early_exit`, running its
    own generate() with the same flags but without a tokenizer."""
    c = r.cfg
    if not is_int(e.assistant_early_exit) or e.assistant_early_exit < 0:
        r.error(
            "assistant_early_exit",
            c.assistant_early_exit,
            f"`assistant_early_exit` (={c.assistant_early_exit!r}) must be a non-negative layer count.",
        )
    for name, used in (("stop_strings", e.stop_strings is not None), ("token_healing", bool(e.token_healing))):
        if used:
            r.error(
                name,
                getattr(c, name),
                f"`{name}` cannot be combined with `assistant_early_exit`: the early-exit draft generates without a "
                "tokenizer. Unset one of them.",
            )
