"""Green-list watermarking (Kirchenbauer et al., arXiv 2306.04634), bit-identical to transformers.

Each row's green list is a prefix of `torch.randperm(vocab_size)` drawn from a `torch.Generator`
seeded from the row's context, so the same seed on the same device type gives the same list as
transformers' `WatermarkLogitsProcessor` (and its detector). The generator is reseeded before every
draw, so no state carries over between calls.
"""

from __future__ import annotations

import logging
import numbers

import torch

logger = logging.getLogger(__name__)

_TABLE_SIZE = 1_000_003  # size of the fixed permutation used by "selfhash" seeding
_SELFHASH_CANDIDATES = 40  # top tokens checked one by one by "selfhash"
_fixed_tables: dict[tuple[int, str], torch.Tensor] = {}


def _fixed_table(hashing_key: int, device: torch.device) -> torch.Tensor:
    """`randperm(1_000_003)` drawn from a generator seeded with `hashing_key`; cached per key and device."""
    key = (hashing_key, str(device))
    if key not in _fixed_tables:
        generator = torch.Generator(device=device)
        generator.manual_seed(hashing_key)
        _fixed_tables[key] = torch.randperm(_TABLE_SIZE, generator=generator, device=device)
    return _fixed_tables[key]


class WatermarkLogitsProcessor:
    r"""Adds `bias` to a pseudo-random "green list" of `int(vocab_size * greenlist_ratio)` tokens per row.

    Seeding schemes: `"lefthash"` seeds with `hashing_key * last_token`; `"selfhash"` tries the 40
    highest-scoring candidates `c`, seeds with `min(hashing_key * T[ctx] * T[c])` over the last
    `context_width` tokens of `row + [c]` (`T` a fixed permutation table, int64 arithmetic with
    wrap-around), and keeps `c` green when it lies in its own green list. Rows shorter than
    `context_width` are left unchanged (with a warning).

    Args:
        vocab_size (`int`):
            The model's vocabulary size (the permutation size).
        device (`str` or `torch.device`, *optional*):
            Unused: generators are created on the scores' device at call time. Kept for signature parity.
        greenlist_ratio (`float`, *optional*, defaults to 0.25):
            Green share of the vocabulary, in `(0, 1)`.
        bias (`float`, *optional*, defaults to 2.0):
            Added to green scores.
        hashing_key (`int`, *optional*, defaults to 15485863):
            Key mixed into every seed.
        seeding_scheme (`str`, *optional*, defaults to `"lefthash"`):
            `"lefthash"` or `"selfhash"`.
        context_width (`int`, *optional*, defaults to 1):
            Number of previous tokens used for seeding (selfhash; lefthash only uses the last one).
    """

    # Declared here: typeshed does not register `int`/`float` as `numbers.Integral`/`Real`, so mypy reads
    # everything after the isinstance checks in `__init__` as unreachable.
    vocab_size: int
    greenlist_size: int
    bias: float
    hashing_key: int
    seeding_scheme: str
    context_width: int

    def __init__(
        self,
        vocab_size: int,
        device: str | torch.device | None = None,
        greenlist_ratio: float = 0.25,
        bias: float = 2.0,
        hashing_key: int = 15485863,
        seeding_scheme: str = "lefthash",
        context_width: int = 1,
    ):
        if seeding_scheme not in ("selfhash", "lefthash"):
            raise ValueError(f"`seeding_scheme` has to be 'lefthash' or 'selfhash', but is {seeding_scheme!r}.")
        if not isinstance(greenlist_ratio, numbers.Real) or not 0.0 < greenlist_ratio < 1.0:
            raise ValueError(
                f"`greenlist_ratio` has to be in (0, 1) exclusively (e.g. 0.25), but is {greenlist_ratio!r}."
            )
        if isinstance(context_width, bool) or not isinstance(context_width, numbers.Integral) or context_width < 1:
            raise ValueError(f"`context_width` has to be a positive integer, but is {context_width!r}.")
        if isinstance(hashing_key, bool) or not isinstance(hashing_key, numbers.Integral):
            raise ValueError(f"`hashing_key` has to be an integer, but is {hashing_key!r}.")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < 1:
            raise ValueError(f"`vocab_size` has to be a positive integer, but is {vocab_size!r}.")
        self.vocab_size = int(vocab_size)
        self.greenlist_size = int(self.vocab_size * greenlist_ratio)
        self.bias = bias
        self.hashing_key = int(hashing_key)
        self.seeding_scheme = seeding_scheme
        self.context_width = int(context_width)
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device)
        return self._generators[key]

    def _greenlist(self, seed: int, device: torch.device) -> torch.Tensor:
        generator = self._generator(device)
        generator.manual_seed(seed % (2**64 - 1))
        return torch.randperm(self.vocab_size, device=device, generator=generator)[: self.greenlist_size]

    def _selfhash_seed(self, context: torch.Tensor, table: torch.Tensor) -> int:
        window = context[-self.context_width :]
        # int64 products may wrap around; that is part of the reference's seeds, so stay in int64 tensors.
        a = table[window % _TABLE_SIZE] + 1
        b = table[window[-1] % _TABLE_SIZE] + 1
        return int((self.hashing_key * a * b).min().item())

    def greenlist_ids(self, prefix: torch.Tensor) -> torch.Tensor:
        """transformers' `_get_greenlist_ids`: the green list seeded from `prefix` (`[len]`, at least
        `context_width` tokens; selfhash seeds from its last `context_width`, lefthash from its last one)."""
        if self.seeding_scheme == "lefthash":
            return self._greenlist(self.hashing_key * int(prefix[-1].item()), prefix.device)
        return self._greenlist(
            self._selfhash_seed(prefix, _fixed_table(self.hashing_key, prefix.device)), prefix.device
        )

    def _row_greenlist(self, row: torch.Tensor, row_scores: torch.Tensor) -> torch.Tensor:
        if self.seeding_scheme == "lefthash":
            return self._greenlist(self.hashing_key * int(row[-1].item()), row.device)
        table = _fixed_table(self.hashing_key, row.device)
        _, ranked = row_scores.sort(dim=-1, descending=True)
        green = []
        for candidate in ranked[: min(_SELFHASH_CANDIDATES, ranked.shape[0])]:
            seed = self._selfhash_seed(torch.cat([row, candidate[None]]), table)
            if bool((self._greenlist(seed, row.device) == candidate).any()):
                green.append(int(candidate))
        return torch.tensor(green, dtype=torch.long, device=row.device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] < self.context_width:
            logger.warning(
                "Watermarking needs at least %d tokens of context but the rows have %d; skipping this step.",
                self.context_width,
                input_ids.shape[-1],
            )
            return scores
        out = scores.clone()  # [rows, vocab]
        for r in range(input_ids.shape[0]):
            green = self._row_greenlist(input_ids[r], scores[r]).to(scores.device)
            out[r, green] = out[r, green] + self.bias
        return out
