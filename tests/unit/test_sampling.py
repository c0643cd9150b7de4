"""Token selection: `greedy_tokens` gives `torch.argmax`'s indices on every path it takes."""

from __future__ import annotations

import pytest
import torch

from specwire.generation.sampling import greedy_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(49152,), (1, 49152), (8, 49152), (3, 5, 1000)])
def test_greedy_tokens_are_torch_argmax(shape, dtype):
    scores = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    tokens = greedy_tokens(scores)
    assert tokens.dtype == torch.long and tokens.shape == scores.shape[:-1]
    assert torch.equal(tokens, torch.argmax(scores, dim=-1))


def test_greedy_tokens_ties_infinities_nan_and_views_as_torch():
    scores = torch.randn(5, 100, generator=torch.Generator().manual_seed(1))
    scores[0, [3, 7]] = float("nan")  # the first NaN counts as the highest
    scores[1, [5, 9]] = 1e9  # ties: the first index
    scores[2] = -float("inf")  # everything masked: index 0
    scores[3, [2, 50]] = float("inf")
    scores[4, 60] = float("nan")
    scores[4, 10] = float("inf")
    expected = torch.argmax(scores, dim=-1)
    assert greedy_tokens(scores).tolist() == expected.tolist() == [3, 5, 0, 2, 60]
    strided = scores[:, ::3]
    assert torch.equal(greedy_tokens(strided), torch.argmax(strided, dim=-1))
    with torch.inference_mode():
        inference = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
        assert torch.equal(greedy_tokens(inference), torch.argmax(inference, dim=-1))
    wants_grad = torch.randn(2, 30, requires_grad=True)
    assert torch.equal(greedy_tokens(wants_grad), torch.argmax(wants_grad, dim=-1))
