"""`compile_config` / `disable_compile` through a real target service: with a static cache, the decoding
steps run through `torch.compile` where transformers 5.23's rule compiles them (on the CPU only when the
compile_config asks for every device), and the outputs are transformers' compiled ones and the dynamic
cache's (ids exact, scores within 1e-4). A backend registered here counts the graphs it is given, so the
tests see that compilation really happened (or did not)."""

from __future__ import annotations

import pytest
import torch
import transformers

from specwire.client import SpecwireRpcError, TargetClient
from specwire.generation import compilation
from specwire.generation.config import GenerationConfig
from specwire.generation.loops.generate import generate
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from tests.servers import threaded_server

IDS = torch.tensor([[0, 0, 5, 6, 7, 8], [20, 21, 22, 23, 24, 25]])
MASK = (IDS != 0).long()
SCORES = dict(output_scores=True, return_dict_in_generate=True)
COUNTING, FAILING = "specwire_test_counting", "specwire_test_failing"
GRAPHS: list[int] = []


def _counting_backend(graph, example_inputs):
    GRAPHS.append(len(graph.graph.nodes))
    return graph.forward


def _failing_backend(graph, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


torch._dynamo.register_backend(_counting_backend, name=COUNTING)
torch._dynamo.register_backend(_failing_backend, name=FAILING)


def _on_cpu(**options):
    return {"_compile_all_devices": True, **options}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def target(loaded):
    with threaded_server(lambda: build_target_server(loaded)) as server:
        with TargetClient(server.address) as client:
            yield client


@pytest.fixture(autouse=True)
def _fresh_graphs():
    # Each test counts its own graphs; dynamo's caches (and their recompile limit) start empty.
    torch._dynamo.reset()
    compilation._compiled.clear()
    GRAPHS.clear()
    yield


def _close(ours, theirs):
    assert len(ours) == len(theirs)
    for mine, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4)


def _transformers_compiled(model_dir, backend, **kwargs):
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    compile_config = transformers.CompileConfig(backend=backend, mode="default")
    compile_config._compile_all_devices = True
    return reference.generate(
        IDS, attention_mask=MASK, cache_implementation="static", compile_config=compile_config, **SCORES, **kwargs
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_new_tokens=8),
        dict(max_new_tokens=6, num_beams=3, num_return_sequences=2),
        dict(max_new_tokens=7, repetition_penalty=1.4, prefill_chunk_size=4),
    ],
)
def test_compiled_decoding_equals_transformers_and_the_dynamic_cache(target, tiny_model_dir, kwargs):
    options = _on_cpu(backend=COUNTING, mode="default")
    ours = target.generate(
        IDS, attention_mask=MASK, cache_implementation="static", compile_config=options, **SCORES, **kwargs
    )
    assert GRAPHS, "the decoding steps did not run through torch.compile"
    dynamic = target.generate(IDS, attention_mask=MASK, **SCORES, **kwargs)
    want = _transformers_compiled(tiny_model_dir, "aot_eager", **kwargs)
    assert ours.sequences.tolist() == want.sequences.tolist() == dynamic.sequences.tolist()
    _close(ours.scores, want.scores)
    _close(ours.scores, dynamic.scores)
    assert not [w for w in ours.warnings if "compile" in w.field]


def test_aot_eager_seeded_sampling_equals_the_dynamic_cache(target):
    kwargs = dict(max_new_tokens=8, do_sample=True, seed=7, top_k=20)
    compiled = target.generate(
        IDS,
        attention_mask=MASK,
        cache_implementation="static",
        compile_config=_on_cpu(backend="aot_eager", mode="default"),
        **kwargs,
    )
    assert compilation._compiled, "no compiled call was made"
    assert compiled.sequences.tolist() == target.generate(IDS, attention_mask=MASK, **kwargs).sequences.tolist()


def test_compiled_calls_are_reused_per_model_and_options(loaded):
    config = GenerationConfig(
        cache_implementation="static", max_new_tokens=4, compile_config=_on_cpu(backend=COUNTING, mode="default")
    )
    generate(loaded.model, IDS, MASK, config=config)
    generate(loaded.model, IDS, MASK, config=config)
    assert len(compilation._compiled) == 1
    other = GenerationConfig(**{**config.to_dict(), "compile_config": _on_cpu(backend="aot_eager", mode="default")})
    generate(loaded.model, IDS, MASK, config=other)
    assert len(compilation._compiled) == 2


def test_disable_compile_is_honoured(target):
    out = target.generate(
        IDS,
        attention_mask=MASK,
        max_new_tokens=5,
        cache_implementation="static",
        compile_config=_on_cpu(backend=COUNTING, mode="default"),
        disable_compile=True,
    )
    assert GRAPHS == []
    # The compile_config is not acted on, and the response says so.
    assert [w for w in out.warnings if w.field == "config.compile_config" and "disable_compile" in w.message]
    assert not [w for w in out.warnings if w.field == "config.disable_compile"]


def test_on_the_cpu_transformers_compiles_only_when_asked_for_every_device(target, loaded):
    out = target.generate(
        IDS,
        attention_mask=MASK,
        max_new_tokens=5,
        cache_implementation="static",
        compile_config={"backend": COUNTING, "mode": "default"},
    )
    assert GRAPHS == []
    (warning,) = [w for w in out.warnings if w.field == "config.compile_config"]
    assert "_compile_all_devices" in warning.message and "'cpu'" in warning.message
    decision = compilation.decide_compile(loaded.model, GenerationConfig(cache_implementation="static"))
    assert decision.options is None and "cpu" in decision.reason


def test_compile_config_without_a_static_cache_is_a_warning(target):
    out = target.generate(
        IDS, attention_mask=MASK, max_new_tokens=3, compile_config=_on_cpu(backend=COUNTING, mode="default")
    )
    assert GRAPHS == []
    assert [w for w in out.warnings if w.field == "config.compile_config" and "static cache" in w.message]


@pytest.mark.parametrize(
    "options",
    [
        _on_cpu(backend="no_such_backend"),
        _on_cpu(backend="inductor", mode="default", options={"trace.enabled": False}),  # mode and options
        _on_cpu(backend=FAILING, mode="default"),  # fails on the first decoding step
    ],
)
def test_a_compile_failure_is_invalid_argument_and_the_service_goes_on(target, options):
    with pytest.raises(SpecwireRpcError) as info:
        target.generate(
            IDS, attention_mask=MASK, max_new_tokens=4, cache_implementation="static", compile_config=options
        )
    assert info.value.code().name == "INVALID_ARGUMENT"
    assert "compile_config" in str(info.value) and "disable_compile=True" in str(info.value)
    assert target.generate(IDS, attention_mask=MASK, max_new_tokens=3).sequences.shape == (2, 9)


def test_inductor_compiles_and_keeps_the_dynamic_cache_tokens(loaded):
    """The real default backend (inductor, "reduce-overhead"), as transformers runs it on the CPU when asked."""
    config = GenerationConfig(cache_implementation="static", max_new_tokens=6, compile_config=_on_cpu(), **SCORES)
    compiled = generate(loaded.model, IDS, MASK, config=config)
    dynamic = generate(loaded.model, IDS, MASK, config=GenerationConfig(max_new_tokens=6, **SCORES))
    assert compilation._compiled
    assert compiled.sequences.tolist() == dynamic.sequences.tolist()
    _close(compiled.scores, dynamic.scores)
