"""GGUF files are converted once to a safetensors cache folder that loads the same model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specwire.models import gguf_cache, load_model
from tests.unit.test_model_loading import load_in_threads, write_tiny_gguf


@pytest.fixture
def gguf(tiny_model_dir, tmp_path):
    (tmp_path / "model").mkdir()
    return write_tiny_gguf(Path(tiny_model_dir), tmp_path / "model" / "tiny.F32.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECWIRE_CACHE_DIR", str(root))
    monkeypatch.delenv(gguf_cache.SWITCH_ENV, raising=False)
    return root


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([[5, 6, 7, 8]])).logits


def test_first_load_converts_and_later_loads_read_the_same_model(gguf, cache, monkeypatch, capsys):
    monkeypatch.setenv(gguf_cache.SWITCH_ENV, "off")
    direct = load_model(str(gguf), progress=False)
    assert not cache.exists()
    monkeypatch.delenv(gguf_cache.SWITCH_ENV)

    first = load_model(str(gguf))
    err = capsys.readouterr().err
    assert "converting tiny.F32.gguf once" in err
    folders = [p for p in cache.iterdir() if p.is_dir()]
    assert len(folders) == 1 and (folders[0] / "model.safetensors").is_file()
    assert (folders[0] / "specwire-conversion.json").is_file()

    second = load_model(str(gguf))
    err = capsys.readouterr().err
    assert "converting" not in err and str(folders[0]) in err

    for loaded in (first, second):
        assert loaded.source == str(gguf.resolve()) and loaded.model_id == direct.model_id
        want, got = direct.model.state_dict(), loaded.model.state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        assert torch.equal(_logits(loaded.model), _logits(direct.model))
        assert loaded.generation_config == direct.generation_config
        assert loaded.tokenizer("Hello world!").input_ids == direct.tokenizer("Hello world!").input_ids
        assert loaded.max_position_embeddings == direct.max_position_embeddings


def test_a_copy_elsewhere_reuses_the_folder_and_new_content_gets_its_own_key(gguf, cache, tmp_path):
    load_model(str(gguf), progress=False)
    (tmp_path / "clone").mkdir()
    copy = tmp_path / "clone" / gguf.name  # another checkout or virtual environment, same file
    copy.write_bytes(gguf.read_bytes())
    load_model(str(copy), progress=False)
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1
    changed = tmp_path / "clone" / "other.gguf"
    changed.write_bytes(gguf.read_bytes() + b"\0")
    assert gguf_cache._key(changed, cache).split("-")[-1] != gguf_cache._key(gguf, cache).split("-")[-1]


def test_folders_unused_past_the_age_limit_are_pruned(gguf, cache, monkeypatch):
    load_model(str(gguf), progress=False)
    [kept] = [p for p in cache.iterdir() if p.is_dir()]
    stale = cache / "old-0123456789abcdef"
    stale.mkdir()
    (stale / "specwire-conversion.json").write_text("{}")
    month_ago = stale.stat().st_mtime - 31 * 86400
    os.utime(stale / "specwire-conversion.json", (month_ago, month_ago))
    assert gguf_cache.prune(cache, keep=kept) == [stale]
    assert not stale.exists() and kept.exists()
    monkeypatch.setenv(gguf_cache.MAX_AGE_ENV, "0")
    assert gguf_cache.prune(cache, keep=kept) == []  # the folder in use is never pruned


def test_an_unwritable_cache_falls_back_to_loading_the_gguf(gguf, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("SPECWIRE_CACHE_DIR", str(blocker / "cache"))
    loaded = load_model(str(gguf), progress=False)
    assert "GGUF conversion cache not used" in caplog.text
    assert loaded.source == str(gguf.resolve())


def test_concurrent_first_loads_share_one_complete_folder(gguf, cache):
    results = load_in_threads(str(gguf), 2)
    assert len(results) == 2
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1  # no staging folder left behind
    assert torch.equal(_logits(results[0].model), _logits(results[1].model))
