"""Prompt lookup drafting: propose the tokens that followed the last n-gram's earlier occurrence.

A draft without a model (https://github.com/apoorvumang/prompt-lookup-decoding), with the exact
candidate rule of transformers 5.23 `PromptLookupCandidateGenerator.get_candidates`, per row:

1. No candidates when `max_length == cur_len + 1` (the target's bonus token fills the last slot).
2. For `n = min(max_matching_ngram_size, cur_len - 1)` down to 1: scan the windows of `n` tokens
   that equal the row's last `n` tokens, left to right (the first occurrence wins). A match at
   `start` proposes `ids[start + n : min(start + n + num_output_tokens, cur_len, max_length)]`;
   windows with nothing after them are skipped.
3. Processor check (new in 5.x): each proposed token is looked up in the request's logits
   processors applied to constant logits with the proposal so far appended; the proposal is cut
   before the first token they ban (`-inf` or the dtype's minimum). If nothing is left, the next
   match is tried.
4. The first surviving proposal is cut before its first EOS token (an empty result then means no
   candidates; no further match is tried), and the search ends.

Prompt lookup has no draft distribution: verify its candidates with `greedy_accept`, or with
`sampled_accept_without_draft_probs` when sampling. Its draft length is constant
(`prompt_lookup_num_tokens`); transformers applies no schedule to it.

Unlike transformers (batch size 1), rows are independent: each has its own valid tokens (padding
excluded through `attention_mask`) and may have its own lengths and limits.

specwire's own rule (`SuffixMatcher`, the default of `PromptLookupDrafter`): propose what followed
the earlier occurrence that shares the *longest* suffix with the row (at least `min_match` tokens,
compared up to `max_match`; the first occurrence wins ties), and never fall back to a one-token
match. A draft costs verification compute whether or not it is accepted (on 2 CPU cores with
SmolLM2 a 10-token block costs 2.1x a plain step), and one-token matches are mostly wrong: on the
benchmark's code-edit prompt, transformers' rule drafts 410 tokens to get 64 accepted over 128 new
tokens, this rule 170 for 58 (simulated on the greedy output with measured step costs: 1.14x vs
1.41x over plain greedy). The output is the same either way: only the drafts differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch

__all__ = [
    "BannedFn",
    "DEFAULT_MAX_MATCHING_NGRAM_SIZE",
    "SuffixMatcher",
    "banned_fn_from_processors",
    "prompt_lookup_candidates",
]

DEFAULT_MAX_MATCHING_NGRAM_SIZE = 2

# banned_fn(row, prefix_ids [cur_len], candidate_ids [c]) -> BoolTensor [c]: entry i is True when the
# request's processors ban candidate_ids[i] after prefix_ids + candidate_ids[:i]. Entries after the
# first True are never read.
BannedFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# A logits processor for one request: (input_ids [1, len], scores [1, vocab]) -> scores [1, vocab].
Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PerRow = int | Sequence[int] | torch.Tensor


def banned_fn_from_processors(processors: Processor | Sequence[Processor | None], vocab_size: int) -> BannedFn:
    """A `banned_fn` that runs transformers' constant-logits check with each request's processors.

    For candidate `i` the processors see the row's tokens plus candidates `0..i-1` and scores of all
    ones (float32, `[1, vocab_size]`, one tensor per call shared across the candidates as in
    transformers); the candidate is banned if its processed score is `-inf` or `finfo.min`. This is
    a heuristic inherited from transformers: warpers run on flat logits too (so a top-p below 1 can
    ban arbitrary tokens), and processors that only lower scores never ban.

    Args:
        processors (callable, or a sequence with one callable or `None` per row):
            Each request's logits processors (e.g. a `LogitsProcessorList`) taking
            `(input_ids [1, len], scores [1, vocab])`; `None` skips the check for that row.
        vocab_size (`int`):
            Width of the constant scores: the target model's vocabulary size (its config's, like
            transformers, which can exceed the tokenizer's).

    Returns:
        `BannedFn`.
    """
    per_row = None if callable(processors) else list(processors)

    def banned(row: int, prefix_ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        # per_row is None exactly when `processors` is one callable shared by every row.
        processor = cast(Processor, processors) if per_row is None else per_row[row]
        mask = torch.zeros(candidate_ids.shape[0], dtype=torch.bool)  # [c]
        if processor is None:
            return mask
        constant_scores = torch.ones((1, vocab_size), dtype=torch.float32, device=prefix_ids.device)  # [1, vocab]
        sequence = prefix_ids[None, :]  # [1, cur_len + i]
        for i, token in enumerate(candidate_ids.tolist()):
            score = processor(sequence, constant_scores)[0, token]
            if score == -float("inf") or score == torch.finfo(score.dtype).min:
                mask[i] = True
                break
            sequence = torch.cat((prefix_ids, candidate_ids[: i + 1]))[None, :]
        return mask

    return banned


def _per_row(value: PerRow | None, rows: int, name: str) -> list[int | None]:
    if value is None or isinstance(value, int):
        return [value] * rows
    values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    if len(values) != rows:
        raise ValueError(f"`{name}` has {len(values)} entries for {rows} rows; pass one per row or a single int.")
    return [None if v is None else int(v) for v in values]


def _per_row_eos(
    eos_token_ids: int | Sequence[int] | Sequence[Sequence[int] | None] | torch.Tensor | None, rows: int
) -> list[list[int]]:
    if eos_token_ids is None:
        return [[] for _ in range(rows)]
    if isinstance(eos_token_ids, int):
        return [[eos_token_ids] for _ in range(rows)]
    if isinstance(eos_token_ids, torch.Tensor):
        return [eos_token_ids.view(-1).tolist() for _ in range(rows)]
    items = list(eos_token_ids)
    if any(item is None or isinstance(item, (list, tuple, torch.Tensor)) for item in items):
        # One entry per row.
        if len(items) != rows:
            raise ValueError(f"Per-row `eos_token_ids` has {len(items)} entries for {rows} rows.")
        out: list[list[int]] = []
        for item in items:
            if item is None:
                out.append([])
            elif isinstance(item, torch.Tensor):
                out.append(item.view(-1).tolist())
            else:
                out.append([int(v) for v in cast(Sequence[int], item)])
        return out
    # No entry is a list, tensor or None: `items` are the EOS ids shared by every row.
    return [[int(v) for v in cast(list[int], items)] for _ in range(rows)]


def _lookup_row(
    row: int,
    ids: torch.Tensor,
    num_output_tokens: int,
    max_ngram: int,
    max_length: int,
    eos: list[int],
    banned_fn: BannedFn | None,
) -> torch.Tensor:
    """Candidates for one row's valid tokens `ids` (`[cur_len]`); an empty tensor when none."""
    cur_len = ids.shape[0]
    empty = ids[:0]
    # transformers tests `max_length == cur_len + 1`; `<=` also covers rows already at their limit.
    if max_length <= cur_len + 1:
        return empty
    for ngram_size in range(min(max_ngram, cur_len - 1), 0, -1):
        windows = ids.unfold(0, ngram_size, 1)  # [cur_len - ngram_size + 1, ngram_size]
        matches = (windows == ids[-ngram_size:]).all(dim=1)  # [cur_len - ngram_size + 1]
        for start in matches.nonzero().view(-1).tolist():
            begin = start + ngram_size
            end = min(begin + num_output_tokens, cur_len, max_length)
            if begin >= end:
                continue
            chosen = ids[begin:end]
            if banned_fn is not None:
                banned = banned_fn(row, ids, chosen).to(torch.bool).cpu()  # [len(chosen)]
                first = banned.nonzero()
                if first.numel() > 0:
                    chosen = chosen[: int(first[0, 0])]
                if chosen.shape[0] == 0:
                    continue
            if eos:
                is_eos = torch.isin(chosen, torch.tensor(eos, dtype=chosen.dtype, device=chosen.device)).nonzero()
                if is_eos.numel() > 0:
                    # Otherwise the target could accept the EOS and the tokens after it in one round.
                    chosen = chosen[: int(is_eos[0, 0])]
            return chosen
    return empty


def prompt_lookup_candidates(
    input_ids: torch.Tensor,
    num_output_tokens: PerRow,
    *,
    max_length: PerRow,
    max_matching_ngram_size: PerRow | None = None,
    eos_token_ids: int | Sequence[int] | Sequence[Sequence[int] | None] | torch.Tensor | None = None,
    banned_fn: BannedFn | None = None,
    attention_mask: torch.Tensor | None = None,
    pad_id: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup candidates for every row, with transformers 5.23's matching rule (module doc).

    Args:
        input_ids (`torch.LongTensor` of shape `(rows, seq_len)`):
            Each row's prompt and generated tokens so far, possibly padded.
        num_output_tokens (`int` or one per row):
            Most tokens to propose (`prompt_lookup_num_tokens`); must be positive.
        max_length (`int` or one per row):
            The row's `max_length`, counted in the row's own valid tokens (subtract its padding when
            converting from a left-padded batch's `max_length`).
        max_matching_ngram_size (`int` or one per row, *optional*, defaults to 2):
            Longest n-gram to match (`max_matching_ngram_size`; unset or 0 means 2, as transformers'
            `... or 2`); must not be negative.
        eos_token_ids (`int`, a collection of ints, or one collection or `None` per row, *optional*):
            Proposals are cut before their first EOS token. A flat collection applies to every row.
        banned_fn (`BannedFn`, *optional*):
            `banned_fn(row, prefix_ids [cur_len], candidate_ids [c]) -> BoolTensor [c]`, True at
            candidates the row's processors ban (see `banned_fn_from_processors`). `None` skips the
            check (transformers 4.x behaviour, or a request without processors).
        attention_mask (`torch.LongTensor` of shape `(rows, seq_len)`, *optional*):
            1 for real tokens, 0 for padding (left, right or both); `None` means no padding.
        pad_id (`int`, *optional*, defaults to -1):
            Fills `candidates` after each row's proposal.

    Returns:
        `tuple(torch.Tensor, torch.Tensor)`: `candidates` of shape `(rows, k)` with
        `k = max(lengths)` (possibly 0) and `lengths` of shape `(rows,)`; a row with length 0 has no
        candidates and falls back to a plain decoding step.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"`input_ids` must have shape [rows, seq_len], got {tuple(input_ids.shape)}.")
    rows = input_ids.shape[0]
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"`attention_mask` must match `input_ids` {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}."
        )
    num_outputs = _per_row(num_output_tokens, rows, "num_output_tokens")
    ngram_sizes = [
        size or DEFAULT_MAX_MATCHING_NGRAM_SIZE
        for size in _per_row(max_matching_ngram_size, rows, "max_matching_ngram_size")
    ]
    max_lengths = _per_row(max_length, rows, "max_length")
    if any(length is None for length in max_lengths):
        raise ValueError("`max_length` is required for every row: pass the request's generation `max_length`.")
    eos = _per_row_eos(eos_token_ids, rows)
    for num, size in zip(num_outputs, ngram_sizes, strict=True):
        if num is None or num <= 0 or size <= 0:
            raise ValueError(
                f"Invalid max_matching_ngram_size ({size}) or num_output_tokens ({num}): both must be "
                "positive, e.g. `prompt_lookup_num_tokens=10`, `max_matching_ngram_size=2`."
            )

    proposals = []
    for row in range(rows):
        ids = input_ids[row] if attention_mask is None else input_ids[row][attention_mask[row].bool()]
        proposals.append(
            _lookup_row(
                row,
                ids,
                cast(int, num_outputs[row]),  # None refused above
                ngram_sizes[row],
                cast(int, max_lengths[row]),  # None refused above
                eos[row],
                banned_fn,
            )
        )
    lengths = torch.tensor([p.shape[0] for p in proposals], dtype=torch.long, device=input_ids.device)  # [rows]
    k = int(lengths.max()) if rows else 0
    candidates = torch.full((rows, k), pad_id, dtype=input_ids.dtype, device=input_ids.device)  # [rows, k]
    for row, proposal in enumerate(proposals):
        candidates[row, : proposal.shape[0]] = proposal
    return candidates, lengths


class SuffixMatcher:
    """specwire's prompt-lookup rule for one row (module doc), with an index kept as the row grows.

    Args:
        tokens (`list[int]`): the row's tokens so far.
        min_match (`int`, defaults to 2): shortest suffix match that proposes anything.
        max_match (`int`, defaults to 8): longest suffix compared (longer matches rank equal).
    """

    def __init__(self, tokens: Sequence[int], min_match: int = 2, max_match: int = 8):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match} and {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # min_match-gram -> end positions, ascending
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the row."""
        n = self.min_match
        for token in tokens:
            self.tokens.append(int(token))
            if len(self.tokens) >= n:
                self._ends.setdefault(tuple(self.tokens[-n:]), []).append(len(self.tokens) - 1)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the best earlier match of the row's suffix."""
        ids, n = self.tokens, self.min_match
        last = len(ids) - 1
        if num_tokens <= 0 or len(ids) <= n:
            return []
        best, best_length = -1, 0
        for end in self._ends.get(tuple(ids[-n:]), ()):
            if end >= last:  # the suffix itself: nothing follows it
                break
            length = n
            while length < self.max_match and end - length >= 0 and ids[end - length] == ids[last - length]:
                length += 1
            if length > best_length:
                best, best_length = end, length
                if length == self.max_match:
                    break
        if best < 0:
            return []
        return ids[best + 1 : best + 1 + num_tokens]
