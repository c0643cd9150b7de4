"""`bench.verify_blocks`: one packed forward per block size, three ways, on a model loaded by the real loader."""

from __future__ import annotations

import json

from bench.verify_blocks import FORWARDS, main


def test_every_block_size_is_timed_every_way_and_reported(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "blocks.json"
    result = main(
        ["--model", str(tiny_model_dir), "--blocks", "3,1", "--repeats", "2", "--context", "8", "--json", str(out)]
    )
    medians = result["medians_ms"]
    assert sorted(medians) == [1, 3]
    assert all(set(row) == set(FORWARDS) and all(ms > 0 for ms in row.values()) for row in medians.values())
    table = capsys.readouterr().out
    assert "| 1 |" in table and "| 3 |" in table and "small blocks / lean" in table
    assert json.loads(out.read_text())["medians_ms"]["3"]["lean"] == medians[3]["lean"]
