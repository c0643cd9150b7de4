"""Bad generation input is refused before decoding, as INVALID_ARGUMENT/UNIMPLEMENTED naming the field."""

from __future__ import annotations

import pytest
import torch
import transformers

from specwire.errors import InvalidArgument
from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.config import GenerationConfig, is_synthid_watermark
from specwire.generation.loops.generate import generate
from specwire.generation.planning import check_token_ids, prepare_generation
from specwire.wire.generation_config import WireFormatError, config_from_proto, config_to_proto
from specwire.wire.json_documents import MAX_JSON_DEPTH, json_depth, parse_json_document


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


PROMPT = torch.tensor([[5, 6, 7]])


@pytest.mark.parametrize(
    ("field", "value", "bad", "extra"),
    [
        ("bad_words_ids", [[5], [7, 400]], 400, {}),
        ("sequence_bias", [[[1000], -2.0]], 1000, {}),
        ("sequence_bias", {(3, 378): 1.0}, 378, {}),
        ("eos_token_id", [2, 378], 378, {"min_new_tokens": 1}),
        ("eos_token_id", 400, 400, {"exponential_decay_length_penalty": (1, 1.1)}),
        ("pad_token_id", 500, 500, {"num_beams": 2}),
        ("forced_bos_token_id", 378, 378, {}),
        ("forced_eos_token_id", [999], 999, {}),
        ("suppress_tokens", [1, 2, 4000], 4000, {}),
        ("begin_suppress_tokens", [378], 378, {}),
    ],
)
def test_ids_past_the_vocabulary_are_refused_before_the_first_forward(model, field, value, bad, extra):
    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(InvalidGenerationArgument) as caught:
            generate(model, PROMPT, config=GenerationConfig(max_new_tokens=2, **{field: value}, **extra))
    finally:
        hook.remove()
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, InvalidArgument)  # transformers-like, and servable
    assert [v.field for v in error.violations] == [field]
    assert f"token id {bad} is outside this model's vocabulary of 378 ids" in error.message
    assert calls == []


def test_prompt_ids_past_the_vocabulary_are_refused(model):
    with pytest.raises(InvalidGenerationArgument, match=r"input_ids=378: token ids must be in \[0, 378\)"):
        prepare_generation(model, torch.tensor([[5, 378]]), config=GenerationConfig(max_new_tokens=2))
    with pytest.raises(InvalidGenerationArgument, match="input_ids=-1"):
        prepare_generation(model, torch.tensor([[-1, 5]]), config=GenerationConfig(max_new_tokens=2))


def test_special_ids_past_the_vocabulary_pass_where_transformers_never_indexes_with_them(model):
    """An EOS id no processor indexes with, and a pad id with a single row, work as in transformers."""
    config = GenerationConfig(max_new_tokens=3, eos_token_id=[2, 400], pad_token_id=500)
    ours = generate(model, PROMPT, config=config)
    theirs = model.generate(PROMPT, max_new_tokens=3, do_sample=False, eos_token_id=[2, 400], pad_token_id=500)
    assert torch.equal(ours.sequences, theirs)


def test_ids_inside_the_vocabulary_pass(model):
    check_token_ids(GenerationConfig(bad_words_ids=[[377]], sequence_bias=[[[0, 377], 1.0]], eos_token_id=[2]), 378)
    out = generate(model, PROMPT, config=GenerationConfig(max_new_tokens=3, bad_words_ids=[[377]]))
    assert out.sequences.shape == (1, 6)


def test_synthid_watermark_runs_and_its_unservable_sizes_are_refused(model):
    synthid = {"ngram_len": 2, "keys": [4, 5, 6]}
    assert is_synthid_watermark(synthid) and not is_synthid_watermark({"greenlist_ratio": 0.25})
    assert not any(v.severity == "error" for v in GenerationConfig(watermarking_config=synthid).validate())
    out = generate(model, PROMPT, config=GenerationConfig(max_new_tokens=2, watermarking_config=synthid))
    assert out.sequences.shape == (1, 5)
    for bad, words in [
        ({"ngram_len": 2**40, "keys": [1]}, "ngram_len` must be at most"),
        ({"ngram_len": 2, "keys": [[1, 2]]}, "non-empty list of integers"),
        ({"ngram_len": 2, "keys": list(range(300))}, "at most 256 keys"),
        ({"ngram_len": 2, "keys": [1], "context_history_size": 2**30}, "context_history_size` must be at most"),
        ({"ngram_len": 2, "keys": [1], "sampling_table_seed": 2**70}, "fit in 64 bits"),
    ]:
        (error,) = [v for v in GenerationConfig(watermarking_config=bad).validate() if v.severity == "error"]
        assert error.field == "watermarking_config" and words in error.message, error


# ------------------------------------------------------------------------------------------ wire


def test_unknown_early_stopping_enum_value_is_a_wire_format_error():
    message = config_to_proto(GenerationConfig(early_stopping=True))
    message.early_stopping = 42  # a value a newer (or hand-written) client could send
    with pytest.raises(WireFormatError) as caught:
        config_from_proto(message)
    assert caught.value.field == "early_stopping" and caught.value.value == 42


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 3000, 200_000])
def test_parse_json_document_refuses_deep_nesting(depth):
    with pytest.raises(InvalidArgument) as caught:
        parse_json_document('{"a": ' + "[" * depth + "]" * depth + "}", "json")
    assert [v.field for v in caught.value.violations] == ["json"]
    assert f"at most {MAX_JSON_DEPTH}" in caught.value.message


def test_parse_json_document_accepts_configs_and_reports_bad_json():
    text = '{"max_new_tokens": 3, "sequence_bias": [[[1, 2], -1.0]], "extra": {"a": {"b": [1]}}}'
    assert parse_json_document(text, "json")["sequence_bias"] == [[[1, 2], -1.0]]
    assert json_depth(parse_json_document(text, "json")) == 4
    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [[]]}) == 3
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_json_document('{"a": ', "hub")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_json_document("1" * 5000, "json")  # past Python's int-string conversion limit


# ------------------------------------------------------------------------------------------ error size


def test_errors_echoing_huge_values_fit_the_response_metadata():
    """Clients refuse trailing metadata above 8-16 KB: an error echoing 1000 stop strings (or 70 bad
    fields with long messages) must still arrive as itself, not as RESOURCE_EXHAUSTED from the channel."""
    from specwire.errors import FieldProblem, InvalidArgument
    from specwire.serving import error_status

    huge = [f"stop-string-number-{i}" for i in range(1000)]
    single = InvalidArgument.for_field("stop_strings", huge, "no token can end these; drop them")
    many = InvalidArgument(
        "invalid generation config: " + "; ".join(f"f{i}={huge!r}" for i in range(70)),
        [FieldProblem(f"config.f{i}", huge, "x" * 5000 + " set it to 1") for i in range(70)],
    )
    for error in (single, many):
        code, message, metadata = error_status(error)
        size = len(message) + sum(len(k) + len(v) for k, v in metadata)
        assert size < 8192, size
    assert single.message.startswith("stop_strings=['stop-string-number-0'") and "drop them" in single.message
    assert len(many.violations) == 6 and "64 more problems not listed" in many.message
    assert many.violations[0].message.endswith("set it to 1")  # cut in the middle, the fix is kept


def test_a_deeply_nested_value_is_echoed_without_recursion_error():
    from specwire.errors import InvalidArgument

    deep: list = []
    for _ in range(50_000):
        deep = [deep]
    error = InvalidArgument.for_field("extra.x", deep, "too deep")
    assert len(error.message) < 200 and repr(error.violations[0].value).startswith("[[[")
    short = InvalidArgument.for_field("top_k", 0, "must be positive")
    assert short.violations[0].value == 0 and short.message == "top_k=0: must be positive"


# ------------------------------------------------------------------------------------------ configs on the wire


def test_extra_cannot_smuggle_a_typed_field_past_its_wire_type():
    from specwire.config.v1 import generation_config_pb2 as gc_pb

    message = gc_pb.GenerationConfig()
    message.extra.update({"bos_token_id": 1e15, "my_key": 1, "extra": None})
    with pytest.raises(WireFormatError) as caught:
        config_from_proto(message)
    assert caught.value.field == "extra.bos_token_id"
    message.extra.Clear()
    message.extra.update({"my_key": 1, "extra": None})
    assert config_from_proto(message).extra == {"my_key": 1, "extra": None}


def test_non_finite_numbers_in_structs_read_back():
    """`json_format.MessageToDict` raises on NaN/inf; a stored config holding one must stay readable."""
    config = GenerationConfig.from_dict({"watermarking_config": {"bias": float("inf")}, "custom": float("nan")})
    back = config_from_proto(config_to_proto(config))
    assert back.watermarking_config["bias"] == float("inf") and back.extra["custom"] != back.extra["custom"]


@pytest.mark.parametrize(
    "values",
    [{"bos_token_id": 10**15}, {"remove_invalid_values": 10**29}, {"assistant_confidence_threshold": []}],
)
def test_configs_the_wire_cannot_carry_are_invalid_argument(values):
    from specwire.wire.generation_config import config_to_proto_or_invalid

    name = next(iter(values))
    with pytest.raises(InvalidArgument) as caught:
        config_to_proto_or_invalid(GenerationConfig.from_dict(values), "json")
    assert [v.field for v in caught.value.violations] == [f"json.{name}"]
