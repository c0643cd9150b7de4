"""Generate method plugins (`specwire.generate_methods`) on real target servers with the tiny Llama.

The example's `best_of_n` is checked against a direct computation with transformers: its pass `k` is the
`k`-th `generate(do_sample=True)` call after `torch.manual_seed(seed)`, and the answer per row is the pass
with the highest mean log-probability (`compute_transition_scores(normalize_logits=True)`). Refusals
(not enabled, bad arguments, speculation, beams) are INVALID_ARGUMENT; a method's bug is INTERNAL naming
it and the server goes on; a method past the caller's deadline stops at its next `check()`.
"""

from __future__ import annotations

import importlib
import json
import sys
import time

import grpc
import pytest
import torch
import transformers

from specwire.client import SpecwireRpcError, TargetClient
from specwire.generation.plugins import load_plugins
from specwire.models import load_model
from specwire.target_service.__main__ import build_server
from tests.plugin_packages import install_plugin_packages
from tests.servers import threaded_server

PROMPTS = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7], [20, 21, 22, 23, 24, 20, 21, 22]])
ENABLED = ["best_of_n", "raising_method", "bad_output_method", "slow_method", "ban_tokens"]
SAMPLING = {"do_sample": True, "seed": 7, "max_new_tokens": 8, "top_k": 20}


@pytest.fixture(scope="module")
def plugin_paths(tmp_path_factory):
    paths = install_plugin_packages(tmp_path_factory.mktemp("site"))
    added = [p for p in paths if p not in sys.path]
    sys.path[:0] = added
    importlib.invalidate_caches()
    yield paths
    for p in added:
        sys.path.remove(p)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module", params=["sequential", "batched"])
def server(request, loaded, plugin_paths):
    registry = load_plugins(ENABLED)
    with threaded_server(lambda: build_server(loaded, scheduler=request.param, plugins=registry)) as running:
        yield running


def _best_of_n(reference, n: int, prompts=PROMPTS, **config):
    """The direct computation: n seeded transformers samples, the best mean log-probability per row."""
    torch.manual_seed(config.pop("seed"))
    eos, pad = reference.generation_config.eos_token_id, reference.generation_config.pad_token_id
    passes = []
    for _ in range(n):
        with torch.no_grad():
            out = reference.generate(prompts, output_scores=True, return_dict_in_generate=True, **config)
        new = out.sequences[:, prompts.shape[1] :]
        logprobs = reference.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        # A row's own tokens: up to its first EOS (the rest is padding).
        ended = (new == eos).long().cumsum(-1)
        own = (ended == 0) | ((ended == 1) & (new == eos))
        passes.append((out.sequences, (logprobs * own).sum(-1) / own.sum(-1)))
    width = max(s.shape[1] for s, _ in passes)
    padded = torch.stack([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=pad) for s, _ in passes])
    best = torch.stack([mean for _, mean in passes]).argmax(0)
    return padded[best, torch.arange(best.shape[0])], passes


def test_best_of_n_matches_the_direct_computation(server, reference):
    want, passes = _best_of_n(reference, 3, **SAMPLING)
    assert want.shape[0] == PROMPTS.shape[0]
    assert len({tuple(s[0].tolist()) for s, _ in passes}) > 1  # the passes differ: the choice matters
    with TargetClient(server.address) as client:
        out = client.generate(
            PROMPTS,
            generate_method={"name": "best_of_n", "args": {"n": 3}},
            return_dict_in_generate=True,
            output_scores=True,
            **SAMPLING,
        )
        again = client.generate(PROMPTS, generate_method={"name": "best_of_n", "args": {"n": 3}}, **SAMPLING)
        final = list(client.stream(PROMPTS, generate_method={"name": "best_of_n", "args": {"n": 3}}, **SAMPLING))[-1]
    assert torch.equal(out.sequences, want)
    assert torch.equal(again.sequences, want) and torch.equal(final.sequences, want)  # seeded: repeatable
    assert out.speculation.proposer == "none"
    eos = reference.generation_config.eos_token_id
    assert out.finish_reasons == ["eos" if eos in row else "length" for row in want[:, PROMPTS.shape[1] :].tolist()]
    # The winning pass's processed scores, one [rows, vocab] per generated column.
    assert out.scores is not None and len(out.scores) == want.shape[1] - PROMPTS.shape[1]
    chosen = torch.stack([out.scores[t].gather(1, want[:, PROMPTS.shape[1] + t, None]) for t in range(2)])
    assert bool(torch.isfinite(chosen).all())


def test_a_request_speculating_or_with_beams_or_bad_args_is_refused(server):
    method = {"name": "best_of_n", "args": {"n": 2}}
    cases = [
        (dict(generate_method=method, proposer="prompt_lookup", **SAMPLING), "proposer"),
        (dict(generate_method=method, num_beams=2, **SAMPLING), "config.num_beams"),
        (dict(generate_method={"name": "best_of_n", "args": {"n": 0}}, **SAMPLING), "generate_method.args"),
        (dict(generate_method=method, max_new_tokens=4), "generate_method.args"),  # greedy: n equal answers
        (dict(generate_method={"name": "nope"}, **SAMPLING), "generate_method.name"),
        (dict(generate_method={"name": "ban_tokens"}, **SAMPLING), "generate_method.name"),  # another kind
    ]
    with TargetClient(server.address) as client:
        for kwargs, field in cases:
            with pytest.raises(SpecwireRpcError) as info:
                client.generate(PROMPTS, **kwargs)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
            assert info.value.violations[0].field == field, (kwargs, info.value.violations)
    assert "best_of_n" in info.value.violations[0].message  # the enabled methods are listed


def test_a_method_not_enabled_is_refused_and_listed_methods_have_their_kind(loaded, plugin_paths):
    registry = load_plugins(["ban_tokens"])
    with threaded_server(lambda: build_server(loaded, plugins=registry)) as running:
        with TargetClient(running.address) as client:
            with pytest.raises(SpecwireRpcError) as info:
                client.generate(PROMPTS, generate_method={"name": "best_of_n", "args": {"n": 2}}, **SAMPLING)
            assert {(p.name, p.kind) for p in client.model_info().plugins} == {("ban_tokens", "logits_processor")}
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.violations[0].field == "generate_method.name"
    assert "none (start the target with --plugins)" in info.value.violations[0].message
    registry = load_plugins(ENABLED)
    assert registry.plugins["generate_method"]["best_of_n"].description.startswith("Best-of-n sampling")


def test_model_info_lists_generate_methods(server):
    with TargetClient(server.address) as client:
        listed = {(p.name, p.kind) for p in client.model_info().plugins}
    assert {("best_of_n", "generate_method"), ("slow_method", "generate_method")} <= listed


@pytest.mark.parametrize("name, says", [("raising_method", "generating"), ("bad_output_method", "generating")])
def test_a_methods_bug_is_internal_naming_it_and_the_server_goes_on(server, name, says):
    with TargetClient(server.address) as client:
        with pytest.raises(SpecwireRpcError) as info:
            client.generate(PROMPTS, generate_method={"name": name}, max_new_tokens=4)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        details = info.value.details()
        assert repr(name) in details and says in details and "error id" in details
        assert "secret internal detail" not in details and "Traceback" not in details
        assert client.generate(PROMPTS, max_new_tokens=3).sequences.shape == (2, PROMPTS.shape[1] + 3)


def test_a_method_past_the_deadline_stops_at_its_next_check_and_frees_the_model(server):
    from tests.plugin_samples import SLOW_METHOD_STARTS, SLOW_METHOD_STOPS

    SLOW_METHOD_STARTS.clear()
    SLOW_METHOD_STOPS.clear()
    with TargetClient(server.address) as client:
        started = time.monotonic()
        with pytest.raises(SpecwireRpcError) as info:
            client.generate(PROMPTS, generate_method={"name": "slow_method"}, max_new_tokens=4, timeout=2.0)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The model thread is free again: a plain request runs at once, not after a method that never ends.
        assert client.generate(PROMPTS, max_new_tokens=3, timeout=10).sequences.shape[1] == PROMPTS.shape[1] + 3
        assert time.monotonic() - started < 10
    assert SLOW_METHOD_STARTS  # it ran (the deadline did not pass before it started)
    deadline = time.monotonic() + 5
    while not SLOW_METHOD_STOPS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert SLOW_METHOD_STOPS and SLOW_METHOD_STOPS[0] in ("GenerationStopped", "GenerationTimedOut")


def test_cli_generate_method(server, capsys):
    from specwire.client.cli import main

    base = ["generate", "Hello", "--address", server.address, "--no-chat", "--json", "--proposer", "none"]
    options = ["--set", "do_sample=true", "--set", "seed=3", "--set", "max_new_tokens=5"]
    assert main([*base, *options, "--generate-method", 'best_of_n={"n": 2}']) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([*base, *options, "--generate-method", 'best_of_n={"n": 2}']) == 0
    assert json.loads(capsys.readouterr().out)["sequences"] == first["sequences"]
    assert main([*base, *options, "--generate-method", 'best_of_n={"n": 0}']) == 1
    assert "generate_method.args" in capsys.readouterr().err


def test_a_cancelled_request_stops_its_method_at_the_next_check(server):
    import asyncio

    from specwire.client import AsyncTargetClient
    from tests.plugin_samples import SLOW_METHOD_STARTS, SLOW_METHOD_STOPS

    SLOW_METHOD_STARTS.clear()
    SLOW_METHOD_STOPS.clear()

    async def cancel_once_running() -> None:
        async with AsyncTargetClient(server.address) as client:  # its deadline (600 s) is far away
            call = asyncio.ensure_future(
                client.generate(PROMPTS, generate_method={"name": "slow_method"}, max_new_tokens=4)
            )
            waited = time.monotonic() + 10
            while not SLOW_METHOD_STARTS and time.monotonic() < waited:
                await asyncio.sleep(0.02)
            assert SLOW_METHOD_STARTS, "the method never started"
            call.cancel()  # cancels the RPC
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(cancel_once_running())
    deadline = time.monotonic() + 5
    while not SLOW_METHOD_STOPS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert SLOW_METHOD_STOPS == ["GenerationStopped"]  # cancelled, not timed out
    with TargetClient(server.address) as client:
        assert client.generate(PROMPTS, max_new_tokens=3, timeout=10).sequences.shape[1] == PROMPTS.shape[1] + 3


def test_best_of_n_with_several_returned_sequences(server, reference):
    """num_return_sequences=2: the method receives each prompt twice, as transformers expands it."""
    config = {**SAMPLING, "num_return_sequences": 2}
    want, _ = _best_of_n(reference, 2, **config)
    with TargetClient(server.address) as client:
        out = client.generate(PROMPTS, generate_method={"name": "best_of_n", "args": {"n": 2}}, **config)
    assert want.shape[0] == 4 and torch.equal(out.sequences, want)
