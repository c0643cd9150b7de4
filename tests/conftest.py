"""Shared fixtures: tiny random models on disk, and the embedded default model."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread in every process of the suite: the test processes (`pytest_configure` below) and whatever they
# start, services, the CLI, the README's blocks and the benchmarks, which inherit this environment. The suite runs
# two workers beside the services their tests start, on 2 cores in CI; torch's intra-op pool waits for its threads at
# every op, and with the cores taken by the other worker, a 14-token beam search on a tiny model took 7.5 s instead of
# 0.2. Tests of threading set their own counts.
os.environ["OMP_NUM_THREADS"] = "1"
# GGUF conversions (specwire.models.gguf_cache) of this session go to a folder of its own, shared with
# the services it starts and removed at the end: tests neither read nor fill the user's cache.
if "SPECWIRE_CACHE_DIR" not in os.environ:
    os.environ["SPECWIRE_CACHE_DIR"] = tempfile.mkdtemp(prefix="specwire-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SPECWIRE_CACHE_DIR"], True)


def pytest_configure(config):
    """This process's torch thread count, in case torch was imported before the environment above was set."""
    import torch

    torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def tiny_draft(tiny_draft_dir):
    """`tiny_draft_dir` loaded once (`load_model`), for the tests that only read it: one that changes the model
    (a `Faults` delay) loads its own."""
    from specwire.models import load_model

    return load_model(str(tiny_draft_dir), progress=False)


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model (`load_model("default")`): SmolLM2-135M-Instruct, dequantized from GGUF.

    Its `.model` is a transformers `LlamaForCausalLM`, so the same object also serves as the reference
    (`smollm.model.generate(...)`): loading the GGUF a second time would double the fixture's cost.
    """
    from specwire.models import load_model

    return load_model("default", progress=False)


@pytest.fixture(scope="session")
def smollm_int8(smollm):
    """The embedded model with int8 linear layers: what `load_model("default-int8")` returns.

    Quantized from the session's `smollm` (a copy: `quantize_int8` leaves its input untouched), so
    the GGUF is not loaded a second time.
    """
    from specwire.models import quantize_int8

    return quantize_int8(smollm, progress=False)


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL cluster for the whole run (tests/postgres_server.py); skipped only where
    PostgreSQL or psycopg is not installed."""
    from tests.postgres_server import PostgresServer, find_bin_dir

    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.skip(
            "PostgreSQL is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin): "
            "apt-get install postgresql, or bash scripts/install.sh --dev as root"
        )
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: install the dev extra (pip install -e '.[dev]')")
    server = PostgresServer(bin_dir)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_db(request, tmp_path):
    """The `--db` of a registry test, once per backend: a fresh SQLite file, or a fresh database on the
    session's PostgreSQL cluster (dropped after the test)."""
    if request.param == "sqlite":
        yield str(tmp_path / "registry.db")
        return
    server = request.getfixturevalue("postgres_server")
    url = server.create_database()
    yield url
    server.drop_database(url)
