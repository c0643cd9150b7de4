"""Bad input on real servers gets its documented status, never INTERNAL (issue #17, item 3).

The five cases the issue found (ids past the vocabulary in `bad_words_ids`/`sequence_bias`, many stop
strings, a SynthID watermark too large to serve, one negative prompt for a batch of two, deeply nested JSON in
ImportConfig), and what an INTERNAL answer carries when one still happens (an error id, not the
exception's text).
"""

from __future__ import annotations

import concurrent.futures
import logging

import grpc
import pytest
import torch
import transformers

from specwire.client import ConfigClient, SpecwireRpcError, TargetClient
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.models import load_model
from specwire.serving import GrpcServer, ServiceBinding, handles_errors
from specwire.target.v1 import target_service_pb2 as pb
from specwire.target.v1 import target_service_pb2_grpc as pb_grpc
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.limits import RequestLimits
from tests.servers import threaded_server

PROMPTS = [[5, 6, 7, 8], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, loaded):
    db = tmp_path_factory.mktemp("bad-input-registry") / "r.db"
    with threaded_server(lambda: build_config_server(str(db))) as config_server:
        # An operator who raised --max-stop-strings: the stop-string machinery itself must hold 1000.
        limits = RequestLimits.for_model(loaded.max_position_embeddings, max_stop_strings=1000)
        build = lambda: build_target_server(loaded, config_server.address, limits=limits)  # noqa: E731
        with threaded_server(build) as target_server:
            yield config_server, target_server


@pytest.fixture
def target(stack):
    with TargetClient(stack[1].address) as client:
        yield client


@pytest.fixture
def registry(stack):
    with ConfigClient(stack[0].address) as client:
        yield client


def steps_run(stack) -> int:
    """Model steps the target has run so far (its engine's counter)."""
    return stack[1].server.bindings[0].servicer.engine.steps_run


def rpc_error(fn, *args, **kwargs) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize(
    ("field", "value", "extra"),
    [
        ("bad_words_ids", [[7], [5000]], {}),
        ("sequence_bias", [[[5000], -1.0]], {}),
        ("sequence_bias", [[[9, 400], 2.0]], {}),
        ("suppress_tokens", [3, 378], {}),
        ("forced_bos_token_id", 378, {}),
        ("eos_token_id", [2, 2**31 - 1], {"min_new_tokens": 2}),
        ("pad_token_id", 378, {}),
    ],
)
def test_token_ids_past_the_vocabulary_are_invalid_argument_before_any_step(stack, target, loaded, field, value, extra):
    before = steps_run(stack)
    error = rpc_error(target.generate, PROMPTS, max_new_tokens=3, **{field: value}, **extra)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    bad_id = next(t for t in torch.tensor([5000, 400, 378, 2**31 - 1]).tolist() if str(t) in str(value))
    assert error.message.startswith(f"{field}="), error.message
    assert f"token id {bad_id}" in error.message and f"vocabulary of {loaded.vocab_size} ids" in error.message
    assert "remove it" in error.message  # the fix
    assert [v.field for v in error.violations] == [field]
    assert steps_run(stack) == before  # refused before any generation work


def test_a_thousand_stop_strings_generate_and_stop_like_one(target, loaded):
    plain = target.generate(PROMPTS[:1], max_new_tokens=8)
    generated = plain.sequences[0, len(PROMPTS[0]) :].tolist()
    # The text of a generated token that is plain ASCII (byte-level tokens may be partial characters).
    words = [loaded.tokenizer.decode([t]) for t in generated[1:-1]]
    word = next(w for w in words if len(w) >= 2 and w.isascii() and w.isalnum())
    # 999 strings that never occur, and that token's text.
    stops = [f"never-{i}-\u2603" for i in range(999)] + [word]
    out = target.generate(PROMPTS[:1], max_new_tokens=8, stop_strings=stops)
    one = target.generate(PROMPTS[:1], max_new_tokens=8, stop_strings=[word])
    assert torch.equal(out.sequences, one.sequences)
    assert out.finish_reasons == ["stop_string"]
    assert out.sequences.shape[1] < plain.sequences.shape[1]


@pytest.fixture(scope="module")
def char_model_dir(tmp_path_factory):
    """A tiny Llama over a 96-token character tokenizer with no decoder (`decode` joins tokens with
    spaces): the kind of model the issue's "vocabulary size is 96" and "substring not found" came from."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("char-llama")
    chars = [c for c in string.printable if c not in "\t\n\x0b\x0c\r"]  # 95 printable + <unk> = 96
    backend = Tokenizer(
        models.WordLevel(vocab={"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_thousand_stop_strings_on_a_tokenizer_without_decoder(char_model_dir):
    loaded = load_model(str(char_model_dir), progress=False)
    assert loaded.vocab_size == 96
    limits = RequestLimits.for_model(loaded.max_position_embeddings, max_stop_strings=1000)
    build = lambda: build_target_server(loaded, None, limits=limits)  # noqa: E731
    with threaded_server(build) as server, TargetClient(server.address) as client:
        plain = client.generate(text="hello", max_new_tokens=6)
        generated = plain.sequences[0, plain.sequences.shape[1] - 6 :].tolist()
        # The text is the tokens joined by spaces: " c" ends at the third generated character.
        stop = " " + loaded.tokenizer.convert_ids_to_tokens(generated[2])
        stops = [f"s{i}x" for i in range(999)] + [stop]
        out = client.generate(text="hello", max_new_tokens=6, stop_strings=stops)  # was INTERNAL
        assert out.finish_reasons == ["stop_string"]
        assert out.sequences[0].tolist() == plain.sequences[0, : plain.sequences.shape[1] - 3].tolist()
        # None of them can ever appear in this tokenizer's text: refused, and the error (which echoes the
        # strings) still fits the response's metadata.
        error = rpc_error(client.generate, text="hello", max_new_tokens=6, stop_strings=stops[:999])
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert error.message.startswith("stop_strings=['s0x'") and len(error.message) < 1000
        assert [v.field for v in error.violations] == ["stop_strings"]


def test_synthid_watermark_generates_as_transformers(target, reference):
    synthid = {"ngram_len": 3, "keys": [654, 400, 836, 123]}
    wm = transformers.SynthIDTextWatermarkingConfig(**synthid)
    for kw in ({"do_sample": False}, {"do_sample": True, "seed": 5}):
        out = target.generate(PROMPTS, max_new_tokens=8, watermarking_config=synthid, **kw)
        if kw["do_sample"]:
            torch.manual_seed(5)
        ref = reference.generate(
            torch.tensor(PROMPTS), max_new_tokens=8, do_sample=kw["do_sample"], watermarking_config=wm
        )
        assert torch.equal(out.sequences, ref)
    # Its per-row state is the request's own: beside other requests in the batched scheduler, and
    # streamed, the rows are the same.
    kw = dict(max_new_tokens=8, do_sample=True, seed=5, watermarking_config=synthid)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(target.generate, [p], max_new_tokens=12) for p in PROMPTS]
        marked = [pool.submit(target.generate, PROMPTS, **kw) for _ in range(2)]
        assert all(torch.equal(m.result().sequences, ref) for m in marked)
        assert all(o.result().sequences.shape == (1, 16) for o in others)
    (final,) = [item for item in target.stream(PROMPTS, **kw) if hasattr(item, "sequences")]
    assert torch.equal(final.sequences, ref)
    # Too large to serve: refused before any step, naming the field.
    error = rpc_error(target.generate, PROMPTS, max_new_tokens=3, watermarking_config={"ngram_len": 2**40, "keys": [1]})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert [v.field for v in error.violations] == ["config.watermarking_config"]


def test_one_negative_prompt_guides_every_row_of_a_batch(target, reference):
    negative = [[30, 31, 32]]
    kw = dict(max_new_tokens=6, guidance_scale=1.5, negative_prompt_ids=negative)
    batch = target.generate(PROMPTS, **kw)
    for row, prompt in enumerate(PROMPTS):
        alone = target.generate([prompt], **kw)
        assert torch.equal(batch.sequences[row], alone.sequences[0])
        # One prompt with one negative prompt: exactly transformers.
        ref = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=6,
            do_sample=False,
            guidance_scale=1.5,
            negative_prompt_ids=torch.tensor(negative),
        )
        assert torch.equal(alone.sequences, ref)


def test_one_masked_negative_prompt_guides_every_row(target, reference):
    request = pb.GenerateRequest(prompts=[pb.Prompt(token_ids={"ids": p}) for p in PROMPTS])
    request.negative_prompt.token_ids.ids.extend([30, 31, 32])
    request.negative_prompt.attention_mask.extend([0, 1, 1])
    request.overrides.max_new_tokens = 5
    request.overrides.guidance_scale = 2.0
    stub = pb_grpc.TargetServiceStub(target.channel)
    response = stub.Generate(request, timeout=60)
    for row, prompt in enumerate(PROMPTS):
        ref = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=5,
            do_sample=False,
            guidance_scale=2.0,
            negative_prompt_ids=torch.tensor([[30, 31, 32]]),
            negative_prompt_attention_mask=torch.tensor([[0, 1, 1]]),
        )
        assert list(response.sequences[row].token_ids) == ref[0].tolist()


@pytest.mark.parametrize("depth", [100_000, 5_000, 21])
def test_import_config_refuses_deeply_nested_json(registry, depth):
    text = '{"max_new_tokens": 5, "extra_key": ' + "[" * depth + "]" * depth + "}"
    error = rpc_error(registry.import_json, text, name="deep")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.message.startswith("json=") and "at most 20" in error.message
    assert [v.field for v in error.violations] == ["json"]


def test_import_config_accepts_a_generation_config_json(registry):
    record = registry.import_json('{"max_new_tokens": 5, "sequence_bias": [[[1, 2], -1.0]]}', name="shallow")
    assert record.config.max_new_tokens == 5


def test_prompt_of_only_padding_is_not_internal(target, reference):
    out = target.generate([[0]], max_new_tokens=3)
    assert torch.equal(out.sequences, reference.generate(torch.tensor([[0]]), max_new_tokens=3, do_sample=False))


# ------------------------------------------------------------------------------ INTERNAL carries an id


class _Broken(pb_grpc.TargetServiceServicer):
    """A servicer with a bug: its handler raises an exception whose text must not reach the caller."""

    @handles_errors
    async def Generate(self, request, context):
        raise RuntimeError("secret detail: /srv/models/private-path and another request's prompt")


def test_internal_errors_carry_an_error_id_not_the_exception_text(caplog):
    binding = ServiceBinding(pb_grpc.add_TargetServiceServicer_to_server, _Broken(), "specwire.target.v1.TargetService")
    with caplog.at_level(logging.ERROR, logger="specwire.serving"):
        with threaded_server(lambda: GrpcServer([binding])) as server:
            with grpc.insecure_channel(server.address) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    pb_grpc.TargetServiceStub(channel).Generate(pb.GenerateRequest(), timeout=10)
    error = info.value
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in error.details() and "RuntimeError" not in error.details()
    error_id = error.details().split("(id ")[1].split(")")[0]
    assert len(error_id) == 12 and int(error_id, 16) >= 0
    assert error.details() == f"internal error (id {error_id}): see the server log"
    # The log has the id with the traceback, so an operator can find what the caller quotes.
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None and "secret detail" in str(logged[0].exc_info[1])


def test_internal_error_ids_differ_per_error():
    binding = ServiceBinding(pb_grpc.add_TargetServiceServicer_to_server, _Broken(), "specwire.target.v1.TargetService")
    details = set()
    with threaded_server(lambda: GrpcServer([binding])) as server:
        with grpc.insecure_channel(server.address) as channel:
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as info:
                    pb_grpc.TargetServiceStub(channel).Generate(pb.GenerateRequest(), timeout=10)
                details.add(info.value.details())
    assert len(details) == 3
