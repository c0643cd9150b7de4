"""Fixtures for parity tests: the embedded SmolLM2, loaded once per session (about 20 s on CPU)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model (`load_model("default")`): SmolLM2-135M-Instruct, dequantized from GGUF.

    Its `.model` is a transformers `LlamaForCausalLM`, so the same object also serves as the reference
    (`smollm.model.generate(...)`): loading the GGUF a second time would double the fixture's cost.
    """
    from specwire.models import load_model

    return load_model("default", progress=False)
