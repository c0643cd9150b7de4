"""Every GenerationConfig field is honoured, warned about or refused (`FIELD_TREATMENT`), so no field
the service accepts can be dropped silently: a new field fails here until it is given a row; an
honoured field must appear in a test that shows its effect, a warned one gets its warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from specwire.generation.config import FIELD_NAMES, FIELD_TREATMENT, GenerationConfig, Treatment, not_honoured

ROOT = Path(__file__).resolve().parents[2]

# Tests that run a generation and compare its effect (parity with transformers, or known values).
EFFECT_TESTS = [
    "tests/parity/test_decoding_parity.py",
    "tests/parity/test_no_prompt_and_defaults.py",
    "tests/parity/test_model_outputs.py",
    "tests/parity/test_static_cache.py",
    "tests/parity/test_compiled_decoding.py",
    "tests/parity/test_v4_goldens.py",
    "tests/parity/test_token_healing.py",
    "tests/unit/test_processors_parity.py",
    "tests/unit/processor_cases.py",
    "tests/unit/test_processors_known_values.py",
    "tests/unit/test_stopping.py",
    "tests/unit/test_schedules.py",
    "tests/unit/test_prompt_lookup.py",
    "tests/service/test_speculation.py",
    "tests/service/test_ensemble_speculation.py",
    "tests/service/test_early_exit.py",
    "tests/service/test_mtp.py",
    "tests/service/test_dflash.py",
    "tests/service/test_target_service.py",
]

# A value each warned field is warned about (not one of its honoured values).
WARNED_VALUES = {
    "cache_implementation": "offloaded",
    "cache_config": {"max_batch_size": 1},
    "max_cache_len": 64,
    "compile_config": {"fullgraph": True},  # without a static cache
    "decoder_start_token_id": 0,
    "assistant_lookbehind": 5,
    "target_lookbehind": 5,
}


def test_every_field_has_a_treatment():
    missing = [name for name in FIELD_NAMES if name not in FIELD_TREATMENT]
    assert not missing, f"give these GenerationConfig fields a row in treatment.FIELD_TREATMENT: {missing}"
    assert set(FIELD_TREATMENT) <= set(FIELD_NAMES)


@pytest.mark.parametrize("name", [n for n, row in FIELD_TREATMENT.items() if row.how is Treatment.HONOURED])
def test_an_honoured_field_is_exercised_by_an_effect_test(name):
    sources = {path: (ROOT / path).read_text() for path in EFFECT_TESTS if (ROOT / path).exists()}
    assert any(name in text for text in sources.values()), f"{name} is marked honoured but no effect test sets it"


def test_the_warned_values_cover_every_warned_field():
    assert set(WARNED_VALUES) == {n for n, row in FIELD_TREATMENT.items() if row.how is Treatment.WARNED}


@pytest.mark.parametrize("name", sorted(WARNED_VALUES))
def test_a_warned_field_is_named_with_its_value(name):
    (warning,) = not_honoured(GenerationConfig(**{name: WARNED_VALUES[name]}))
    assert warning.field == name and warning.severity == "warning"
    assert warning.value == GenerationConfig(**{name: WARNED_VALUES[name]}).__dict__[name]
    assert warning.message.startswith("not honoured: ")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"output_attentions": True},
        {"cache_implementation": "dynamic"},
        {"cache_implementation": "static", "max_cache_len": 64},
        {"cache_implementation": "sliding_window", "max_cache_len": 64},
        {"cache_implementation": "hybrid"},
        {"disable_compile": True},
        {"disable_compile": False},
        {"cache_implementation": "static", "compile_config": {"fullgraph": True}},
    ],
)
def test_honoured_values_are_not_warned_about(kwargs):
    assert not_honoured(GenerationConfig(**kwargs)) == []


def test_the_cache_warning_names_the_value():
    (warning,) = not_honoured(GenerationConfig(cache_implementation="quantized"))
    assert "'quantized'" in warning.message


def test_a_compile_config_that_compilation_disables_is_a_warning():
    config = GenerationConfig(cache_implementation="static", compile_config={"fullgraph": True}, disable_compile=True)
    (warning,) = not_honoured(config)
    assert warning.field == "compile_config" and "disable_compile=True" in warning.message
