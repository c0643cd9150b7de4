"""Token selection from processed scores: greedy argmax and multinomial sampling, vectorised over rows.

Every random draw goes through an explicit `torch.Generator`, never the global RNG, so that a
request's seed fixes its tokens whatever else runs in the process. A fresh generator seeded with `s`
yields the same stream as the global generator after `torch.manual_seed(s)`, which is why a single
seeded request reproduces transformers' `generate()` token for token.
"""

from __future__ import annotations

import numpy as np
import torch


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """
    A generator for one request's random draws.

    Args:
        seed (`int`, *optional*):
            Seed; without one the generator is seeded from the operating system's entropy.
        device (`torch.device` or `str`, *optional*, defaults to `"cpu"`):
            Device of the tensors it will sample from (a CUDA tensor needs a CUDA generator).

    Returns:
        `torch.Generator`
    """
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


# The score dtypes `greedy_tokens` hands to numpy on the CPU (the loops pick from float32 scores; no bfloat16 in numpy).
_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64)


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """
    The highest-scoring token of each row: `torch.argmax(scores, dim=-1)`, the same indices (the first on ties,
    a NaN counting as the highest).

    On the CPU, float32 and float64 scores go through numpy's argmax: torch's takes ~145 us for one row of a
    49k vocabulary on one thread, numpy's ~10 us, and a decoding step's argmax is part of the Python a request
    runs between forwards (under load, every request's holds up the next packed forward).

    Args:
        scores (`torch.FloatTensor` of shape `(..., vocab_size)`):
            Processed scores.

    Returns:
        `torch.LongTensor` of shape `(...)`.
    """
    if (
        scores.device.type == "cpu"
        and scores.dtype in _NUMPY_ARGMAX_DTYPES
        and scores.shape[-1]
        and not scores.requires_grad
    ):
        return torch.from_numpy(np.asarray(scores.numpy().argmax(axis=-1)))
    return torch.argmax(scores, dim=-1)


def sample_tokens(scores: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """
    One token per row drawn from `softmax(scores)`.

    Args:
        scores (`torch.FloatTensor` of shape `(rows, vocab_size)`):
            Processed scores; `-inf` entries have probability 0.
        generator (`torch.Generator`, *optional*):
            Source of randomness (on the scores' device).

    Returns:
        `torch.LongTensor` of shape `(rows,)`.
    """
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def select_tokens(scores: torch.Tensor, *, do_sample: bool, generator: torch.Generator | None) -> torch.Tensor:
    """
    Greedy or sampled next tokens, one per row.

    Args:
        scores (`torch.FloatTensor` of shape `(rows, vocab_size)`):
            Processed scores.
        do_sample (`bool`):
            Sample instead of taking the argmax.
        generator (`torch.Generator`, *optional*):
            Source of randomness when sampling.

    Returns:
        `torch.LongTensor` of shape `(rows,)`.
    """
    if do_sample:
        return sample_tokens(scores, generator)
    return greedy_tokens(scores)


def sample_without_replacement(
    scores: torch.Tensor, num_samples: int, generator: torch.Generator | None
) -> torch.Tensor:
    """
    `num_samples` distinct indices per row drawn from `softmax(scores)` (beam-sample's candidate draw).

    Args:
        scores (`torch.FloatTensor` of shape `(rows, n)`):
            Accumulated log-probabilities (for beam search, `n = num_beams * vocab_size`).
        num_samples (`int`):
            Indices to draw per row.
        generator (`torch.Generator`, *optional*):
            Source of randomness.

    Returns:
        `torch.LongTensor` of shape `(rows, num_samples)`, in draw order.
    """
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=num_samples, replacement=False, generator=generator)


__all__ = ["greedy_tokens", "make_generator", "sample_tokens", "sample_without_replacement", "select_tokens"]
