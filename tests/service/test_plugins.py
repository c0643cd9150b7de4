"""Server plugins on real target servers (sequential and batched) with the tiny Llama: discovered through
real entry points (`tests.plugin_packages`), enabled with `--plugins`, named by requests with JSON args.

A plugin processor gives transformers' `generate(logits_processor=[same processor])` tokens, also under
speculation; a plugin criterion stops rows as `generate(stopping_criteria=[...])` does; unknown names and
bad arguments are INVALID_ARGUMENT, a plugin's own bug is INTERNAL naming it and the server goes on.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import grpc
import pytest
import torch
import transformers

from specwire.client import SpecwireRpcError, TargetClient
from specwire.generation.plugins import PluginLoadError, load_plugins
from specwire.models import load_model
from specwire.target_service.__main__ import build_server
from tests.plugin_packages import REPO_ROOT, install_plugin_packages
from tests.servers import threaded_server

PROMPTS = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7], [20, 21, 22, 23, 24, 20, 21, 22]])
ENABLED = ["ban_tokens", "stop_on_tokens", "max_sentences", "raising", "buggy_factory", "raising_stop"]


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
def registry(plugin_paths):
    return load_plugins(ENABLED)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module", params=["sequential", "batched"])
def server(request, loaded, registry):
    with threaded_server(lambda: build_server(loaded, scheduler=request.param, plugins=registry)) as running:
        yield running


def _reference(reference, prompts=PROMPTS, **kwargs):
    with torch.no_grad():
        return reference.generate(prompts, max_new_tokens=8, do_sample=False, **kwargs)


@pytest.mark.parametrize(
    "proposer, kwargs",
    [("none", {}), ("prompt_lookup", {}), ("none", {"num_beams": 3, "num_return_sequences": 2})],
    ids=["greedy", "speculative", "beams"],
)
def test_processor_plugin_matches_transformers_logits_processor(server, reference, loaded, proposer, kwargs):
    from specwire_plugin_example import BanTokens

    plain = _reference(reference, **kwargs)
    banned = sorted(set(plain[:, PROMPTS.shape[1] :].flatten().tolist()))[:6]  # change the path
    args = {"token_ids": banned}
    with TargetClient(server.address) as client:
        out = client.generate(
            PROMPTS, max_new_tokens=8, proposer=proposer, processors=[{"name": "ban_tokens", "args": args}], **kwargs
        )
    want = _reference(reference, logits_processor=[BanTokens(banned, loaded.vocab_size, "cpu")], **kwargs)
    assert not torch.equal(want, plain)
    assert torch.equal(out.sequences, want)
    assert not set(banned) & set(out.sequences[:, PROMPTS.shape[1] :].flatten().tolist())


@pytest.mark.parametrize("proposer", ["none", "prompt_lookup"])
def test_stopping_plugin_stops_as_transformers_stopping_criteria(server, reference, proposer):
    from specwire_plugin_example import StopOnTokens

    plain = _reference(reference)
    stop = int(plain[0, PROMPTS.shape[1] + 3])  # row 0 stops at its 4th token (or earlier)
    with TargetClient(server.address) as client:
        out = client.generate(
            PROMPTS[:1],
            max_new_tokens=8,
            proposer=proposer,
            stopping_criteria=[{"name": "stop_on_tokens", "args": {"token_ids": [stop]}}],
        )
    want = _reference(reference, PROMPTS[:1], stopping_criteria=[StopOnTokens([stop], PROMPTS.shape[1])])
    assert want.shape[1] < plain.shape[1]
    assert torch.equal(out.sequences, want)
    assert out.finish_reasons == ["stopping_criterion"]


def test_plugins_in_a_stream(server, reference):
    from specwire_plugin_example import StopOnTokens

    stop = int(_reference(reference, PROMPTS[:1])[0, PROMPTS.shape[1] + 2])
    with TargetClient(server.address) as client:
        items = list(
            client.stream(
                PROMPTS[:1],
                max_new_tokens=8,
                stopping_criteria=[{"name": "stop_on_tokens", "args": {"token_ids": [stop]}}],
            )
        )
    want = _reference(reference, PROMPTS[:1], stopping_criteria=[StopOnTokens([stop], PROMPTS.shape[1])])
    assert torch.equal(items[-1].sequences, want) and items[-1].finish_reasons == ["stopping_criterion"]


def test_max_sentences_counts_the_generated_sentences(registry, loaded):
    from specwire.generation.plugins import PluginContext

    prompt = loaded.tokenizer("Hello. Hi!", return_tensors="pt").input_ids
    context = PluginContext(loaded.tokenizer, loaded.vocab_size, torch.device("cpu"), None, prompt.shape[1])
    (criterion,) = registry.build("stopping_criteria", "stopping_criteria", [("max_sentences", {"n": 2})], context)
    rows = [prompt]
    for text in [" One", " One. Two", " One. Two?"]:
        rows.append(torch.cat([prompt, loaded.tokenizer(text, return_tensors="pt").input_ids], dim=1))
    assert [bool(criterion(row, None)) for row in rows] == [False, False, False, True]


def _refused(server, **kwargs):
    with TargetClient(server.address) as client:
        with pytest.raises(SpecwireRpcError) as info:
            client.generate(PROMPTS, max_new_tokens=4, **kwargs)
    return info.value


def test_unknown_or_not_enabled_plugin_is_invalid_argument(server):
    error = _refused(server, processors=[{"name": "ban_tokens", "args": {"token_ids": [1]}}, {"name": "nope"}])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.violations[0].field == "processors[1].name"
    assert "ban_tokens" in error.violations[0].message and "raising" in error.violations[0].message
    # A stopping criterion is not a processor.
    error = _refused(server, stopping_criteria=[{"name": "ban_tokens", "args": {"token_ids": [1]}}])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.violations[0].field == "stopping_criteria[0].name"


@pytest.mark.parametrize("args", [{}, {"token_ids": [10**9]}, {"token_ids": "x"}])
def test_bad_plugin_args_are_invalid_argument_with_the_plugins_message(server, args):
    error = _refused(server, processors=[{"name": "ban_tokens", "args": args}])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.violations[0].field == "processors[0].args"
    assert "ban_tokens" in error.violations[0].message and "token_ids" in error.violations[0].message


@pytest.mark.parametrize(
    "field, name",
    [("processors", "raising"), ("processors", "buggy_factory"), ("stopping_criteria", "raising_stop")],
)
def test_a_plugins_bug_is_internal_naming_it_and_the_server_goes_on(server, field, name):
    error = _refused(server, **{field: [{"name": name}]})
    assert error.code() == grpc.StatusCode.INTERNAL
    assert repr(name) in error.details() and "error id" in error.details()
    assert "secret internal detail" not in error.details() and "Traceback" not in error.details()
    with TargetClient(server.address) as client:
        assert client.generate(PROMPTS, max_new_tokens=3).sequences.shape == (2, PROMPTS.shape[1] + 3)


def test_model_info_lists_the_enabled_plugins(server):
    with TargetClient(server.address) as client:
        info = client.model_info()
    listed = {(p.name, p.kind): p.description for p in info.plugins}
    assert set(listed) == {
        ("ban_tokens", "logits_processor"),
        ("raising", "logits_processor"),
        ("buggy_factory", "logits_processor"),
        ("stop_on_tokens", "stopping_criteria"),
        ("max_sentences", "stopping_criteria"),
        ("raising_stop", "stopping_criteria"),
    }
    assert listed[("ban_tokens", "logits_processor")].startswith("Bans token ids")


@pytest.mark.parametrize(
    "names, says",
    [
        (["no_such_plugin"], "not installed"),
        (["unimportable"], "failed to import"),
    ],
)
def test_load_plugins_refuses_missing_or_broken(plugin_paths, names, says):
    with pytest.raises(PluginLoadError, match=says):
        load_plugins(names)


def test_target_service_refuses_to_start_with_a_missing_plugin(plugin_paths):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(plugin_paths), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "specwire.target_service", "--port", "0", "--model", "unused", "--plugins", "nope"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "target-service: --plugins: plugin 'nope' is not installed" in done.stderr
    assert "ban_tokens" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("argument", ["custom_generate", "logits_processor"])
def test_custom_generate_and_callables_are_refused_pointing_at_plugins(server, argument):
    error = _refused(server, **{argument: "someone/some-repo"})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.violations[0].field == f"overrides.{argument}"
    sends = "generate_method=" if argument == "custom_generate" else "processors="
    assert "--plugins" in error.violations[0].message and sends in error.violations[0].message


def test_cli_processor_and_stopping_criterion(server, capsys):
    import json

    from specwire.client.cli import main

    base = ["generate", "Hello", "--address", server.address, "--no-chat", "--json", "--proposer", "none"]
    base += ["--set", "max_new_tokens=6"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["sequences"][0]
    prompt_len = len(plain) - 6
    banned, stop = plain[prompt_len], plain[prompt_len + 1]
    options = ["--processor", f'ban_tokens={{"token_ids": [{banned}]}}', "--stopping-criterion", "raising_stop"]
    assert main([*base, *options[:2]]) == 0
    assert json.loads(capsys.readouterr().out)["sequences"][0][prompt_len] != banned
    assert main([*base, "--stopping-criterion", f'stop_on_tokens={{"token_ids": [{stop}]}}']) == 0
    output = json.loads(capsys.readouterr().out)
    assert output["finish_reasons"] == ["stopping_criterion"] and output["sequences"][0][-1] == stop
    assert main([*base, *options[2:]]) == 1
    assert "INTERNAL" in capsys.readouterr().err
    assert main([*base, "--processor", "ban_tokens={not json"]) != 0
    assert "--processor" in capsys.readouterr().err


def test_a_plugin_with_the_structured_output_mask(server, loaded):
    """The mask allows "yes" or "no"; banning every token that could start "yes" leaves "no" (the order of
    the two is checked in tests/unit/test_processors_factory.py)."""
    tokenizer = loaded.tokenizer
    starts_yes = [i for i in range(loaded.vocab_size) if (t := tokenizer.decode([i])) and "yes".startswith(t)]
    with TargetClient(server.address) as client:
        free = client.generate(text="Hi", max_new_tokens=8, structured_output={"choice": ["yes", "no"]})
        banned = client.generate(
            text="Hi",
            max_new_tokens=8,
            structured_output={"choice": ["yes", "no"]},
            processors=[{"name": "ban_tokens", "args": {"token_ids": starts_yes}}],
        )
    assert free.text[0] in ("yes", "no")
    assert banned.text == ["no"] and banned.finish_reasons == ["eos"]
