"""Exact distributions the speculative-sampling tests compare sampled outputs against."""

from __future__ import annotations

import torch
import transformers


def two_token_distribution(model, prompt: list[int], top_k: int) -> dict[tuple[int, int], float]:
    """The exact probability of every two-token continuation of `prompt` under top-k sampling."""
    warp = transformers.TopKLogitsWarper(top_k)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        first = warp(ids, model(input_ids=ids).logits[:, -1].float()).softmax(-1)[0]
        table = {}
        for t1 in first.nonzero().flatten().tolist():
            longer = torch.tensor([prompt + [t1]])
            second = warp(longer, model(input_ids=longer).logits[:, -1].float()).softmax(-1)[0]
            for t2 in second.nonzero().flatten().tolist():
                table[(t1, t2)] = float(first[t1] * second[t2])
    return table
