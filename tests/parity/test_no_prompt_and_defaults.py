"""Two generate() arguments through a real target service, against transformers on the same folder:
generation from no prompt (`inputs=None`: one row from `bos_token_id`) and `use_model_defaults=False`
(the model's generation_config.json skipped but for its special tokens, transformers v4.56's rule)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from specwire.client import SpecwireRpcError, TargetClient
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from tests.servers import threaded_server

# A model whose generation_config.json changes the output: a strong repetition penalty, no repeated
# bigrams and its own length.
MODEL_DEFAULTS = {"repetition_penalty": 1.8, "no_repeat_ngram_size": 2, "max_new_tokens": 7}


def _with_generation_config(source, folder, values):
    shutil.copytree(source, folder)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    special = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    return _with_generation_config(
        tiny_model_dir, tmp_path_factory.mktemp("defaults") / "m", {**special, **MODEL_DEFAULTS}
    )


@pytest.fixture(scope="module")
def reference(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def target(model_dir):
    loaded = load_model(str(model_dir), progress=False)
    with threaded_server(lambda: build_target_server(loaded)) as server:
        with TargetClient(server.address) as client:
            yield client


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_new_tokens": 12, "output_scores": True, "return_dict_in_generate": True},
        {"max_new_tokens": 10, "do_sample": True, "seed": 4, "num_return_sequences": 3},
        {"max_new_tokens": 9, "num_beams": 3, "num_return_sequences": 2},
    ],
)
def test_no_prompt_starts_from_bos_like_transformers(target, reference, kwargs):
    out = target.generate(**kwargs)
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "seed"}
    if "seed" in kwargs:
        torch.manual_seed(kwargs["seed"])
        # Sampling draws from a request generator on our side: compare shapes and the BOS start only.
        want = reference.generate(**ref_kwargs)
        assert out.sequences.shape == want.shape
        assert out.sequences[:, 0].tolist() == [1] * want.shape[0]
        return
    want = reference.generate(**ref_kwargs)
    sequences = want.sequences if hasattr(want, "sequences") else want
    assert out.sequences.tolist() == sequences.tolist()
    assert out.sequences[0, 0] == 1 and out.prompt_length == 1
    if kwargs.get("output_scores"):
        for ours, theirs in zip(out.scores, want.scores, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_no_prompt_with_a_bos_override(target, reference):
    out = target.generate(max_new_tokens=6, bos_token_id=9)
    assert out.sequences.tolist() == reference.generate(max_new_tokens=6, bos_token_id=9).tolist()


def test_no_prompt_streams(target):
    events = list(target.stream(max_new_tokens=5))
    assert events[-1].sequences.tolist() == target.generate(max_new_tokens=5).sequences.tolist()


def test_no_prompt_without_a_bos_token_is_refused(tiny_model_dir, tmp_path):
    folder = _with_generation_config(tiny_model_dir, tmp_path / "m", {"eos_token_id": 2})
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    reference.generation_config.bos_token_id = None
    with pytest.raises(ValueError, match="bos_token_id"):
        reference.generate(max_new_tokens=3)
    loaded = load_model(str(folder), progress=False)
    loaded.generation_config.bos_token_id = None
    with threaded_server(lambda: build_target_server(loaded)) as server, TargetClient(server.address) as client:
        with pytest.raises(SpecwireRpcError) as info:
            client.generate(max_new_tokens=3)
        assert info.value.code().name == "INVALID_ARGUMENT"
        assert "bos_token_id" in str(info.value)
        assert client.generate([[5, 6]], max_new_tokens=3).sequences.shape == (1, 5)  # a prompt still works


PROMPTS = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 20, 21, 20, 21, 22, 23]])


def test_model_defaults_apply_by_default(target, reference):
    out = target.generate(PROMPTS)
    assert out.sequences.tolist() == reference.generate(PROMPTS).tolist()
    assert out.sequences.shape[1] == PROMPTS.shape[1] + MODEL_DEFAULTS["max_new_tokens"]
    assert target.generate(PROMPTS, use_model_defaults=True).sequences.tolist() == out.sequences.tolist()


@pytest.mark.parametrize("kwargs", [{}, {"max_new_tokens": 12}, {"max_new_tokens": 9, "repetition_penalty": 1.3}])
def test_use_model_defaults_false_skips_the_model_generation_config(target, reference, model_dir, kwargs):
    out = target.generate(PROMPTS, use_model_defaults=False, **kwargs)
    bare = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    bare.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert out.sequences.tolist() == bare.generate(PROMPTS, **kwargs).tolist()
    if "repetition_penalty" not in kwargs:  # the model's penalty changes this output: it was really skipped
        assert out.sequences.tolist() != target.generate(PROMPTS, **kwargs).sequences.tolist()
