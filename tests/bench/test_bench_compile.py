"""`python -m bench.compile --quick`: every mode runs, the figures land in JSON and Markdown, every mode's
tokens are the dynamic cache's, and specwire's compiled mode really ran through torch.compile."""

from __future__ import annotations

import json

import pytest

from bench import compile as bench_compile
from specwire.generation import compilation


def test_quick_mode_reports_every_mode(tiny_model_dir, tmp_path):
    compilation._compiled.clear()
    path = tmp_path / "compile.json"
    report = bench_compile.main(
        [
            "--quick",
            "--model",
            str(tiny_model_dir),
            "--backend",
            "eager",
            "--compile-mode",
            "default",
            "--json",
            str(path),
        ]
    )
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    assert "| specwire static+compiled |" in path.with_suffix(".md").read_text()
    meta = report["meta"]
    assert meta["quick"] is True and (meta["max_new_tokens"], meta["repeats"]) == (8, 1)
    assert meta["compile_config"] == {"_compile_all_devices": True, "backend": "eager", "mode": "default"}
    assert list(report["modes"]) == list(bench_compile.MODES)
    for name, row in report["modes"].items():
        assert row["ids_match"], name
        assert row["tokens_per_second"]["n"] == 1 and row["tokens_per_second"]["median"] > 0, name
    assert report["modes"]["specwire dynamic"]["ratio_to_specwire_dynamic"] == 1.0
    assert compilation._compiled, "the compiled mode did not compile"


def test_an_unknown_mode_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench_compile.main(["--modes", "specwire warp", "--json", str(tmp_path / "x.json")])
