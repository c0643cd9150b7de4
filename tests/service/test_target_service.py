"""TargetService on a real grpc.aio server over loopback with a tiny random Llama loaded through
specwire.models, compared with transformers.generate() on the same folder; plus its error codes,
registry references, streaming, concurrency and cancellation."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
import transformers

from specwire.client import AsyncTargetClient, ConfigClient, SpecwireRpcError, TargetClient
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from tests.servers import threaded_server, wait_for


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return model.eval()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, loaded):
    """A config service and a target service wired to it, both real servers on loopback."""
    db = tmp_path_factory.mktemp("registry") / "r.db"
    with threaded_server(lambda: build_config_server(str(db))) as config_server:
        with threaded_server(lambda: build_target_server(loaded, config_server.address)) as target_server:
            yield config_server, target_server


@pytest.fixture
def target(stack):
    with TargetClient(stack[1].address) as client:
        yield client


@pytest.fixture
def registry(stack):
    with ConfigClient(stack[0].address) as client:
        yield client


PROMPTS = torch.tensor([[5, 6, 7, 8, 9], [20, 21, 22, 23, 24]])


def expect_code(code, fn, *args, **kwargs) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value
    return info.value


def test_greedy_ids_and_scores_match_transformers(target, reference):
    kw = dict(max_new_tokens=12, output_scores=True, output_logits=True, return_dict_in_generate=True)
    out = target.generate(PROMPTS, **kw)
    ref = reference.generate(PROMPTS, do_sample=False, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores)
    for ours, theirs in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(ours, theirs)
    for ours, theirs in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(ours, theirs)
    transition = target.compute_transition_scores(out.sequences, out.scores)
    torch.testing.assert_close(transition, reference.compute_transition_scores(ref.sequences, ref.scores))
    assert out.finish_reasons == ["length", "length"]


def test_beam_search_matches_transformers(target, reference):
    kw = dict(
        num_beams=4,
        num_return_sequences=2,
        max_new_tokens=10,
        length_penalty=0.7,
        output_scores=True,
        return_dict_in_generate=True,
    )
    out = target.generate(PROMPTS, **kw)
    ref = reference.generate(PROMPTS, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores)
    assert torch.equal(out.beam_indices, ref.beam_indices.long())
    for ours, theirs in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_group_beam_search_matches_transformers_4_55_goldens(target):
    """Diverse beam search with transformers' argument names through the client, on left-padded prompts,
    against the goldens of transformers 4.55.4 (tests/parity/goldens, scripts/make_v4_goldens.py)."""
    golden = json.loads((Path(__file__).parents[1] / "parity/goldens/v4_group_beam_search.json").read_text())
    case = next(c for c in golden["cases"] if c["name"] == "batch_left_padding")
    prompt, expected = golden["prompts"]["batch"], case["expected"]
    out = target.generate(
        torch.tensor(prompt["input_ids"]),
        attention_mask=prompt["attention_mask"],
        output_scores=True,
        return_dict_in_generate=True,
        **case["resolved_kwargs"],
    )
    assert out.sequences.tolist() == expected["sequences"]
    assert out.beam_indices.tolist() == expected["beam_indices"]
    torch.testing.assert_close(out.sequences_scores, torch.tensor(expected["sequences_scores"]), atol=1e-4, rtol=0)
    assert len(out.scores) == len(expected["scores"])
    assert set(out.finish_reasons) <= {"eos", "length"} and "eos" in out.finish_reasons


def test_contrastive_search_streams_transformers_4_55_goldens(target):
    """Contrastive search (penalty_alpha, top_k) streamed through the client on left-padded prompts adds up
    to the goldens of transformers 4.55.4."""
    golden = json.loads((Path(__file__).parents[1] / "parity/goldens/v4_contrastive_search.json").read_text())
    case = next(c for c in golden["cases"] if c["name"] == "batch_left_padding")
    prompt, expected = golden["prompts"]["batch"], case["expected"]
    items = list(
        target.stream(
            torch.tensor(prompt["input_ids"]), attention_mask=prompt["attention_mask"], **case["resolved_kwargs"]
        )
    )
    final, deltas = items[-1], items[:-1]
    assert final.sequences.tolist() == expected["sequences"]
    width = len(prompt["input_ids"][0])
    for row, sequence in enumerate(expected["sequences"]):
        tokens = [t for d in deltas if d.row == row for t in d.token_ids]
        assert tokens == sequence[width : width + len(tokens)] and tokens
    assert "eos" in final.finish_reasons


def test_dola_matches_transformers_4_55_goldens(target):
    """DoLa (dola_layers, with its repetition penalty) through the client on left-padded prompts."""
    golden = json.loads((Path(__file__).parents[1] / "parity/goldens/v4_dola_generation.json").read_text())
    case = next(c for c in golden["cases"] if c["name"] == "batch_left_padding")
    prompt, expected = golden["prompts"]["batch"], case["expected"]
    out = target.generate(
        torch.tensor(prompt["input_ids"]), attention_mask=prompt["attention_mask"], **case["resolved_kwargs"]
    )
    assert out.sequences.tolist() == expected["sequences"]


def test_constrained_beam_search_matches_transformers_4_55_goldens(target):
    """Constrained beam search through the client on left-padded prompts: `force_words_ids` (phrasal and
    disjunctive), then the same constraints as `constraints` plain data (transformers' class/attribute
    names), against the goldens of transformers 4.55.4."""
    golden = json.loads((Path(__file__).parents[1] / "parity/goldens/v4_constrained_beam_search.json").read_text())
    case = next(c for c in golden["cases"] if c["name"] == "left_padded_batch")
    prompt, expected, kwargs = golden["prompts"]["batch"], case["expected"], case["resolved_kwargs"]
    phrase, choices = kwargs["force_words_ids"]
    as_constraints = {k: v for k, v in kwargs.items() if k != "force_words_ids"}
    as_constraints["constraints"] = [
        {"type": "phrasal", "token_ids": phrase},
        {"type": "disjunctive", "token_ids": choices},
    ]
    for request in (kwargs, as_constraints):
        out = target.generate(
            torch.tensor(prompt["input_ids"]),
            attention_mask=prompt["attention_mask"],
            output_scores=True,
            return_dict_in_generate=True,
            **request,
        )
        assert out.sequences.tolist() == expected["sequences"]
        torch.testing.assert_close(out.sequences_scores, torch.tensor(expected["sequences_scores"]), atol=1e-4, rtol=0)
        assert len(out.scores) == len(expected["scores"])
    err = expect_code(
        grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, num_beams=2, force_words_ids=[[100000]]
    )
    assert err.violations[0].field.endswith("force_words_ids") and "vocabulary" in err.message
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, num_beams=2, constraints=[{"x": 1}])
    assert err.violations[0].field == "config.constraints"


def test_seeded_sampling_matches_transformers_manual_seed(target, reference):
    prompt = PROMPTS[:1]
    out = target.generate(prompt, do_sample=True, temperature=0.9, top_p=0.95, max_new_tokens=15, seed=1234)
    torch.manual_seed(1234)
    ref = reference.generate(prompt, do_sample=True, temperature=0.9, top_p=0.95, max_new_tokens=15)
    assert torch.equal(out.sequences, ref)
    again = target.generate(prompt, do_sample=True, temperature=0.9, top_p=0.95, max_new_tokens=15, seed=1234)
    assert torch.equal(again.sequences, out.sequences)


def test_left_padded_batch_with_mask_matches_transformers(target, reference):
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=8)
    ref = reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(out.sequences, ref)


def test_ragged_token_prompts_are_left_padded(target, reference):
    out = target.generate([[5, 6, 7], [9, 10, 11, 12, 13]], max_new_tokens=6)
    ids = torch.tensor([[2, 2, 5, 6, 7], [9, 10, 11, 12, 13]])  # padded with the pad id (eos, 2... see below)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pad = reference.generation_config.pad_token_id
    ids[0, :2] = pad
    ref = reference.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out.sequences, ref)


def test_text_prompt_and_default_twenty_new_tokens(target, reference, loaded):
    out = target.generate(text="Hello world")
    ids = loaded.tokenizer("Hello world", return_tensors="pt").input_ids
    ref = reference.generate(ids, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert out.sequences.shape[1] - ids.shape[1] <= 20
    assert out.text[0] == loaded.tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)


def test_beam_search_refuses_to_stream_with_the_field_and_the_fix(target):
    with pytest.raises(SpecwireRpcError) as info:
        list(target.stream(PROMPTS, max_new_tokens=4, num_beams=2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in info.value.violations] == ["config.num_beams"]
    assert "num_beams=1" in info.value.message and "Generate" in info.value.message


def test_stream_deltas_add_up_to_the_final_output(target):
    items = list(target.stream(PROMPTS, max_new_tokens=10))
    final = items[-1]
    deltas = items[:-1]
    assert deltas and all(hasattr(d, "row") for d in deltas)
    for row in range(2):
        tokens = [t for d in deltas if d.row == row for t in d.token_ids]
        assert tokens == final.sequences[row, PROMPTS.shape[1] :].tolist()
        assert "".join(d.text for d in deltas if d.row == row) == final.text[row]


def test_model_info(target, loaded):
    info = target.model_info()
    assert info.vocab_size == loaded.vocab_size
    assert info.max_position_embeddings == 256
    assert list(info.eos_token_ids) == [2] and info.bos_token_id == 1
    assert info.architecture == "LlamaForCausalLM" and info.dtype == "float32"
    assert info.device == "cpu" and info.peak_device_memory_bytes == 0  # device memory is a CUDA figure
    assert target.model_generation_config().eos_token_id == 2


def test_registry_reference_and_overrides(target, registry, reference):
    registry.create("tiny-beam", {"num_beams": 3, "max_new_tokens": 6})
    registry.update("tiny-beam", {"num_beams": 2, "max_new_tokens": 6})
    registry.set_tag("tiny-beam", "prod", 1)
    out = target.generate(PROMPTS, generation_config="tiny-beam:prod")
    assert (out.config_name, out.config_version) == ("tiny-beam", 1)
    assert torch.equal(out.sequences, reference.generate(PROMPTS, num_beams=3, max_new_tokens=6))
    latest = target.generate(PROMPTS, generation_config="tiny-beam", max_new_tokens=4)  # override wins
    assert latest.config_version == 2
    assert torch.equal(latest.sequences, reference.generate(PROMPTS, num_beams=2, max_new_tokens=4))
    err = expect_code(grpc.StatusCode.NOT_FOUND, target.generate, PROMPTS, generation_config="no-such-config")
    assert "no-such-config" in err.message


def test_latest_reference_is_never_stale_for_long(target, registry):
    registry.create("moving", {"max_new_tokens": 3})
    assert target.generate(PROMPTS[:1], generation_config="moving").sequences.shape[1] == 5 + 3
    registry.update("moving", {"max_new_tokens": 5})
    time.sleep(2.5)  # the resolver's TTL for moving references is 2 s
    assert target.generate(PROMPTS[:1], generation_config="moving").sequences.shape[1] == 5 + 5


def test_bad_requests_get_invalid_argument_naming_the_field(target, stack, loaded):
    vocab = loaded.vocab_size
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, [[5, vocab + 3, 7]])
    assert err.violations[0].field == "prompts[0].token_ids[1]" and str(vocab + 3) in err.violations[0].value
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, [[5, -1]])
    assert err.violations[0].field == "prompts[0].token_ids[1]"
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, [[]])
    assert err.violations[0].field == "prompts[0].token_ids"
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, max_length=4)
    assert "max_length" in err.message
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, do_sample=True, temperature=0.0)
    assert err.violations[0].field == "config.temperature"
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, temprature=0.5)
    assert err.violations[0].field == "overrides.temprature"
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, attention_mask=[[1, 1]] * 2)
    assert err.violations[0].field == "prompts[0].attention_mask"
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, num_beams=4, num_beam_groups=2)
    assert err.violations[0].field == "config.diversity_penalty"
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, num_beams=2, low_memory=True)
    assert err.violations[0].field == "config.low_memory"
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, use_mtp=True)
    assert err.violations[0].field == "config.use_mtp"  # the tiny Llama has no MTP layers
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, speculation_type="dflash")
    assert err.violations[0].field == "config.speculation_type"  # no DFlash assistant (--dflash-model) loaded
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, dola_layers="middle")
    assert err.violations[0].field == "config.dola_layers"
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT, target.generate, PROMPTS, penalty_alpha=0.6, use_cache=False)
    assert err.violations[0].field == "config.use_cache"
    # The server is still up and answering after all of that.
    assert target.generate(PROMPTS, max_new_tokens=2).sequences.shape == (2, 7)


def test_concurrent_requests_each_get_their_own_answer(stack, reference):
    configs = [
        dict(max_new_tokens=8),
        dict(max_new_tokens=8, num_beams=3),
        dict(max_new_tokens=8, do_sample=True, seed=7, top_k=20),
        dict(max_new_tokens=8, repetition_penalty=1.3),
    ] * 2
    expected = []
    with TargetClient(stack[1].address) as client:
        expected = [client.generate(PROMPTS, **c).sequences for c in configs]

    async def run_all():
        async with AsyncTargetClient(stack[1].address) as client:
            return await asyncio.gather(*(client.generate(PROMPTS, **c) for c in configs))

    outputs = asyncio.run(run_all())
    for out, want in zip(outputs, expected, strict=True):
        assert torch.equal(out.sequences, want)


def test_cancelled_stream_stops_within_a_step(stack, loaded):
    servicer = stack[1].server.bindings[0].servicer
    engine = servicer.engine
    with TargetClient(stack[1].address) as client:
        stream = client.stream(PROMPTS[:1], max_new_tokens=200, min_new_tokens=200)
        for _ in range(3):
            next(stream)
        stream.close()  # cancels the RPC
    wait_for(lambda: engine.active == 0, timeout=10)
    steps = engine.steps_run
    time.sleep(0.3)
    assert engine.steps_run <= steps + 1
    with TargetClient(stack[1].address) as client:  # and the server keeps serving
        assert client.generate(PROMPTS, max_new_tokens=2).sequences.shape == (2, 7)


def test_deadline_exceeded_frees_the_request(stack):
    engine = stack[1].server.bindings[0].servicer.engine
    with TargetClient(stack[1].address, timeout=0.3) as client:
        with pytest.raises(SpecwireRpcError) as info:
            client.generate(PROMPTS, max_new_tokens=5000, min_new_tokens=200, max_length=None)
    assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT)
    wait_for(lambda: engine.active == 0, timeout=10)


def test_grpcurl_calls_generate_with_json(stack):
    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    request = {"prompts": [{"tokenIds": {"ids": [5, 6, 7, 8, 9]}}], "overrides": {"maxNewTokens": 4}}
    out = subprocess.run(
        [
            grpcurl,
            "-plaintext",
            "-d",
            json.dumps(request),
            stack[1].address,
            "specwire.target.v1.TargetService/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    response = json.loads(out.stdout)
    # grpcurl prints proto field names.
    assert len(response["sequences"][0]["token_ids"]) == 9
    assert response["sequences"][0]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_threads_share_one_server_safely(stack):
    results = {}

    def worker(i):
        with TargetClient(stack[1].address) as client:
            results[i] = client.generate(PROMPTS, max_new_tokens=5, do_sample=True, seed=i).sequences

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with TargetClient(stack[1].address) as client:
        for i in range(4):
            assert torch.equal(results[i], client.generate(PROMPTS, max_new_tokens=5, do_sample=True, seed=i).sequences)
