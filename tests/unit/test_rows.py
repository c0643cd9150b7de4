"""The three row types implement the `Rows` interface the decoding loops drive (and `SpeculativeRows`)."""

from __future__ import annotations

import inspect

import pytest
import torch

from specwire.generation.rows import RaggedRows, RowBatch, Rows, SpeculativeRows
from specwire.runtime.slot_cache import SlotRows


def _members(protocol: type) -> set[str]:
    names = set()
    for klass in protocol.__mro__:
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        names |= {name for name in vars(klass) if not name.startswith("_")}
    return names


def _slot_rows() -> SlotRows:
    return SlotRows(
        lambda work: None,
        [0, 1],
        attention_mask=None,
        prompt_length=3,
        rows=2,
        device=torch.device("cpu"),
    )


def test_the_protocols_name_the_steps_the_loops_call():
    assert _members(Rows) == {"padding_lengths", "process", "prefill", "decode", "verify", "rollback", "reorder"}
    assert _members(SpeculativeRows) == _members(Rows) | {"discard"}


@pytest.mark.parametrize("rows", [RowBatch, RaggedRows, _slot_rows()], ids=["RowBatch", "RaggedRows", "SlotRows"])
def test_every_row_type_has_every_step_of_rows(rows):
    missing = {name for name in _members(Rows) if not hasattr(rows, name)}
    assert not missing


@pytest.mark.parametrize("rows", [RaggedRows, SlotRows], ids=["RaggedRows", "SlotRows"])
def test_speculative_rows_verify_ragged_blocks_and_discard(rows):
    assert hasattr(rows, "discard")
    assert "valid" in inspect.signature(rows.verify).parameters
    # A plain RowBatch advances every row by the same amount: it is not speculative rows.
    assert not hasattr(RowBatch, "discard")
