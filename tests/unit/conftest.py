"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.eval()
    return model
