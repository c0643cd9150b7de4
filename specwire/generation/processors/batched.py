"""The common processors of many requests applied as one batch, with per-row parameters as tensors.

A request's processor list is *batchable* when it holds only these, in the factory's order:
repetition penalty, temperature, top-k, top-p, min-p (what almost every sampling config uses).
`RowChain.of` reads their parameters; `BatchedChains.apply` stacks the scores of many requests'
rows and runs each stage once for all of them, with one parameter per row (`[rows]` tensors built
once per batch composition and reused while it stays the same). A stage no row uses is skipped;
rows that do not use a stage are masked out of it, so their scores pass through unchanged.

Every stage is the per-request processor's own sequence of tensor operations, row by row: the
same sort, softmax, cumsum and top-k per row, parameters in float32 as a Python scalar is cast
when a float32 tensor meets it. So a row's processed scores are bitwise those of its own processor
list, whatever the other rows are (tested), and a seeded request samples the same tokens whatever
its neighbours. Anything else (bias, n-gram bans, length processors, typical/epsilon/eta/top-h,
watermarks, guidance) is not batchable: such a request applies its own list (`RowChain.of` gives
`None`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .penalties import RepetitionPenaltyLogitsProcessor
from .warpers import NEG_INF, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

# Stage order: the factory's (transformers') order of these processors.
_STAGES = (
    (RepetitionPenaltyLogitsProcessor, "repetition"),
    (TemperatureLogitsWarper, "temperature"),
    (TopKLogitsWarper, "top_k"),
    (TopPLogitsWarper, "top_p"),
    (MinPLogitsWarper, "min_p"),
)
_STAGE_NAMES = tuple(name for _, name in _STAGES)


@dataclass(frozen=True, eq=False)
class RowChain:
    """
    The batchable processors of one request (`None` fields: stage not used).

    Args:
        repetition (`RepetitionPenaltyLogitsProcessor`, *optional*): its penalty and ignored prefix.
        temperature (`TemperatureLogitsWarper`, *optional*): its divisor.
        top_k (`TopKLogitsWarper`, *optional*): `top_k` (already raised to `min_tokens_to_keep`).
        top_p (`TopPLogitsWarper`, *optional*): `top_p` and `min_tokens_to_keep`.
        min_p (`MinPLogitsWarper`, *optional*): `min_p` and `min_tokens_to_keep`.
    """

    repetition: RepetitionPenaltyLogitsProcessor | None = None
    temperature: TemperatureLogitsWarper | None = None
    top_k: TopKLogitsWarper | None = None
    top_p: TopPLogitsWarper | None = None
    min_p: MinPLogitsWarper | None = None

    @classmethod
    def of(cls, processors: Sequence[Any]) -> RowChain | None:
        """The chain of a processor list, or `None` when the list holds anything else (or is empty)."""
        found: dict[str, Any] = {}
        stage = 0
        for processor in processors:
            while stage < len(_STAGES) and type(processor) is not _STAGES[stage][0]:
                stage += 1
            if stage == len(_STAGES):
                return None  # unknown processor, or a known one out of order
            found[_STAGES[stage][1]] = processor
            stage += 1
        return cls(**found) if found else None


class BatchedChains:
    """Applies many requests' `RowChain`s to their rows in one pass per stage (see the module docstring)."""

    def __init__(self) -> None:
        # The last batch's chains (held, so no new chain can reuse their memory) and row counts.
        self._chains: tuple[RowChain, ...] = ()
        self._sizes: tuple[int, ...] = ()
        self._params: dict[str, Any] = {}

    def apply(self, items: Sequence[tuple[RowChain, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """
        Processed scores for each item.

        Args:
            items (`Sequence[tuple[RowChain, torch.Tensor, torch.Tensor]]`):
                `(chain, input_ids [rows_i, len_i], scores [rows_i, vocab])` per item; lengths may differ.

        Returns:
            `list[torch.Tensor]`: each item's processed scores `[rows_i, vocab]`, a tensor of its own.
        """
        sizes = [scores.shape[0] for _, _, scores in items]
        scores = torch.cat([s for _, _, s in items]) if len(items) > 1 else items[0][2]
        params = self._gather([chain for chain, _, _ in items], sizes, scores.device)
        vocab = scores.shape[-1]
        if "repetition" in params:
            scores = _repetition(scores, items, params["repetition"], vocab)
        if "temperature" in params:
            scores = scores / params["temperature"]
        if "top_k" in params:
            k, uses = params["top_k"]
            kth = torch.topk(scores, int(min(k.max(), vocab))).values.gather(1, (k.clamp(max=vocab) - 1)[:, None])
            scores = scores.masked_fill(_only(scores < kth, uses), NEG_INF)
        if "top_p" in params:
            scores = _top_p(scores, *params["top_p"])
        if "min_p" in params:
            scores = _min_p(scores, *params["min_p"])
        if len(items) == 1:
            return [scores]  # a new tensor: every stage returns one
        # Copies: a view would keep the whole batch's scores alive as long as a request keeps its own.
        return [part.clone() for part in torch.split(scores, sizes)]

    def _gather(self, chains: list[RowChain], sizes: list[int], device: torch.device) -> dict[str, Any]:
        """`[rows]` parameter tensors of the stages some row uses; rebuilt only when the batch changes."""
        same = len(chains) == len(self._chains) and all(a is b for a, b in zip(chains, self._chains, strict=True))
        if same and tuple(sizes) == self._sizes:
            return self._params

        def per_row(stage: str, read: Callable[[Any], Any], default: Any) -> list[Any]:
            """One value per row: `read(processor)` for rows using `stage`, else `default`."""
            values = []
            for chain, n in zip(chains, sizes, strict=True):
                processor = getattr(chain, stage)
                values += [default if processor is None else read(processor)] * n
            return values

        def tensor(stage: str, read: Callable[[Any], Any], default: Any, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(per_row(stage, read, default), dtype=dtype, device=device)

        def uses(stage: str) -> torch.Tensor | None:
            """`[rows]` mask of the rows using `stage`; `None` when all do (no masking needed)."""
            if all(getattr(chain, stage) is not None for chain in chains):
                return None
            return tensor(stage, lambda _: True, False, torch.bool)

        used = {stage for chain in chains for stage in _STAGE_NAMES if getattr(chain, stage) is not None}
        params: dict[str, Any] = {}
        if "repetition" in used:
            # Rows without a penalty have no ids present (and a penalty of 1.0, which would be exact).
            params["repetition"] = tensor("repetition", lambda p: p.penalty, 1.0, torch.float32)[:, None]
        if "temperature" in used:
            # Rows without temperature divide by 1.0, which is exact.
            params["temperature"] = tensor("temperature", lambda p: p.temperature, 1.0, torch.float32)[:, None]
        if "top_k" in used:
            params["top_k"] = (tensor("top_k", lambda p: p.top_k, 1, torch.long), uses("top_k"))
        if "top_p" in used:
            # `1 - top_p` in Python, then float32: what `tensor <= (1 - top_p)` compares against.
            below = tensor("top_p", lambda p: 1 - p.top_p, 0.0, torch.float32)[:, None]
            # The per-row list, then one int shared by every row or a `[rows]` tensor.
            keep: Any = per_row("top_p", lambda p: p.min_tokens_to_keep, 1)
            keep = keep[0] if len(set(keep)) == 1 else torch.tensor(keep, dtype=torch.long, device=device)
            params["top_p"] = (below, keep, uses("top_p"))
        if "min_p" in used:
            min_p = tensor("min_p", lambda p: p.min_p, 0.0, torch.float32)[:, None]
            params["min_p"] = (min_p, per_row("min_p", lambda p: p.min_tokens_to_keep, 0), uses("min_p"))
        self._chains, self._sizes, self._params = tuple(chains), tuple(sizes), params
        return params


def _repetition(
    scores: torch.Tensor,
    items: Sequence[tuple[RowChain, torch.Tensor, torch.Tensor]],
    penalty: torch.Tensor,
    vocab: int,
) -> torch.Tensor:
    """`RepetitionPenaltyLogitsProcessor` per row: one presence mask for every row, ids padded with `vocab`."""
    ids = []
    for chain, input_ids, _ in items:
        if chain.repetition is None:
            ids.append(input_ids[:, :0])  # nothing present: the row passes through
            continue
        rows = input_ids
        ignore = chain.repetition.prompt_ignore_length
        if isinstance(ignore, torch.Tensor):
            positions = torch.arange(rows.shape[1], device=rows.device)
            rows = rows.masked_fill(positions[None, :] < ignore.to(rows.device)[:, None], vocab)
        elif ignore is not None:
            rows = rows[:, int(ignore) :]
        ids.append(rows)
    width = max(r.shape[1] for r in ids)
    padded = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=vocab) for r in ids])
    present = torch.zeros((scores.shape[0], vocab + 1), dtype=torch.bool, device=scores.device)
    present.scatter_(1, padded.clamp(max=vocab), True)
    present = present[:, :vocab]
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(present, penalised, scores)


def _only(drop: torch.Tensor, uses: torch.Tensor | None) -> torch.Tensor:
    """`drop` limited to the rows in `uses` (`None`: every row)."""
    return drop if uses is None else drop & uses[:, None]


def _top_p(
    scores: torch.Tensor, below: torch.Tensor, keep: int | torch.Tensor, uses: torch.Tensor | None
) -> torch.Tensor:
    """`TopPLogitsWarper` per row: drop the ascending tail whose mass is at most `1 - top_p`."""
    vocab = scores.shape[-1]
    ascending, order = torch.sort(scores, descending=False)
    drop_sorted = ascending.softmax(dim=-1).cumsum(dim=-1) <= below
    # The `min_tokens_to_keep` highest stay (`keep`: one count for all rows, or one per row).
    if isinstance(keep, int):
        drop_sorted[..., -keep:] = False
    else:
        drop_sorted &= torch.arange(vocab, device=scores.device)[None, :] < (vocab - keep)[:, None]
    drop_sorted = _only(drop_sorted, uses)
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, NEG_INF)


def _min_p(scores: torch.Tensor, min_p: torch.Tensor, keep: list[int], uses: torch.Tensor | None) -> torch.Tensor:
    """`MinPLogitsWarper` per row: drop tokens below `min_p` times the top probability."""
    probs = torch.softmax(scores, dim=-1)
    drop = _only(probs < min_p * probs.amax(dim=-1, keepdim=True), uses)
    # The `min_tokens_to_keep` most probable stay: one top-k per distinct count, as each row's own.
    for count in sorted(set(keep) - {0}):
        rows = torch.tensor([r for r, c in enumerate(keep) if c == count], device=scores.device)
        best = torch.topk(probs[rows], min(count, probs.shape[-1]), dim=-1).indices
        drop[rows] = drop[rows].scatter(-1, best, False)
    return scores.masked_fill(drop, NEG_INF)


__all__ = ["BatchedChains", "RowChain"]
