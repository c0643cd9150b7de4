"""Validation battery: `GenerationConfig.validate()` against the installed transformers, config by config.

For every config of a generated battery, transformers *refuses* it when
`transformers.GenerationConfig(**kwargs)` raises, or when `model.generate()` on a tiny random Llama raises
while it resolves the mode, special tokens and lengths, builds processors and stopping criteria, and runs the
first decoding step (a stopping criterion ends generation after one token). Ours refuses it when `validate()`
on the config merged with the model's generation config (what the target service validates) returns an error.
The verdicts must agree for every config.

Conventions that keep the verdict about the config alone:
- the tokenizer is passed, so `stop_strings` and `token_healing` are judged on their values;
- "prompt length >= max_length" (a property of the prompt) counts as accepted;
- fields that select modes v5 moved to the Hub (`constraints`, `force_words_ids`, `penalty_alpha`,
  `dola_layers`, `num_beam_groups`) are removed before `generate()`: transformers refuses those modes (it
  wants `trust_remote_code`), specwire answers UNIMPLEMENTED, and the rest of the config must still be right;
- watermarking dicts become `WatermarkingConfig` or, with SynthID keys, `SynthIDTextWatermarkingConfig`
objects
  and compile configs `CompileConfig` objects, as `GenerationConfig.to_transformers()` builds them;
- token ids stay inside the tiny vocabulary, and values whose failure depends on the environment (cache
backends,
  devices, MTP heads) are left out.

For accepted configs, transformers' warnings (the "minor issues" of its `validate()`, `max_cache_len`, ignored
assisted-generation flags, negative eos ids) must be exactly our warnings, apart from our warnings on
`DEPRECATED_FIELDS`.
"""

from __future__ import annotations

import ast
import logging
import math
import warnings

import pytest
import torch

from specwire.generation.config import (
    DEPRECATED_FIELDS,
    REMOVED_MODE_FIELDS,
    V4_MODE_FIELDS,
    GenerationConfig,
    errors,
    merge,
)

PROMPT = [[1, 5, 6]]
# The modes transformers 5 no longer runs in core (refused by specwire, or run with 4.55.4's semantics).
_REMOVED_MODE_FIELDS = tuple(
    name for table in (REMOVED_MODE_FIELDS, V4_MODE_FIELDS) for names in table.values() for name in names
)
_SYNTHID_KEYS = {
    "ngram_len",
    "keys",
    "context_history_size",
    "sampling_table_seed",
    "sampling_table_size",
    "skip_first_ngram_calls",
    "debug_mode",
}

# ----------------------------------------------------------------------------------------------------
# The battery


def _battery() -> list[dict]:
    cases: list[dict] = [{}, {"do_sample": False}, {"do_sample": True}, {"num_beams": 2}]

    def add(**kw):
        cases.append(kw)

    samplings = ({}, {"do_sample": True}, {"do_sample": False})
    # Sampling warpers: every value alone, with sampling on, and with sampling explicitly off.
    warper_values = {
        "temperature": [0.0, 0, 1, 2, 1.0, 0.5, -0.5, 1e-5, "0.7", True, math.inf, math.nan],
        "top_k": [0, -1, 1, 50, 50.0, 0.0, 10, "5", True, 3.5],
        "top_p": [0.0, 0, 1, 1.0, 1.5, -0.1, 0.9, "0.9", True, False],
        "typical_p": [0.0, 0, 0.5, 1.0, 1, 1.5, -0.5],
        "min_p": [0.0, 0, 0.1, 1.0, 1, 1.5, -0.1, "0.1"],
        "top_h": [0.0, 0.5, 1.0, 1, 1.5, -0.1, "0.5"],
        "epsilon_cutoff": [0.0, 3e-4, 1.0, 1, 1.5, -0.1, "0.1"],
        "eta_cutoff": [0.0, 3e-4, 1.0, 1.5, -0.1, "0.1"],
    }
    for name, values in warper_values.items():
        for value in values:
            for sampling in samplings:
                add(**sampling, **{name: value})
    # Sampling with beams (min_tokens_to_keep > 1) and a sampling mode set by a non-bool.
    for value in (0.5, 0, 2):
        add(do_sample=True, num_beams=2, temperature=value)
    add(do_sample=1, temperature=0.0)
    add(do_sample="yes", top_k=-1)

    for name in ("repetition_penalty", "encoder_repetition_penalty"):
        for value in (1.0, 1, 1.2, 2, 0.0, -1.0, 0.5, "1.2", True):
            add(**{name: value})
    for name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size"):
        for value in (0, 1, 3, -1, 2.0, 2.5, "2", True):
            add(**{name: value})

    for beams in ({}, {"num_beams": 2}):
        for value in (1.0, 2.0, -1.0, 1, "x"):
            add(**beams, length_penalty=value)
        for value in (True, False, "never", "always", 1, 0, 1.0, [True]):
            add(**beams, early_stopping=value)
    for value in (0, -1, 1, 2, 4, 2.0, True, "2"):
        add(num_beams=value)
        add(num_beams=value, do_sample=True)
    for nrs in (0, 1, 2, 3, 2.0, 1.0, -1, "2"):
        for strategy in (
            {},
            {"do_sample": True},
            {"num_beams": 2},
            {"num_beams": 4},
            {"num_beams": 3, "do_sample": True},
        ):
            add(**strategy, num_return_sequences=nrs)

    for value in (0, -1, 1, 5, 2.5, "5"):
        add(max_new_tokens=value)
    for value in (0, 2, 3, 4, 10, 4.5, "10", -1, [10]):
        add(max_length=value)
        add(max_length=value, max_new_tokens=3)
    for value in (0, 2, -1, 2.5, "2", 30, True):
        add(min_length=value)
    for value in (0, 2, -2, 2.5, -0.5, 1.0, "2", True, 30):
        add(min_new_tokens=value)
    add(min_new_tokens=2, min_length="x")
    for value in (1.0, 0, -1, "1", 10, True, [1.0]):
        add(max_time=value)
    for value in ("a", "", [], ["ab"], ["ab", ""], [1], ("ab",), "\u2603", ["x", 2], 5):
        add(stop_strings=value)

    for value in (
        [[5]],
        [[5, 6]],
        [],
        [5],
        [[-1]],
        [[5.0]],
        [[]],
        [[2]],
        [[2], [5]],
        [[2], [2]],
        ((5,),),
        [(5,)],
        [["a"]],
        "5",
        [[True]],
        [[5], []],
        [[2, 3]],
        [[True], [5]],
        [[5, True]],
        [[True], [2]],
    ):
        add(bad_words_ids=value)
    add(bad_words_ids=[[3]], eos_token_id=3)
    add(bad_words_ids=[[3]], eos_token_id=[3, 2])
    add(bad_words_ids=[[2]], eos_token_id=4)
    add(bad_words_ids=[[3], [4]], eos_token_id=[3, 4])

    for value in (
        {(5,): 1.0},
        {(5,): 1},
        {(5, 6): -1.0},
        {(): 1.0},
        {5: 1.0},
        {(-1,): 1.0},
        {(5,): 1.0, (6, 7): 2.0},
        [[[5], 1.0]],
        [[[5], 1]],
        [[5, 1.0]],
        [[(5,), 1.0]],
        [],
        {},
        [[[], 1.0]],
        "x",
        [[[5.0], 1.0]],
        [[[5], 1.0], [[6, 7], -2.0]],
        [[[5]]],
        {(5,): -math.inf},
        [[[5], 1.0], []],
        {("a",): 1.0},
        {(True,): 1.0},
        [[[True], 1.0], [[5], 1.0]],
        [[[5, True], 1.0]],
    ):
        add(sequence_bias=value)

    for value in (1, 5, -1, 1.5, "1"):
        add(forced_bos_token_id=value)
    for value in (2, [2, 3], [], -1, [2.0], 2.5, True, "2", [[2]], [2, -1], (2, 3)):
        add(forced_eos_token_id=value)
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        for value in ([5], [], [5.5], ["a"], 5, [[5]], [[5], [6, 7]], (5, 6), "5", [-1]):
            add(**{name: value})
    add(suppress_tokens=[2], forced_eos_token_id=2)
    add(suppress_tokens=[2, 3], forced_eos_token_id=[2, 3])
    add(suppress_tokens=[2], forced_eos_token_id=[2, 3])
    add(suppress_tokens=[1], forced_bos_token_id=1)
    add(suppress_tokens=[1], forced_bos_token_id=1.5)
    add(suppress_tokens=[1], forced_bos_token_id=[1])
    add(suppress_tokens=[1], forced_eos_token_id=[])
    add(begin_suppress_tokens=[5], forced_bos_token_id=1)

    for value in (
        (5, 1.5),
        [5, 1.5],
        [5],
        5,
        (5.5, 1.2),
        ("a", 1.5),
        (5, "a"),
        (-5, 1.5),
        [5, 1.5, 0],
        [],
        "ab",
    ):
        add(exponential_decay_length_penalty=value)
    add(exponential_decay_length_penalty=(5, 1.5), eos_token_id=-1)
    add(exponential_decay_length_penalty=(5, 1.5), eos_token_id=[2, -3])
    add(exponential_decay_length_penalty=(5, 1.5), eos_token_id=2.5)

    for name, values in {
        "pad_token_id": (0, -1, 5, 1.5, "a", -1.5, [0]),
        "eos_token_id": (2, [2, 3], -1, [2, -1], 2.5, [], "a", [[2, 3]], [[2], [3, 4]], -0.5, math.nan, 1e30),
        "bos_token_id": (1, "a", 1.5, -1),
        "decoder_start_token_id": (0, "a", [0]),
    }.items():
        for value in values:
            add(**{name: value})

    for name, value in (
        ("renormalize_logits", True),
        ("renormalize_logits", False),
        ("remove_invalid_values", True),
        ("guidance_scale", 1.5),
        ("guidance_scale", 1),
        ("guidance_scale", 0.5),
        ("token_healing", True),
        ("num_assistant_tokens", 5),
        ("num_assistant_tokens_schedule", "heuristic"),
        ("disable_compile", True),
        ("prefill_chunk_size", 2),
        ("assistant_lookbehind", 3),
        ("target_lookbehind", 3),
        ("is_assistant", True),
        ("use_mtp", False),
        ("speculation_type", None),
    ):
        add(**{name: value})
    for value in (2, 0, -1, 1.5, True, 1):
        add(prefill_chunk_size=value)
        add(prefill_chunk_size=value, use_cache=False)
    add(token_healing=True, assistant_early_exit=1)
    for value in (0, -1, 5, 1.5, "a"):
        add(assistant_early_exit=value)
    for extra in (
        {"stop_strings": "a"},
        {"guidance_scale": 1},
        {"max_time": 5.0},
        {"do_sample": True, "temperature": 0.5},
        {"sequence_bias": [[[5], 1.0]]},
    ):
        add(assistant_early_exit=1, **extra)
        add(prompt_lookup_num_tokens=2, **extra)
    for value in (2.5, True):
        add(prompt_lookup_num_tokens=value)
    add(prompt_lookup_num_tokens=2, max_matching_ngram_size=1.5)
    add(token_healing=True, prompt_lookup_num_tokens=2)
    for length in ({"max_length": 4.5}, {"max_new_tokens": 2.5}, {"max_length": 8}):
        add(**length, num_beams=2)
        add(**length, num_beams=2, do_sample=True)
    add(eos_token_id=[], num_beams=2)
    add(eos_token_id=[[2, 3]], num_beams=2)
    add(eos_token_id=[[2, 3]], num_beams=2, pad_token_id=5)
    add(prefill_chunk_size=-1, prompt_lookup_num_tokens=2)
    add(prefill_chunk_size=True, prompt_lookup_num_tokens=2, use_cache=True)
    add(prefill_chunk_size=0, assistant_early_exit=1)
    add(eos_token_id=[], num_beams=2, pad_token_id=5)
    add(eos_token_id=[], pad_token_id=5)
    add(max_length=2, max_time="1")
    add(max_length=3, top_k=0, do_sample=False)
    add(is_assistant=True, assistant_confidence_threshold="a")
    add(is_assistant=True, assistant_confidence_threshold=0.0)
    add(is_assistant=False, assistant_confidence_threshold="a")

    for value in (
        {},
        {"bias": 3.0},
        {"seeding_scheme": "selfhash"},
        {"seeding_scheme": "x"},
        {"greenlist_ratio": 0.0},
        {"greenlist_ratio": 1.0},
        {"greenlist_ratio": 1.5},
        {"greenlist_ratio": 0.5},
        {"context_width": 0},
        {"context_width": 2},
        {"context_width": 1.5},
        {"hashing_key": 1.5},
        {"bias": "a"},
        {"bias": 1},
        {"unknown": 1},
        {"greenlist_ratio": "a"},
        {"ngram_len": 2, "keys": [3, 4, 5]},
        {"ngram_len": 2},
        {"keys": [1, 2]},
        {"ngram_len": 2, "keys": [3, 4], "sampling_table_size": 2**25},
        {"ngram_len": 2, "keys": [3, 4], "foo": 1},
        {"ngram_len": 2, "keys": [3, 4], "sampling_table_seed": 1.5},
    ):
        add(watermarking_config=value)
        add(watermarking_config=value, do_sample=True)

    for cache in ({}, {"use_cache": False}, {"use_cache": True}):
        add(**cache, cache_implementation="static")
        add(**cache, cache_implementation="dynamic")
        add(**cache, cache_config={"foo": 1})
    for value in ("foo", "paged", "hybrid", 5):
        add(cache_implementation=value)
    add(max_cache_len=8)
    add(max_cache_len=8, cache_implementation="static")
    add(max_cache_len=8, cache_implementation="dynamic")

    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        add(**{flag: True})
        add(**{flag: True}, return_dict_in_generate=True)
        add(**{flag: False})

    for value in ({}, {"fullgraph": True}, {"foo": 1}):
        add(compile_config=value)

    for value in (3, 0, -1, 1):
        add(prompt_lookup_num_tokens=value)
    add(prompt_lookup_num_tokens=3, do_sample=True)
    add(prompt_lookup_num_tokens=3, do_sample=True, num_return_sequences=2)
    add(prompt_lookup_num_tokens=3, use_cache=False)
    add(prompt_lookup_num_tokens=3, cache_implementation="static")
    add(prompt_lookup_num_tokens=3, assistant_ensemble_weight=0.5)
    add(prompt_lookup_num_tokens=3, max_matching_ngram_size=0)
    add(prompt_lookup_num_tokens=3, max_matching_ngram_size=-1)
    add(prompt_lookup_num_tokens=3, max_matching_ngram_size=4)
    add(prompt_lookup_num_tokens=3, num_beams=2)
    add(prompt_lookup_num_tokens=3, num_beams=2, use_cache=False)
    add(assistant_early_exit=1)
    add(assistant_early_exit=1, assistant_ensemble_weight=0.5)
    for value in (0.0, 1.0, 0.5, -0.5, "0.5"):
        add(assistant_ensemble_weight=value)

    # v4.56 fields: removed modes are warnings; the remaining flags are still checked.
    add(penalty_alpha=0.6, top_k=4)
    add(penalty_alpha=0.6, top_k=4, temperature=0.0, do_sample=True)
    add(penalty_alpha=0.6, do_sample=True)
    add(penalty_alpha=0.6, top_k=1)
    add(dola_layers="high")
    add(dola_layers="high", num_beams=2)
    add(dola_layers=[2], repetition_penalty=1)
    add(num_beam_groups=2, num_beams=4, diversity_penalty=1.0)
    add(num_beam_groups=2, num_beams=4, num_return_sequences=5)
    add(num_beam_groups=2)
    add(diversity_penalty=1.0)
    add(constraints=[{"type": "phrasal", "token_ids": [5, 6]}])
    add(constraints=[{"type": "phrasal", "token_ids": [5, 6]}], do_sample=True, temperature=0.0)
    add(force_words_ids=[[5]])
    add(force_words_ids=[[5]], num_beams=2, bad_words_ids=[])
    add(low_memory=True)
    add(low_memory=True, num_beams=2)
    add(low_memory=True, num_beams=2, do_sample=True)
    add(low_memory=False, num_beams=2)

    # Custom entries, and generate() arguments misplaced in a config.
    cases.append({"my_custom_flag": 1})
    cases.append({"streamer": None})
    cases.append({"logits_processor": []})

    # Realistic combinations.
    add(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.1, max_new_tokens=8)
    add(do_sample=True, temperature=0.7, top_p=0.95, min_p=0.05, num_return_sequences=3, seed=3)
    add(num_beams=4, num_return_sequences=2, length_penalty=0.8, early_stopping=True, no_repeat_ngram_size=2)
    add(num_beams=3, do_sample=True, top_k=0, top_p=0.0, max_new_tokens=4)
    add(stop_strings=["fox", "dog"], eos_token_id=[2, 3], max_new_tokens=6, bad_words_ids=[[7, 8]])
    add(do_sample=False, temperature=0.0, top_p=0.5, top_k=0, num_beams=1, early_stopping=True)
    add(max_new_tokens=4, min_new_tokens=2, min_length=3, forced_eos_token_id=2, suppress_tokens=[9])
    return cases


CASES = _battery()


def _case_id(index: int, case: dict) -> str:
    text = ",".join(f"{k}={v!r}" for k, v in case.items()) or "empty"
    return f"{index:03d}:{text[:80]}"


# ----------------------------------------------------------------------------------------------------
# The transformers oracle


class _StopAfterFirstToken:
    """A stopping criterion that ends generation after the first decoding step (cheap, and every processor and
    criterion has run once)."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _transformers_kwargs(case: dict) -> dict:
    import transformers

    kwargs = dict(case)
    kwargs.pop("seed", None)  # specwire's own field
    wm = kwargs.get("watermarking_config")
    if isinstance(wm, dict):
        if _SYNTHID_KEYS & set(wm):
            kwargs["watermarking_config"] = transformers.SynthIDTextWatermarkingConfig(**wm)
        else:
            kwargs["watermarking_config"] = transformers.WatermarkingConfig(**wm)
    if isinstance(kwargs.get("compile_config"), dict):
        kwargs["compile_config"] = transformers.CompileConfig(**kwargs["compile_config"])
    return kwargs


def _warned_fields(messages: list[str], case: dict) -> set[str]:
    fields: set[str] = set()
    for message in messages:
        if "The following generation flags are not valid and may be ignored:" in message:
            listed = message.split("ignored:", 1)[1].split("]", 1)[0] + "]"
            fields.update(ast.literal_eval(listed.strip()))
        elif message.startswith("`max_cache_len` is only used with static caches"):
            fields.add("max_cache_len")
        elif message.startswith("You've set `assistant_model` or `use_mtp`"):
            triggers = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")
            fields.update(k for k in triggers if case.get(k) is not None and (k != "use_mtp" or case[k]))
        elif message.startswith("`eos_token_id` should consist of positive integers"):
            fields.add("eos_token_id")
    return fields


def transformers_verdict(model, tokenizer, case: dict) -> tuple[bool, str, set[str]]:
    """(refused, why, warned fields) for `case` according to the installed transformers."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()
    capture = _Capture()
    loggers = [
        logging.getLogger("transformers.generation.configuration_utils"),
        logging.getLogger("transformers.generation.utils"),
    ]
    for logger in loggers:
        logger.addHandler(capture)
    # transformers' early-exit drafting shrinks `num_hidden_layers` and does not restore it when it raises.
    num_layers = model.config.num_hidden_layers
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = transformers.GenerationConfig(**_transformers_kwargs(case))
            except Exception as exc:  # noqa: BLE001 -- any exception is a refusal
                return True, f"GenerationConfig(): {type(exc).__name__}: {exc}", set()
            for name in _REMOVED_MODE_FIELDS:
                setattr(config, name, None)
            input_ids = torch.tensor(PROMPT)
            torch.manual_seed(0)
            for attempt in range(2):
                try:
                    model.generate(
                        input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        generation_config=config,
                        tokenizer=tokenizer,
                        stopping_criteria=transformers.StoppingCriteriaList([_StopAfterFirstToken()]),
                    )
                    break
                except Exception as exc:  # noqa: BLE001 -- any exception is a refusal, but the prompt-length one
                    if attempt == 0 and str(exc).startswith("Input length of input_ids is"):
                        # The prompt does not fit in `max_length`: a property of the prompt. Judge the rest of
                        # the config with a `max_length` of the same type that fits.
                        fitting = len(PROMPT[0]) + 7
                        config.max_length = fitting + 0.5 if isinstance(config.max_length, float) else fitting
                        continue
                    return True, f"generate(): {type(exc).__name__}: {exc}", set()
        return False, "accepted", _warned_fields(capture.messages, case)
    finally:
        model.config.num_hidden_layers = num_layers
        for logger in loggers:
            logger.removeHandler(capture)


# ----------------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model_config = GenerationConfig.from_transformers(model.generation_config)
    return model, tokenizer, model_config


def test_battery_is_large_and_diverse():
    assert len(CASES) >= 300
    fields = {key for case in CASES for key in case}
    for name in (
        "temperature",
        "sequence_bias",
        "bad_words_ids",
        "stop_strings",
        "watermarking_config",
        "num_return_sequences",
        "forced_eos_token_id",
        "exponential_decay_length_penalty",
    ):
        assert name in fields


@pytest.mark.parametrize("case", CASES, ids=[_case_id(i, c) for i, c in enumerate(CASES)])
def test_validate_agrees_with_transformers(tiny, case):
    model, tokenizer, model_config = tiny
    refused, why, tf_warned = transformers_verdict(model, tokenizer, case)

    ours = GenerationConfig.from_dict(case)
    found = merge(ours, model_config).validate()
    our_errors = errors(found)
    assert bool(our_errors) == refused, (
        f"transformers {'refuses' if refused else 'accepts'} {case!r} ({why}); specwire errors: {our_errors!r}"
    )
    if refused:
        return
    our_warned = {v.field for v in ours.validate() if v.severity == "warning"}
    assert tf_warned <= our_warned, f"transformers warned about {tf_warned - our_warned} for {case!r}"
    # DoLa, which specwire runs with transformers 4.55.4's semantics, keeps that release's repetition-penalty rule.
    v4_rules = {"repetition_penalty"} if case.get("dola_layers") is not None else set()
    assert our_warned - tf_warned <= set(DEPRECATED_FIELDS) | v4_rules, (
        f"specwire warned about {our_warned - tf_warned} for {case!r}, transformers did not"
    )


@pytest.mark.parametrize("case", [c for c in CASES if c][:120], ids=lambda c: ",".join(c)[:60])
def test_strict_turns_warnings_into_errors(case):
    ours = GenerationConfig.from_dict(case)
    relaxed = ours.validate()
    strict = ours.validate(strict=True)
    assert [(v.field, v.message) for v in relaxed] == [(v.field, v.message) for v in strict]
    assert all(v.severity == "error" for v in strict)
