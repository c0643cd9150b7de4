"""A speculative row's ids are kept as a tensor between calls (`_Row.ids`): whatever the order of reads and
growth, they equal the prompt and the generated tokens (and the extra ones asked for) built afresh."""

from __future__ import annotations

import random

import torch

from specwire.generation.loops.speculative_rounds import _Row


def fresh(row: _Row, extra: list[int]) -> torch.Tensor:
    return torch.cat([row.prompt, torch.tensor(row.generated + extra, dtype=row.prompt.dtype)])[None]


def test_ids_equal_a_fresh_build_through_reads_and_growth():
    rng = random.Random(0)
    row = _Row(torch.tensor([0, 0, 7, 8]), [9], processors=None, criteria=None, schedule=None)
    last_extra: list[int] = []
    for _ in range(500):
        action = rng.random()
        if action < 0.4:  # a read, with or without extra tokens
            extra = [rng.randrange(4) for _ in range(rng.randrange(3))]
            assert torch.equal(row.ids(extra), fresh(row, extra))
            last_extra = extra or last_extra
        elif action < 0.6 and last_extra:  # grows by what the last read appended (a plain round's token)
            row.generated += last_extra
        else:  # grows by something else: a rejected draft's correction, or the same tokens once more
            row.generated += [rng.randrange(4) for _ in range(rng.randrange(1, 3))]
    assert torch.equal(row.ids(), fresh(row, []))


def test_the_same_tokens_twice_without_a_read_between_are_both_counted():
    row = _Row(torch.tensor([1, 2]), [3], processors=None, criteria=None, schedule=None)
    assert row.ids([5]).tolist() == [[1, 2, 3, 5]]
    row.generated += [5]
    assert row.ids().tolist() == [[1, 2, 3, 5]]
    row.generated += [5]  # the last read's extra again: not the tensor of that read
    assert row.ids().tolist() == [[1, 2, 3, 5, 5]]
