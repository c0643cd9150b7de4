"""Through a real target service: a request that sets a field specwire accepts and does not act on
gets a warning naming the field, its value and why; one that sets only honoured values gets none."""

from __future__ import annotations

import pytest
import torch

from specwire.client import TargetClient
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from tests.servers import threaded_server
from tests.unit.test_field_treatment import WARNED_VALUES

WARNED_VALUES = {**WARNED_VALUES, "assistant_ensemble_weight": 0.5}  # without a drafter

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    with threaded_server(lambda: build_target_server(loaded)) as server:
        with TargetClient(server.address) as client:
            yield client


@pytest.mark.parametrize("name", sorted(WARNED_VALUES))
def test_a_field_not_honoured_is_a_warning_in_the_response(target, name):
    plain = target.generate(PROMPT, max_new_tokens=4)
    out = target.generate(PROMPT, max_new_tokens=4, **{name: WARNED_VALUES[name]})
    (warning,) = [w for w in out.warnings if w.field == f"config.{name}" and "not honoured" in w.message]
    assert warning.severity == "warning"
    assert torch.equal(out.sequences, plain.sequences)  # accepted, and the output is the plain one


def test_honoured_values_bring_no_warning(target):
    out = target.generate(PROMPT, max_new_tokens=4, cache_implementation="dynamic", output_attentions=False)
    assert out.warnings == []


def test_a_negative_prompt_without_guidance_is_a_warning(target):
    out = target.generate(PROMPT, max_new_tokens=4, negative_prompt_ids=[[3, 4]])
    (warning,) = [w for w in out.warnings if w.field == "negative_prompt"]
    assert "guidance_scale" in warning.message
    guided = target.generate(PROMPT, max_new_tokens=4, negative_prompt_ids=[[3, 4]], guidance_scale=1.5)
    assert not [w for w in guided.warnings if w.field == "negative_prompt"]


def test_a_chat_template_without_text_prompts_is_a_warning(target):
    out = target.generate(PROMPT, max_new_tokens=3, apply_chat_template=True)
    (warning,) = [w for w in out.warnings if w.field == "apply_chat_template"]
    assert "text" in warning.message
    assert torch.equal(out.sequences, target.generate(PROMPT, max_new_tokens=3).sequences)
