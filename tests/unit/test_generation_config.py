"""`specwire.generation.config`: fields, conversions, merging and modes, checked against transformers."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from specwire.generation import config as config_module
from specwire.generation.argument_errors import InvalidGenerationArgument, UnsupportedModeError
from specwire.generation.config import (
    DEFAULT_GENERATION_PARAMS,
    DEPRECATED_FIELDS,
    FIELD_NAMES,
    FIELD_TYPES,
    MODE_FIELDS,
    REMOVED_MODE_FIELDS,
    V4_MODE_FIELDS,
    GenerationConfig,
    GenerationMode,
    Violation,
    check_runnable,
    errors,
    merge,
    raise_for_errors,
)

V456_FIELDS = {
    "num_beam_groups",
    "diversity_penalty",
    "force_words_ids",
    "constraints",
    "penalty_alpha",
    "dola_layers",
    "low_memory",
}

# Configs that survive transformers' own JSON round trip (no compile_config, no SynthID: see below).
ROUND_TRIP_CONFIGS = [
    {},
    {"temperature": 1.0},
    {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "max_new_tokens": 16},
    {"num_beams": 4, "num_return_sequences": 2, "length_penalty": 0.8, "early_stopping": "never"},
    {"stop_strings": ["\n\n", "###"], "eos_token_id": [2, 7], "pad_token_id": 0, "bos_token_id": 1},
    {"bad_words_ids": [[5], [6, 7]], "sequence_bias": [[[5], -1.5], [[8, 9], 2.0]], "suppress_tokens": [3]},
    {"sequence_bias": {(5,): -1.5, (8, 9): 2.0}, "forced_eos_token_id": [2], "begin_suppress_tokens": [4]},
    {"exponential_decay_length_penalty": [5, 1.2], "renormalize_logits": True, "remove_invalid_values": True},
    {"watermarking_config": {"bias": 3.0, "seeding_scheme": "selfhash"}, "do_sample": True},
    {"prompt_lookup_num_tokens": 5, "max_matching_ngram_size": 3, "cache_implementation": "dynamic"},
    {"output_scores": True, "output_logits": True, "return_dict_in_generate": True, "guidance_scale": 1.5},
    {
        "penalty_alpha": 0.6,
        "top_k": 4,
        "constraints": [{"type": "phrasal", "token_ids": [5, 6]}],
        "num_beam_groups": 2,
        "diversity_penalty": 0.5,
        "low_memory": True,
        "dola_layers": "high",
    },
    {"my_custom_flag": [1, 2], "another": {"nested": True}, "max_length": 64, "min_new_tokens": 2},
]


def _ours(data: dict) -> GenerationConfig:
    return GenerationConfig.from_dict(data)


# ----------------------------------------------------------------------------------------------------
# Fields and defaults


def test_fields_are_exactly_transformers_fields_plus_seed():
    theirs = {k for k in vars(transformers.GenerationConfig()) if not k.startswith("_")}
    theirs.discard("transformers_version")
    assert set(FIELD_NAMES) == theirs | {"seed"}
    assert V456_FIELDS <= set(FIELD_NAMES)
    assert set(DEPRECATED_FIELDS) <= set(FIELD_NAMES)


def test_every_field_defaults_to_unset():
    cfg = GenerationConfig()
    assert all(getattr(cfg, name) is None for name in FIELD_NAMES)
    assert cfg.extra == {}
    assert cfg.set_fields() == set()
    assert cfg.to_dict() == {}


def test_default_generation_params_match_installed_transformers():
    assert dict(DEFAULT_GENERATION_PARAMS) == transformers.GenerationConfig._get_default_generation_params()
    with pytest.raises(TypeError):
        DEFAULT_GENERATION_PARAMS["max_length"] = 5  # read-only: shared by every request


def test_with_defaults_fills_only_unset_fields():
    cfg = GenerationConfig(temperature=0.3, max_length=None, num_beams=4)
    filled = cfg.with_defaults()
    assert filled.temperature == 0.3 and filled.num_beams == 4
    assert filled.max_length == 20 and filled.top_k == 50 and filled.do_sample is False
    # Defaults that are None leave the field unset.
    assert filled.bad_words_ids is None and filled.forced_eos_token_id is None
    assert cfg.max_length is None, "with_defaults() must not modify the original"
    assert filled.set_fields() == {k for k, v in DEFAULT_GENERATION_PARAMS.items() if v is not None}


def test_unset_differs_from_default_value():
    explicit = GenerationConfig(temperature=1.0, do_sample=False)
    assert explicit.set_fields() == {"temperature", "do_sample"}
    assert explicit.to_dict() == {"temperature": 1.0, "do_sample": False}
    # The explicit default wins over a model's value in a merge; an unset field does not.
    model = GenerationConfig(temperature=0.6, do_sample=True)
    assert merge(explicit, model).temperature == 1.0
    assert merge(GenerationConfig(), model).temperature == 0.6


# ----------------------------------------------------------------------------------------------------
# Conversions


def test_from_dict_routes_unknown_keys_to_extra_and_drops_metadata():
    cfg = GenerationConfig.from_dict(
        {
            "temperature": 0.5,
            "foo": 1,
            "transformers_version": "5.23.0",
            "_from_model_config": False,
            "_commit_hash": "abc",
            "seed": 7,
        }
    )
    assert cfg.temperature == 0.5 and cfg.seed == 7
    assert cfg.extra == {"foo": 1}
    assert cfg.to_dict() == {"temperature": 0.5, "foo": 1, "seed": 7}


def test_from_dict_drops_custom_entries_of_model_derived_configs_like_transformers():
    data = {"_from_model_config": True, "eos_token_id": 2, "hidden_size": 32}
    ours = GenerationConfig.from_dict(data)
    theirs = transformers.GenerationConfig.from_dict(dict(data))
    assert ours.extra == {} and not hasattr(theirs, "hidden_size")
    assert ours.eos_token_id == theirs.eos_token_id == 2


@pytest.mark.parametrize("data", ROUND_TRIP_CONFIGS)
def test_dict_and_json_round_trips(data):
    ours = _ours(data)
    assert GenerationConfig.from_dict(ours.to_dict()) == ours
    assert GenerationConfig.from_dict(json.loads(ours.to_json_string())) == ours
    assert GenerationConfig.from_json_string(ours.to_json_string()) == ours


@pytest.mark.parametrize("data", ROUND_TRIP_CONFIGS)
def test_json_is_what_transformers_writes(data):
    ours = _ours(data)
    theirs = ours.to_transformers().to_json_string(use_diff=True, ignore_metadata=True)
    assert ours.to_json_string() == theirs


@pytest.mark.parametrize("data", ROUND_TRIP_CONFIGS)
def test_transformers_from_pretrained_round_trip(tmp_path, data):
    ours = _ours(data)
    (tmp_path / "generation_config.json").write_text(ours.to_json_string())
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path)
    expected = ours.to_transformers()
    assert loaded.to_dict() == expected.to_dict()
    assert loaded.to_json_string(use_diff=False) == expected.to_json_string(use_diff=False)
    assert GenerationConfig.from_transformers(loaded) == ours


def test_seed_is_a_custom_entry_for_transformers(tmp_path):
    ours = GenerationConfig(do_sample=True, seed=11)
    assert ours.to_dict() == {"do_sample": True, "seed": 11}
    assert not hasattr(ours.to_transformers(), "seed")
    # A file written by specwire still loads in transformers, which keeps `seed` as an (unused) custom entry,
    # so it survives a trip through transformers.
    (tmp_path / "generation_config.json").write_text(ours.to_json_string())
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert loaded.seed == 11 and loaded.do_sample is True
    assert GenerationConfig.from_transformers(loaded) == ours


@pytest.mark.parametrize("data", ROUND_TRIP_CONFIGS)
def test_transformers_object_round_trip(data):
    ours = _ours(data)
    theirs = ours.to_transformers()
    assert GenerationConfig.from_transformers(theirs) == ours


def test_to_transformers_builds_transformers_objects_and_drops_seed():
    ours = GenerationConfig(
        seed=3,
        watermarking_config={"greenlist_ratio": 0.5},
        compile_config={"fullgraph": True},
        do_sample=True,
    )
    theirs = ours.to_transformers()
    assert not hasattr(theirs, "seed")
    assert isinstance(theirs.watermarking_config, transformers.WatermarkingConfig)
    assert theirs.watermarking_config.greenlist_ratio == 0.5 and theirs.watermarking_config.context_width == 1
    assert isinstance(theirs.compile_config, transformers.CompileConfig) and theirs.compile_config.fullgraph
    synthid = GenerationConfig(watermarking_config={"ngram_len": 5, "keys": [1, 2, 3]}).to_transformers()
    assert isinstance(synthid.watermarking_config, transformers.SynthIDTextWatermarkingConfig)
    assert synthid.watermarking_config.sampling_table_size == 2**16
    back = GenerationConfig.from_transformers(ours.to_transformers())
    assert back.compile_config == {
        "fullgraph": True,
        "dynamic": None,
        "backend": "inductor",
        "mode": "reduce-overhead",
        "options": None,
    }
    assert back.watermarking_config == {
        "greenlist_ratio": 0.5,
        "bias": 2.0,
        "hashing_key": 15485863,
        "seeding_scheme": "lefthash",
        "context_width": 1,
    }


def test_transformers_cannot_read_back_its_own_synthid_or_compile_json(tmp_path):
    """Why ROUND_TRIP_CONFIGS leaves these out: transformers reads any watermarking dict as a
    WatermarkingConfig
    and refuses a compile_config dict, so its own JSON of these configs does not load."""
    synthid = transformers.GenerationConfig(
        watermarking_config=transformers.SynthIDTextWatermarkingConfig(ngram_len=5, keys=[1, 2, 3])
    )
    with pytest.raises(TypeError):
        transformers.GenerationConfig.from_dict(json.loads(synthid.to_json_string()))
    compiled = transformers.GenerationConfig(compile_config=transformers.CompileConfig())
    with pytest.raises(ValueError):
        transformers.GenerationConfig.from_dict(json.loads(compiled.to_json_string()))
    # Ours keeps both as data and reads its JSON back.
    ours = GenerationConfig(watermarking_config={"ngram_len": 5, "keys": [1, 2, 3]}, compile_config={})
    assert GenerationConfig.from_json_string(ours.to_json_string()) == ours


def test_from_transformers_keeps_only_what_was_set(tiny_model_dir):
    assert GenerationConfig.from_transformers(transformers.GenerationConfig()) == GenerationConfig()
    explicit = GenerationConfig.from_transformers(transformers.GenerationConfig(temperature=1.0, top_k=50))
    assert explicit.set_fields() == {"temperature", "top_k"}
    model_config = transformers.GenerationConfig.from_pretrained(tiny_model_dir)
    ours = GenerationConfig.from_transformers(model_config)
    assert ours.to_dict() == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "use_cache": True,
        "output_attentions": False,
        "output_hidden_states": False,
    }


def test_sequence_bias_is_stored_in_list_form():
    as_dict = GenerationConfig(sequence_bias={(5,): -1.0, (6, 7): 2.0})
    as_list = GenerationConfig(sequence_bias=[[[5], -1.0], [[6, 7], 2.0]])
    assert as_dict == as_list
    assert as_dict.sequence_bias == [[[5], -1.0], [[6, 7], 2.0]]
    assert json.loads(as_dict.to_json_string())["sequence_bias"] == [[[5], -1.0], [[6, 7], 2.0]]
    # An empty key cannot convert (the list form would accept it): it stays a dict, and validate() refuses it.
    bad = GenerationConfig(sequence_bias={(): 1.0})
    assert isinstance(bad.sequence_bias, dict)
    assert [v.field for v in errors(bad.validate())] == ["sequence_bias"]


# ----------------------------------------------------------------------------------------------------
# update / merge / copy


def test_update_sets_fields_and_returns_unused_like_transformers():
    kwargs = {"temperature": 0.5, "max_new_tokens": 9, "not_a_field": 1, "attention_mask": None}
    ours = GenerationConfig(do_sample=True)
    theirs = transformers.GenerationConfig(do_sample=True)
    assert ours.update(**kwargs) == theirs.update(**kwargs) == {"not_a_field": 1, "attention_mask": None}
    assert ours.temperature == 0.5 and ours.max_new_tokens == 9 and "not_a_field" not in ours.extra
    assert ours.update(temperature=None, seed=4) == {}
    assert ours.temperature is None and ours.seed == 4
    ours.update(sequence_bias={(3,): 1.0})
    assert ours.sequence_bias == [[[3], 1.0]]


def test_merge_first_layer_wins_and_layers_are_untouched():
    overrides = GenerationConfig(max_new_tokens=5, extra={"a": 1})
    request = GenerationConfig(max_new_tokens=50, temperature=0.2, extra={"a": 2, "b": 2})
    model = GenerationConfig(temperature=0.9, top_p=0.8, eos_token_id=[2], extra={"c": 3})
    merged = merge(overrides, None, request, model)
    assert merged.max_new_tokens == 5 and merged.temperature == 0.2 and merged.top_p == 0.8
    assert merged.eos_token_id == [2] and merged.extra == {"a": 1, "b": 2, "c": 3}
    merged.eos_token_id.append(9)
    merged.extra["a"] = 0
    assert model.eos_token_id == [2] and overrides.extra == {"a": 1}
    assert merge() == GenerationConfig()


@pytest.mark.parametrize(
    "request_data",
    [
        {},
        {"temperature": 0.5, "do_sample": True},
        {"max_new_tokens": 3, "eos_token_id": [2, 5], "foo": 1},
        {"num_beams": 3, "length_penalty": 2.0, "pad_token_id": 7},
    ],
)
def test_merge_then_defaults_equals_transformers_prepare_generation_config(tiny_model_dir, request_data):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prepared, _ = model._prepare_generation_config(transformers.GenerationConfig(**request_data))
    ours = merge(_ours(request_data), GenerationConfig.from_transformers(model.generation_config)).with_defaults()
    assert ours == GenerationConfig.from_transformers(prepared)


def test_copy_is_deep():
    cfg = GenerationConfig(bad_words_ids=[[5]], extra={"x": [1]})
    clone = cfg.copy()
    clone.bad_words_ids[0].append(6)
    clone.extra["x"].append(2)
    assert cfg.bad_words_ids == [[5]] and cfg.extra == {"x": [1]}
    assert clone != cfg


# ----------------------------------------------------------------------------------------------------
# Generation modes

MODE_TABLE = [
    {},
    {"do_sample": False},
    {"do_sample": True},
    {"num_beams": 1},
    {"num_beams": 3},
    {"num_beams": 3, "do_sample": True},
    {"num_beams": 4, "num_beam_groups": 2},
    {"num_beams": 4, "num_beam_groups": 1},
    {"num_beams": 4, "num_beam_groups": 2, "do_sample": True},
    {"penalty_alpha": 0.6, "top_k": 4},
    {"penalty_alpha": 0.6, "top_k": 1},
    {"penalty_alpha": 0.0, "top_k": 4},
    {"penalty_alpha": 0.6},
    {"penalty_alpha": 0.6, "top_k": 4, "do_sample": True},
    {"constraints": [{"type": "phrasal", "token_ids": [1]}]},
    {"force_words_ids": [[1]], "do_sample": True},
    {"prompt_lookup_num_tokens": 5},
    {"prompt_lookup_num_tokens": 5, "do_sample": True},
    {"prompt_lookup_num_tokens": 5, "num_beams": 2},
    {"assistant_early_exit": 2},
    {"use_mtp": True},
    {"use_mtp": False},
    {"dola_layers": "high"},
    {"dola_layers": [1, 2], "do_sample": True},
    {"dola_layers": "low", "num_beams": 2},
    {"dola_layers": "high", "prompt_lookup_num_tokens": 3},
    {"do_sample": 1},
    {"num_beams": 2.0},
    {"num_beams": 0},
]


@pytest.mark.parametrize("data", MODE_TABLE, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "empty")
def test_generation_mode_matches_transformers(data):
    ours = _ours(data).get_generation_mode()
    theirs = transformers.GenerationConfig(**data).get_generation_mode()
    assert isinstance(ours, GenerationMode)
    assert ours == theirs and ours.value == theirs.value


def test_generation_mode_values_are_transformers_values():
    assert {m.value for m in GenerationMode} == {m.value for m in transformers.generation.GenerationMode}
    assert GenerationMode("beam_sample") is GenerationMode.BEAM_SAMPLE and GenerationMode.SAMPLE == "sample"


# ----------------------------------------------------------------------------------------------------
# validate()


def test_valid_configs_have_no_violations():
    for data in (
        {},
        {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
        {"num_beams": 4, "num_return_sequences": 4},
    ):
        assert _ours(data).validate() == []


def test_error_messages_name_the_field_and_the_fix():
    (violation,) = GenerationConfig(do_sample=True, temperature=0.0).validate()
    assert violation == Violation(violation.field, 0.0, violation.message, "error")
    assert violation.field == "temperature"
    assert "strictly positive float" in violation.message and "do_sample=False" in violation.message
    (violation,) = GenerationConfig(do_sample=True, temperature=2).validate()
    assert "2.0" in violation.message  # the float spelling to use instead
    with pytest.raises(AttributeError):
        violation.field = "x"  # frozen


def test_epsilon_above_one_is_accepted_because_transformers_never_builds_the_warper():
    assert errors(GenerationConfig(do_sample=True, epsilon_cutoff=1.5).validate()) == []
    assert errors(GenerationConfig(do_sample=True, top_p=1.5).validate()) == []
    assert [v.field for v in errors(GenerationConfig(do_sample=True, top_p=-0.1).validate())] == ["top_p"]


def test_sampling_flags_without_sampling_are_warnings_and_strict_makes_them_errors():
    cfg = GenerationConfig(temperature=0.0, top_p=0.5)
    relaxed = cfg.validate()
    assert [(v.field, v.severity) for v in relaxed] == [("temperature", "warning"), ("top_p", "warning")]
    strict = cfg.validate(strict=True)
    assert [(v.field, v.severity) for v in strict] == [("temperature", "error"), ("top_p", "error")]
    with pytest.raises(ValueError):
        transformers.GenerationConfig(temperature=0.0, top_p=0.5).validate(strict=True)


@pytest.mark.parametrize(
    ("data", "fieldname"),
    [
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),
        ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5}, "num_beam_groups"),
        ({"constraints": [{"type": "phrasal", "token_ids": [5]}]}, "constraints"),
        ({"force_words_ids": [[5]]}, "force_words_ids"),
        ({"dola_layers": "high"}, "dola_layers"),
    ],
)
def test_removed_modes_are_warnings_naming_the_field(data, fieldname):
    found = _ours(data).validate()
    assert errors(found) == []
    (named,) = [v for v in found if v.field == fieldname]
    assert named.severity == "warning" and _ours(data).get_generation_mode().value in named.message


def test_low_memory_is_an_error_only_with_beam_search():
    assert errors(GenerationConfig(low_memory=True).validate()) == []
    assert [v.field for v in errors(GenerationConfig(low_memory=True, num_beams=2).validate())] == ["low_memory"]


def test_validate_assumes_model_eos_unless_set():
    # transformers drops eos ids from bad_words_ids; with eos unknown, nothing is dropped.
    assert errors(GenerationConfig(bad_words_ids=[[True]]).validate())
    assert not errors(GenerationConfig(bad_words_ids=[[True], [5]]).validate())
    assert not errors(GenerationConfig(exponential_decay_length_penalty=(4, 1.1)).validate())
    assert errors(GenerationConfig(exponential_decay_length_penalty=(4, 1.1), eos_token_id=-1).validate())


JUNK = [
    object(),
    "x",
    b"x",
    -(10**30),
    math.nan,
    [object()],
    {"a": object()},
    [[[]]],
    {(): ()},
    (1, "a"),
    True,
]


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_validate_never_raises_and_never_mutates(name):
    for junk in JUNK:
        for base in ({}, {"do_sample": True}, {"num_beams": 2}, {"prompt_lookup_num_tokens": 2}):
            cfg = GenerationConfig(**base)
            setattr(cfg, name, junk)
            before = repr(cfg)
            found = cfg.validate()
            found_strict = cfg.validate(strict=True)
            assert repr(cfg) == before
            assert all(isinstance(v, Violation) for v in found)
            assert len(found) == len(found_strict)
            assert all(v.field != "<config>" for v in found), found


def test_generate_arguments_in_extra_are_errors():
    (violation,) = errors(GenerationConfig.from_dict({"streamer": None}).validate())
    assert violation.field == "streamer"
    assert errors(GenerationConfig.from_dict({"my_flag": 1}).validate()) == []


def test_errors_helper_filters_by_severity():
    found = GenerationConfig(do_sample=True, top_k=-1, length_penalty=2.0).validate()
    assert [v.severity for v in found] == ["warning", "error"]
    assert errors(found) == [found[1]]


def test_mode_table_is_the_one_list_of_removed_and_deprecated_fields():
    assert set(DEPRECATED_FIELDS) == {row.field for row in MODE_FIELDS}
    # Every drafting method transformers 5.23 runs is served (speculation_type="dflash" with --dflash-model).
    assert "speculation_type" not in DEPRECATED_FIELDS and "use_mtp" not in DEPRECATED_FIELDS
    # Each field the table ties to a removed mode selects that mode under transformers' rules.
    selecting = {
        "penalty_alpha": {"penalty_alpha": 0.6, "top_k": 4},
        "dola_layers": {"dola_layers": "high"},
        "num_beam_groups": {"num_beam_groups": 2, "num_beams": 4},
        "constraints": {"constraints": [{"type": "phrasal", "token_ids": [5]}]},
        "force_words_ids": {"force_words_ids": [[5]]},
    }
    tied = {
        name: mode for table in (REMOVED_MODE_FIELDS, V4_MODE_FIELDS) for mode, names in table.items() for name in names
    }
    assert set(tied) == set(selecting)
    for name, data in selecting.items():
        assert transformers.GenerationConfig(**data).get_generation_mode().value == tied[name].value


def test_field_types_come_from_the_annotations():
    assert set(FIELD_TYPES) == set(FIELD_NAMES)
    assert FIELD_TYPES["temperature"] == (int, float)  # a float field takes ints too
    assert FIELD_TYPES["num_beams"] == (int,)
    assert FIELD_TYPES["eos_token_id"] == (int, list)
    assert FIELD_TYPES["stop_strings"] == (str, list)
    assert FIELD_TYPES["exponential_decay_length_penalty"] == (tuple, list)


def test_raise_for_errors_lists_every_error_and_ignores_warnings():
    found = GenerationConfig(do_sample=True, top_k=-1, temperature=0.0, length_penalty=2.0).validate()
    with pytest.raises(InvalidGenerationArgument) as caught:
        raise_for_errors(found, field_prefix="config.", summary="invalid generation config")
    error = caught.value
    assert isinstance(error, ValueError) and error.code == "INVALID_ARGUMENT"
    assert [p.field for p in error.violations] == ["config.temperature", "config.top_k"]
    assert error.message.startswith("invalid generation config: config.temperature=0.0: `temperature` (=0.0)")
    assert "config.top_k=-1: `top_k` (=-1) has to be a strictly positive integer" in error.message
    raise_for_errors([v for v in found if v.severity == "warning"])  # warnings alone raise nothing


@pytest.mark.parametrize(
    ("data", "fieldname"),
    [
        ({"num_beams": 4, "num_beam_groups": 2}, "diversity_penalty"),
        ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.0}, "diversity_penalty"),
        ({"num_beams": 5, "num_beam_groups": 2, "diversity_penalty": 1.0}, "num_beam_groups"),
        ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "do_sample": True}, "do_sample"),
        ({"penalty_alpha": 0.6, "use_cache": False}, "use_cache"),
        ({"penalty_alpha": 0.6, "top_k": 4, "prefill_chunk_size": 4}, "prefill_chunk_size"),
        ({"penalty_alpha": 0.6, "cache_implementation": "static"}, "cache_implementation"),
        ({"penalty_alpha": 0.6, "return_dict_in_generate": True, "output_hidden_states": True}, "output_hidden_states"),
        ({"dola_layers": "middle"}, "dola_layers"),
        ({"dola_layers": [0, "1"]}, "dola_layers"),
    ],
)
def test_v4_modes_are_refused_where_they_cannot_run(data, fieldname):
    with pytest.raises(InvalidGenerationArgument) as caught:
        check_runnable(GenerationConfig(**data))
    assert [p.field for p in caught.value.violations] == [fieldname]
    assert fieldname in str(caught.value)


def test_group_beam_search_runs_with_a_warning_that_transformers_5_moved_it_out():
    config = GenerationConfig(num_beams=4, num_beam_groups=2, diversity_penalty=1.0)
    check_runnable(config)
    warned = {v.field: v.message for v in config.validate() if v.severity == "warning"}
    assert "4.55.4" in warned["num_beam_groups"] and "4.55.4" in warned["diversity_penalty"]


@pytest.mark.parametrize(("penalty", "warned"), [(None, True), (1.0, True), (1.19, True), (1.2, False), (1.5, False)])
def test_dola_warns_below_the_recommended_repetition_penalty(penalty, warned):
    config = GenerationConfig(dola_layers="low", repetition_penalty=penalty)
    check_runnable(config)
    found = [v for v in config.validate() if v.field == "repetition_penalty"]
    assert bool(found) == warned and all(v.severity == "warning" and "1.2" in v.message for v in found)
    # Only DoLa has that rule (with beams dola_layers has no effect).
    assert not [
        v for v in GenerationConfig(dola_layers="low", num_beams=2).validate() if v.field == "repetition_penalty"
    ]


def test_check_runnable_refuses_what_the_decoding_loop_cannot_run():
    with pytest.raises(UnsupportedModeError) as caught:
        check_runnable(GenerationConfig(num_beams=2, low_memory=True))
    assert caught.value.field == "low_memory" and caught.value.code == "UNIMPLEMENTED"
    # Constrained beam search runs (transformers 4.55.4's semantics); its rules are INVALID_ARGUMENT.
    assert check_runnable(GenerationConfig(num_beams=2, force_words_ids=[[5]])).get_generation_mode().value == (
        "constrained_beam_search"
    )
    for bad, field in (
        ({"force_words_ids": [[5]]}, "num_beams"),
        ({"num_beams": 2, "force_words_ids": [[5]], "do_sample": True}, "do_sample"),
        ({"num_beams": 2, "force_words_ids": [[[5], [5, 6]]]}, "force_words_ids"),
        ({"num_beams": 2, "force_words_ids": [[-1]]}, "force_words_ids"),
        ({"num_beams": 2, "constraints": [{"type": "phrasal", "token_ids": []}]}, "constraints"),
        ({"num_beams": 2, "constraints": [{"kind": "phrasal"}]}, "constraints"),
    ):
        with pytest.raises(InvalidGenerationArgument) as invalid:
            check_runnable(GenerationConfig(**bad))
        assert field in [v.field for v in invalid.value.violations], bad
    # Contrastive search with the default top_k=50 runs (transformers 4.55.4's semantics).
    assert check_runnable(GenerationConfig(penalty_alpha=0.6)).get_generation_mode().value == "contrastive_search"
    with pytest.raises(InvalidGenerationArgument, match="temperature"):
        check_runnable(GenerationConfig(do_sample=True, temperature=0.0))
    # transformers runs no return sequences without beams (one row per prompt); the loop refuses it.
    assert errors(GenerationConfig(num_return_sequences=0).validate()) == []
    with pytest.raises(InvalidGenerationArgument, match=r"`num_return_sequences` \(=0\) must be a positive integer"):
        check_runnable(GenerationConfig(num_return_sequences=0))
    resolved = check_runnable(GenerationConfig(do_sample=True, temperature=0.5))
    assert (resolved.temperature, resolved.top_k, resolved.max_length) == (0.5, 50, 20)


# ----------------------------------------------------------------------------------------------------
# Layering


def test_module_imports_neither_torch_transformers_grpc_nor_protobuf():
    path = Path(config_module.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cfg', {str(path)!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['cfg'] = mod; "
        "spec.loader.exec_module(mod)\n"
        "mod.GenerationConfig(do_sample=True, temperature=0.0).validate()\n"
        "bad = [m for m in ('torch', 'transformers', 'grpc', 'google.protobuf') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert importlib.util.find_spec("specwire.generation.config") is not None
