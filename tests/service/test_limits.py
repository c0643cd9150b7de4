"""Request limits on a real target server (tiny random Llama): every limit refuses with INVALID_ARGUMENT
naming the field, the value, the limit and the fix, before any model work; `GetModelInfo` reports them;
a request that sets no length is clipped to `max_model_len`; the server's message size limit holds."""

from __future__ import annotations

import grpc
import pytest
import torch

from specwire.client import SpecwireRpcError, TargetClient
from specwire.models import load_model
from specwire.target_service.__main__ import build_parser, build_server, limits_from_args
from specwire.target_service.limits import RequestLimits
from tests.servers import threaded_server

LIMITS = dict(
    max_model_len=64,
    max_new_tokens=40,
    max_request_rows=8,
    max_prompts=4,
    max_beams=4,
    max_stop_strings=3,
    max_stop_string_chars=10,
    max_bias_entries=10,
    max_output_bytes=200_000,
    max_prompt_chars=300,
)
MAX_MESSAGE_BYTES = 1024 * 1024


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def server(loaded):
    limits = RequestLimits.for_model(loaded.max_position_embeddings, **LIMITS)
    with threaded_server(lambda: build_server(loaded, limits=limits, max_message_bytes=MAX_MESSAGE_BYTES)) as running:
        yield running


@pytest.fixture
def target(server):
    with TargetClient(server.address) as client:
        yield client


def prompt(length: int, rows: int = 1) -> torch.Tensor:
    return torch.arange(5, 5 + length).repeat(rows, 1)


def refused(target: TargetClient, *args, **kwargs) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        target.generate(*args, **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    return info.value


def fields(error: SpecwireRpcError) -> set[str]:
    return {v.field for v in error.violations}


def test_model_info_reports_the_limits_in_force(target, loaded):
    limits = target.request_limits()
    for name, value in LIMITS.items():
        assert getattr(limits, name) == value, name
    assert limits.max_message_bytes == MAX_MESSAGE_BYTES
    assert target.model_info().max_position_embeddings == loaded.max_position_embeddings == 256


def test_defaults_follow_the_model_and_the_message_size(loaded):
    args = build_parser().parse_args([])
    limits = limits_from_args(args, loaded.max_position_embeddings)
    assert limits.max_model_len == 256 and limits.max_new_tokens is None
    assert limits.max_output_bytes == 12 * 1024 * 1024 < args.max_message_bytes == 16 * 1024 * 1024
    with pytest.raises(ValueError, match="max_position_embeddings 256"):
        limits_from_args(build_parser().parse_args(["--max-model-len", "300"]), 256)
    with pytest.raises(ValueError, match="--max-message-bytes"):
        limits_from_args(build_parser().parse_args(["--max-output-bytes", str(32 * 2**20)]), 256)


def test_prompt_plus_new_tokens_above_max_model_len_names_both_fields(target):
    error = refused(target, prompt(30), max_new_tokens=35)
    assert fields(error) == {"prompts", "config.max_new_tokens"}
    assert "max_model_len is 64" in error.message and "65" in error.message
    assert "max_new_tokens <= 34" in error.message  # the fix
    error = refused(target, prompt(30), max_length=70)
    assert fields(error) == {"prompts", "config.max_length"}
    # The same lengths inside the limit run.
    out = target.generate(prompt(30), max_new_tokens=34, min_new_tokens=34)
    assert out.sequences.shape[1] == 64


def test_prompt_alone_at_max_model_len_is_refused_before_tokenizing(target):
    error = refused(target, prompt(64))
    assert fields(error) == {"prompts[0].token_ids"}
    assert "at most 63 prompt tokens" in error.message
    # Text that tokenizes past the limit is refused once tokenized.
    error = refused(target, text="ab " * 90)
    assert fields(error) == {"prompts"} and "max_model_len is 64" in error.message


def test_a_request_that_sets_no_length_is_clipped_to_max_model_len(target):
    # transformers' default of 20 new tokens applies first: 50 + 20 > 64, so it stops at 64.
    out = target.generate(prompt(50), min_new_tokens=30)
    assert out.sequences.shape[1] == 64
    # Inside the limit the default is untouched: 20 new tokens.
    assert target.generate(prompt(10), min_new_tokens=30).sequences.shape[1] == 30


def test_max_new_tokens_cap(target):
    error = refused(target, prompt(5), max_new_tokens=41)
    assert fields(error) == {"config.max_new_tokens"}
    assert "--max-new-tokens" in error.message and "max_new_tokens <= 40" in error.message
    # The int32 extreme of the wire is refused, not run until a deadline.
    assert fields(refused(target, prompt(5), max_new_tokens=2**31 - 1)) >= {"config.max_new_tokens"}


def test_rows_beams_and_prompts(target):
    error = refused(target, prompt(4, rows=3), num_return_sequences=3, do_sample=True)
    assert "9 rows" in error.message and "--max-request-rows" in error.message
    assert fields(error) == {"prompts", "config.num_return_sequences"}
    error = refused(target, prompt(4), num_beams=5)
    assert fields(error) == {"config.num_beams"} and "--max-beams" in error.message
    error = refused(target, prompt(4), num_return_sequences=9, do_sample=True)
    assert fields(error) == {"config.num_return_sequences"}
    error = refused(target, prompt(4, rows=5), max_new_tokens=2)
    assert fields(error) == {"prompts"} and "at most 4 prompts" in error.message
    # At the limits it runs: 2 prompts x 4 beams = 8 rows.
    assert target.generate(prompt(4, rows=2), num_beams=4, max_new_tokens=3).sequences.shape[0] == 2


def test_stop_strings_count_and_length(target):
    error = refused(target, prompt(4), max_new_tokens=3, stop_strings=["a", "b", "c", "d"])
    assert fields(error) == {"config.stop_strings"} and "--max-stop-strings" in error.message
    error = refused(target, prompt(4), max_new_tokens=3, stop_strings=["ok", "x" * 11])
    assert fields(error) == {"config.stop_strings[1]"} and "--max-stop-string-chars" in error.message
    assert target.generate(prompt(4), max_new_tokens=3, stop_strings=["ok", "x" * 10]).sequences.shape[0] == 1


def test_bias_entries_count_every_list(target):
    kw = dict(max_new_tokens=3, sequence_bias=[[[5, 6, 7], 1.0]], bad_words_ids=[[8, 9], [10, 11]])
    assert target.generate(prompt(4), **kw).sequences.shape[0] == 1  # 7 token ids
    error = refused(target, prompt(4), **{**kw, "bad_words_ids": [[8, 9], [10, 11], [12, 13], [14, 15]]})
    assert fields(error) == {"config.sequence_bias", "config.bad_words_ids"}
    assert "11 token ids" in error.message and "--max-bias-entries" in error.message


def test_output_budget_is_computed_before_decoding(target, loaded):
    rows, vocab = 3, loaded.vocab_size
    steps = 200_000 // (rows * 2 * 4 * vocab)  # scores + logits of 3 rows fit for this many steps
    assert 1 < steps < LIMITS["max_new_tokens"]
    kw = dict(output_scores=True, output_logits=True, return_dict_in_generate=True)
    error = refused(target, prompt(4, rows), max_new_tokens=steps + 1, **kw)
    assert fields(error) == {"config.output_scores", "config.output_logits"}
    assert f"max_new_tokens <= {steps}" in error.message and "--max-output-bytes" in error.message
    out = target.generate(prompt(4, rows), max_new_tokens=steps, min_new_tokens=steps, **kw)
    assert len(out.scores) == len(out.logits) == steps
    # One tensor takes half the budget.
    kw.pop("output_logits")
    assert len(target.generate(prompt(4, rows), max_new_tokens=steps + 1, **kw).scores) <= steps + 1


def test_prompt_text_capped_in_characters_before_tokenization(target):
    error = refused(target, text=["a" * 200, "b" * 101])
    assert fields(error) == {"prompts"}
    assert "301 characters" in error.message and "--max-prompt-chars" in error.message


def test_message_above_the_server_limit_is_resource_exhausted(target, server):
    # A 1.2 MB prompt: gRPC refuses it before our handler parses it.
    with pytest.raises(SpecwireRpcError) as info:
        target.generate(text="a" * 1_200_000, max_new_tokens=1)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert target.generate(prompt(4), max_new_tokens=2).sequences.shape == (1, 6)  # still serving
