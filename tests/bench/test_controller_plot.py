"""`bench.controller_plot`: the controller's draft length per round, drawn from a response's runs."""

from __future__ import annotations

import pytest

from bench.controller_plot import expand_runs, plot_draft_lengths


def test_expand_runs_gives_every_round_in_order():
    assert expand_runs([(3, 2), (0, 4), [2, 1]]) == [3, 3, 0, 0, 0, 0, 2]
    assert expand_runs([]) == []
    with pytest.raises(ValueError, match="length >= 0"):
        expand_runs([(-1, 2)])


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_plot_writes_the_figure(tmp_path, suffix, magic):
    path = plot_draft_lengths(
        {"chat": [(3, 5), (0, 4), (2, 1), (0, 8)], "code": [(12, 20)]},
        tmp_path / f"controller{suffix}",
        "tiny model, draft model",
        tokens_without_draft={"chat": 12},
    )
    data = path.read_bytes()
    assert data.startswith(magic) and len(data) > 1000
    if suffix == ".svg":
        assert b"<svg" in data


def test_plot_of_no_rounds_still_writes_a_figure(tmp_path):
    path = plot_draft_lengths({"plain": []}, tmp_path / "empty.png")
    assert path.read_bytes().startswith(b"\x89PNG")
