"""Shared fixtures: tiny random models on disk, and the embedded default model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A folder with a tiny random Llama (safetensors + config) and a byte-level BPE tokenizer."""
    from tests.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    """A second tiny Llama sharing the tokenizer of `tiny_model_dir`, with other weights (a draft model)."""
    from tests.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), seed=1, num_hidden_layers=1)
