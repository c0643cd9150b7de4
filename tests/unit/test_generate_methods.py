"""`run_generate_method` on the tiny Llama: what a generate method's output becomes (finish reasons,
scores, warnings), and which outputs break the contract (`PluginFailed`, naming the plugin)."""

from __future__ import annotations

import pytest
import torch

from specwire.errors import FieldProblem
from specwire.generation.config import GenerationConfig
from specwire.generation.generate_methods import (
    GenerateMethodOutput,
    GenerateMethodSteps,
    GenerationStopped,
    GenerationTimedOut,
    run_generate_method,
)
from specwire.generation.planning import prepare_generation
from specwire.generation.plugins import Plugin, PluginFailed

PROMPT = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
PLUGIN = Plugin("fixed", "generate_method", lambda args, context: None)


def _run(model, method, warnings=None, **config):
    special = model.generation_config
    config = GenerationConfig(
        max_new_tokens=4, eos_token_id=special.eos_token_id, pad_token_id=special.pad_token_id, **config
    )
    plan = prepare_generation(model, PROMPT, config=config)
    return run_generate_method(PLUGIN, method, {}, model, plan, check=lambda: None, warnings=warnings)


def _rows(model, *new):
    return torch.cat([PROMPT, torch.tensor(new)], dim=1)


def test_finish_reasons_come_from_the_stopping_criteria_on_each_rows_prefixes(tiny_model):
    eos, pad = tiny_model.generation_config.eos_token_id, tiny_model.generation_config.pad_token_id
    out = _run(tiny_model, lambda inputs: _rows(tiny_model, [40, eos, pad, pad], [41, 42, 43, 44]))
    assert out.finish_reasons == ["eos", "length"] and out.prompt_length == PROMPT.shape[1]
    # Shorter than max_length: every row must have stopped for a reason.
    out = _run(tiny_model, lambda inputs: _rows(tiny_model, [40, eos], [eos, pad]))
    assert out.finish_reasons == ["eos", "eos"]
    given = GenerateMethodOutput(_rows(tiny_model, [40, 41], [42, 43]), finish_reasons=["stopping_criterion"] * 2)
    assert _run(tiny_model, lambda inputs: given).finish_reasons == ["stopping_criterion"] * 2


@pytest.mark.parametrize(
    "output, says",
    [
        (lambda m: _rows(m, [40, 41], [42, 43]), "no stopping criterion met"),
        (lambda m: _rows(m, [40, 41, 42, 43, 44], [1, 2, 3, 4, 5]), "columns"),
        (lambda m: PROMPT, "columns"),
        (lambda m: _rows(m, [40, 10**6], [1, 2]), "outside"),
        (lambda m: _rows(m, [40], [41])[:1], "not int64"),
        (lambda m: GenerateMethodOutput(_rows(m, [40], [41]), finish_reasons=["done", "eos"]), "finish_reasons"),
        (lambda m: "text", "not GenerateMethodOutput"),
    ],
)
def test_outputs_that_break_the_contract_are_the_plugins_bug(tiny_model, output, says):
    with pytest.raises(PluginFailed, match="'fixed'") as info:
        _run(tiny_model, lambda inputs: output(tiny_model))
    assert says in str(info.value.__cause__)


def test_scores_are_kept_when_asked_for_and_a_missing_output_is_a_warning(tiny_model):
    vocab = tiny_model.config.vocab_size
    rows = _rows(tiny_model, [40, 41, 42, 43], [44, 45, 46, 47])
    scores = tuple(torch.zeros(2, vocab) for _ in range(4))
    out = _run(
        tiny_model,
        lambda inputs: GenerateMethodOutput(rows, scores=scores),
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert out.scores is not None and len(out.scores) == 4
    with pytest.raises(PluginFailed):
        _run(
            tiny_model,
            lambda inputs: GenerateMethodOutput(rows, scores=scores[:3]),
            return_dict_in_generate=True,
            output_scores=True,
        )
    warnings: list[FieldProblem] = []
    out = _run(tiny_model, lambda inputs: rows, warnings, return_dict_in_generate=True, output_logits=True)
    assert out.logits is None and [w.field for w in warnings] == ["config.output_logits"]


def test_check_stops_a_cancelled_or_late_method_and_its_stop_is_not_a_plugin_bug(tiny_model):
    def endless(inputs):
        while True:
            inputs.check()

    steps = GenerateMethodSteps(lambda check: _run_with(tiny_model, endless, check))
    steps.cancel()
    with pytest.raises(GenerationStopped):
        next(steps)
    late = GenerateMethodSteps(lambda check: _run_with(tiny_model, endless, check), deadline=0.0)
    with pytest.raises(GenerationTimedOut):
        next(late)
    beats = []
    done = GenerateMethodSteps(
        lambda check: _run_with(
            tiny_model, lambda inputs: (inputs.check(), _rows(tiny_model, [40] * 4, [41] * 4))[1], check
        ),
        heartbeat=lambda: beats.append(1),
    )
    with pytest.raises(StopIteration) as info:
        next(done)
    assert info.value.value.finish_reasons == ["length", "length"] and len(beats) == 2  # before it, and its own


def _run_with(model, method, check):
    special = model.generation_config
    config = GenerationConfig(max_new_tokens=4, eos_token_id=special.eos_token_id, pad_token_id=special.pad_token_id)
    plan = prepare_generation(model, PROMPT, config=config)
    return run_generate_method(PLUGIN, method, {}, model, plan, check=check)
