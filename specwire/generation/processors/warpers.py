"""Sampling warpers: temperature and the truncation rules (top-k, top-p, min-p, top-h, typical, epsilon, eta).

Warpers only reshape the sampling distribution; the factory builds them only when `do_sample` is set.
Truncation keeps at least `min_tokens_to_keep` tokens (the factory uses `len(eos) + 1` for beam
sampling, so a beam can always continue with a non-EOS token). Removed tokens get `filter_value`.
The tensor operations follow transformers' order exactly (sort directions, tie handling), so kept
sets are identical, ties included.
"""

from __future__ import annotations

import numbers

import torch
from torch.distributions import Categorical

NEG_INF = -float("inf")


def _check_min_tokens_to_keep(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`min_tokens_to_keep` has to be a strictly positive integer, but is {value!r}.")
    return int(value)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy `[rows]` of `softmax(logits)`, computed by torch's `Categorical` (the reference's numerics)."""
    return Categorical(logits=logits, validate_args=False).entropy()  # type: ignore[no-untyped-call, no-any-return]  # torch.distributions is untyped


class TemperatureLogitsWarper:
    r"""Divides the scores by `temperature`: < 1 sharpens the distribution, > 1 flattens it.

    Args:
        temperature (`float`):
            Strictly positive float. Use `do_sample=False` for greedy decoding instead of 0.
    """

    def __init__(self, temperature: float):
        if isinstance(temperature, bool) or not isinstance(temperature, float) or not temperature > 0:
            message = (
                f"`temperature` (={temperature}) has to be a strictly positive float, otherwise your next "
                "token scores will be invalid."
            )
            if isinstance(temperature, float) and temperature == 0.0:
                message += " If you're looking for greedy decoding strategies, set `do_sample=False`."
            raise ValueError(message)
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopKLogitsWarper:
    r"""Keeps the `top_k` highest scores; every token tied with the k-th score is kept too.

    Args:
        top_k (`int`):
            Strictly positive; raised to `min_tokens_to_keep` if smaller, capped at the vocabulary.
        filter_value (`float`, *optional*, defaults to `-inf`):
            Score given to removed tokens.
        min_tokens_to_keep (`int`, *optional*, defaults to 1):
            Lower bound on the number of kept tokens.
    """

    # Declared here: typeshed does not register `int`/`float` as `numbers.Integral`/`Real`, so mypy reads
    # everything after the isinstance checks in `__init__` as unreachable.
    min_tokens_to_keep: int
    top_k: int
    filter_value: float

    def __init__(self, top_k: int, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k <= 0:
            raise ValueError(
                f"`top_k` has to be a strictly positive integer (or 0/None to disable it), but is {top_k!r}."
            )
        self.min_tokens_to_keep = _check_min_tokens_to_keep(min_tokens_to_keep)
        self.top_k = max(int(top_k), self.min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1:]  # [rows, 1]
        return scores.masked_fill(scores < kth, self.filter_value)


class TopPLogitsWarper:
    r"""Nucleus sampling: keeps the smallest set of top tokens whose probability mass reaches `top_p`.

    Tokens are sorted by ascending score; those whose cumulative probability (from the bottom) is at
    most `1 - top_p` are removed, except the `min_tokens_to_keep` highest.

    Args:
        top_p (`float`):
            In `[0, 1]`; 0 keeps a single token, 1 keeps everything.
        filter_value (`float`, *optional*, defaults to `-inf`):
            Score given to removed tokens.
        min_tokens_to_keep (`int`, *optional*, defaults to 1):
            Lower bound on the number of kept tokens.
    """

    def __init__(self, top_p: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        top_p = float(top_p)
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"`top_p` has to be a float in [0, 1] (1.0 disables it), but is {top_p}.")
        self.top_p = top_p
        self.filter_value = filter_value
        self.min_tokens_to_keep = _check_min_tokens_to_keep(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ascending, order = torch.sort(scores, descending=False)  # [rows, vocab]
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)  # [rows, vocab]
        drop_sorted = mass_below <= 1 - self.top_p
        drop_sorted[..., -self.min_tokens_to_keep :] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)  # back to vocabulary order
        return scores.masked_fill(drop, self.filter_value)


class MinPLogitsWarper:
    r"""Keeps tokens whose probability is at least `min_p` times the top token's probability.

    Args:
        min_p (`float`):
            In `[0, 1]`; 0 keeps everything.
        filter_value (`float`, *optional*, defaults to `-inf`):
            Score given to removed tokens.
        min_tokens_to_keep (`int`, *optional*, defaults to 1):
            The most probable tokens always kept.
    """

    # Declared here: typeshed does not register `int`/`float` as `numbers.Integral`/`Real`, so mypy reads
    # everything after the isinstance checks in `__init__` as unreachable.
    min_p: float
    filter_value: float
    min_tokens_to_keep: int

    def __init__(self, min_p: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        if isinstance(min_p, bool) or not isinstance(min_p, numbers.Real) or not 0 <= min_p <= 1.0:
            raise ValueError(f"`min_p` has to be a float in the [0, 1] interval (e.g. 0.05), but is {min_p!r}.")
        self.min_p = min_p
        self.filter_value = filter_value
        self.min_tokens_to_keep = _check_min_tokens_to_keep(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)  # [rows, vocab]
        threshold = self.min_p * probs.amax(dim=-1, keepdim=True)  # [rows, 1]
        drop = probs < threshold
        keep = torch.topk(probs, min(self.min_tokens_to_keep, probs.shape[-1]), dim=-1).indices  # [rows, k]
        drop.scatter_(-1, keep, False)
        return scores.masked_fill(drop, self.filter_value)


class TopHLogitsWarper:
    r"""Top-H: keeps the highest-scoring tokens while their entropy contribution stays within `top_h * H`.

    Only the 100 best tokens are candidates: their probabilities `p` are renormalised among
    themselves, `H` is their entropy, and tokens are kept in descending order while the running sum
    of `-p log p` is at most `top_h * H` (the best token is always kept).

    Args:
        top_h (`float`):
            In `(0, 1]`.
        filter_value (`float`, *optional*, defaults to `-inf`):
            Score given to removed tokens.
    """

    top_n = 100

    # Declared here: typeshed does not register `int`/`float` as `numbers.Integral`/`Real`, so mypy reads
    # everything after the isinstance checks in `__init__` as unreachable.
    top_h: float
    filter_value: float

    def __init__(self, top_h: float, filter_value: float = NEG_INF):
        if isinstance(top_h, bool) or not isinstance(top_h, numbers.Real) or not 0 < top_h <= 1:
            raise ValueError(f"`top_h` must be in the range (0, 1] (e.g. 0.4), but is {top_h!r}.")
        self.top_h = top_h
        self.filter_value = filter_value

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n = min(self.top_n, scores.shape[-1])
        top_scores, top_ids = torch.topk(scores, n, dim=-1, largest=True, sorted=True)  # [rows, n]
        dist = Categorical(logits=top_scores, validate_args=False)
        probs = dist.probs  # [rows, n]
        budget = (dist.entropy() * self.top_h).unsqueeze(-1)  # type: ignore[no-untyped-call]  # [rows, 1]; torch.distributions is untyped
        running = torch.cumsum(-probs * torch.log(probs), dim=-1)  # [rows, n]
        keep_top = running <= budget
        keep_top[:, 0] = True
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top_ids, keep_top)  # [rows, vocab]
        return scores.masked_fill(~keep, self.filter_value)


class TypicalLogitsWarper:
    r"""Locally typical sampling (arXiv 2202.00666): keeps tokens whose surprisal is closest to the entropy.

    Tokens are ordered by `|-log p - H|`; the smallest prefix reaching probability `mass` is kept
    (plus everything tied with its last element).

    Args:
        mass (`float`, *optional*, defaults to 0.9):
            In `(0, 1)`.
        filter_value (`float`, *optional*, defaults to `-inf`):
            Score given to removed tokens.
        min_tokens_to_keep (`int`, *optional*, defaults to 1):
            The most typical tokens always kept.
    """

    def __init__(self, mass: float = 0.9, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        mass = float(mass)
        if not 0 < mass < 1:
            raise ValueError(f"`typical_p` has to be a float > 0 and < 1 (1.0 disables it), but is {mass}.")
        self.mass = mass
        self.filter_value = filter_value
        self.min_tokens_to_keep = _check_min_tokens_to_keep(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.nn.functional.log_softmax(scores, dim=-1)  # [rows, vocab]
        entropy = -(logp * torch.exp(logp)).nansum(-1, keepdim=True)  # [rows, 1]
        distance = torch.abs(-logp - entropy)  # [rows, vocab]
        distance_sorted, order = torch.sort(distance, descending=False)
        mass_so_far = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)  # [rows, vocab]
        last = (mass_so_far < self.mass).sum(dim=1).clamp_(max=distance_sorted.shape[-1] - 1)  # [rows]
        drop_sorted = distance_sorted > distance_sorted.gather(1, last.view(-1, 1))
        drop_sorted[..., : self.min_tokens_to_keep] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        return scores.masked_fill(drop, self.filter_value)


class EpsilonLogitsWarper:
    r"""Epsilon sampling (arXiv 2210.15191): removes tokens with probability below `epsilon`.

    Args:
        epsilon (`float`):
            In `(0, 1)`.
        filter_value (`float`, *optional*, defaults to `-inf`):
            Score given to removed tokens.
        min_tokens_to_keep (`int`, *optional*, defaults to 1):
            The highest-scoring tokens always kept.
    """

    def __init__(self, epsilon: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        epsilon = float(epsilon)
        if not 0 < epsilon < 1:
            raise ValueError(f"`epsilon_cutoff` has to be a float > 0 and < 1 (e.g. 3e-4), but is {epsilon}.")
        self.epsilon = epsilon
        self.filter_value = filter_value
        self.min_tokens_to_keep = _check_min_tokens_to_keep(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        drop = scores.softmax(dim=-1) < self.epsilon  # [rows, vocab]
        kth = torch.topk(scores, min(self.min_tokens_to_keep, scores.shape[-1])).values[..., -1:]  # [rows, 1]
        return scores.masked_fill(drop & (scores < kth), self.filter_value)


class EtaLogitsWarper:
    r"""Eta sampling (arXiv 2210.15191): removes tokens below `min(eta, sqrt(eta) * exp(-H))`.

    Args:
        epsilon (`float`):
            `eta_cutoff`, in `(0, 1)`.
        filter_value (`float`, *optional*, defaults to `-inf`):
            Score given to removed tokens.
        min_tokens_to_keep (`int`, *optional*, defaults to 1):
            The highest-scoring tokens always kept.
    """

    def __init__(self, epsilon: float, filter_value: float = NEG_INF, min_tokens_to_keep: int = 1):
        epsilon = float(epsilon)
        if not 0 < epsilon < 1:
            raise ValueError(f"`eta_cutoff` has to be a float > 0 and < 1 (e.g. 3e-4), but is {epsilon}.")
        self.epsilon = epsilon
        self.filter_value = filter_value
        self.min_tokens_to_keep = _check_min_tokens_to_keep(min_tokens_to_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = scores.softmax(dim=-1)  # [rows, vocab]
        # A 0-d float32 tensor, as in the reference: the sqrt/min happen in float32, not in Python doubles.
        eps = torch.tensor(self.epsilon, device=scores.device)
        eta = torch.min(eps, torch.sqrt(eps) * torch.exp(-_entropy(scores)))[..., None]  # [rows, 1]
        kth = torch.topk(scores, min(self.min_tokens_to_keep, scores.shape[-1])).values[..., -1:]  # [rows, 1]
        return scores.masked_fill((probs < eta) & (scores < kth), self.filter_value)
