"""SynthID text watermarking (Dathathri et al., Nature 634, 2024), bit-identical to transformers 5.23.

Each candidate continuation `v` of a row gets `depth = len(keys)` pseudo-random bits ("g-values"): the
row's last `ngram_len - 1` context tokens and `v` are hashed (a 64-bit linear congruential hash,
wrapping like int64 tensors do), the hash is mixed with each key, and the result indexes a fixed
table of coin flips drawn from `sampling_table_seed`. Tournament sampling then tilts the distribution
towards tokens whose g-values are 1, one depth at a time.

The processor keeps per-row state, as transformers' does: the context starts as `ngram_len - 1` zeros
(not the prompt) and each call after the first shifts in the row's last token; a context seen before
(within `context_history_size` calls) leaves the scores unchanged. So one processor serves exactly one
generation, called once per generated token on all its rows (finished rows included). The coin-flip
table is drawn on the processor's device: a table drawn on CUDA differs from one drawn on the CPU, so
detection must run on the device type that generated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SynthIDTextWatermarkLogitsProcessor"]

_MULTIPLIER = 6364136223846793005  # newlib/musl LCG parameters, as transformers uses them
_INCREMENT = 1


def accumulate_hash(current: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Fold the last dimension of `data` into `current` (`[...]` against `[..., n]`), int64 wrap-around.

    The elementwise twin of transformers' `accumulate_hash` under `vmap`: the same adds and multiplies in
    the same order, so the same int64 results.
    """
    for i in range(data.shape[-1]):
        current = torch.add(current, data[..., i])
        current = torch.mul(current, _MULTIPLIER)
        current = torch.add(current, _INCREMENT)
    return current


class SynthIDTextWatermarkLogitsProcessor:
    r"""Tilts each row's distribution towards tokens whose keyed n-gram hash draws g-values of 1.

    Args:
        ngram_len (`int`):
            Tokens per hashed n-gram (the context is the last `ngram_len - 1`).
        keys (`Sequence[int]`):
            One watermarking key per tournament layer (the depth).
        sampling_table_size (`int`, *optional*, defaults to 65536):
            Size of the coin-flip table hashes index (modulo).
        sampling_table_seed (`int`, *optional*, defaults to 0):
            Seed of the coin-flip table.
        context_history_size (`int`, *optional*, defaults to 1024):
            Contexts remembered per row; a repeated one is not watermarked.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`):
            Where the table and state live (the scores' device).
        skip_first_ngram_calls (`bool`, *optional*, defaults to `False`):
            Leave the first `ngram_len - 1` calls unwatermarked.
        debug_mode (`bool`, *optional*, defaults to `False`):
            Replace the scores by ones before watermarking (transformers' test mode).
    """

    def __init__(
        self,
        ngram_len: int,
        keys: Sequence[int],
        sampling_table_size: int = 2**16,
        sampling_table_seed: int = 0,
        context_history_size: int = 1024,
        device: str | torch.device = "cpu",
        skip_first_ngram_calls: bool = False,
        debug_mode: bool = False,
    ):
        if isinstance(ngram_len, bool) or not isinstance(ngram_len, int) or ngram_len < 1:
            raise ValueError(f"`ngram_len` has to be a positive integer (e.g. 5), but is {ngram_len!r}.")
        if not keys or any(isinstance(k, bool) or not isinstance(k, int) for k in keys):
            raise ValueError(f"`keys` has to be a non-empty list of integers, but is {keys!r}.")
        self.ngram_len = ngram_len
        self.device = torch.device(device)
        self.keys = torch.tensor(list(keys), device=self.device)  # [depth]
        generator = torch.Generator(device=self.device).manual_seed(sampling_table_seed)
        self.sampling_table = torch.randint(  # [table]
            low=0, high=2, size=(sampling_table_size,), generator=generator, device=self.device
        )
        self.context_history_size = context_history_size
        self.skip_first_ngram_calls = skip_first_ngram_calls
        self.debug_mode = debug_mode
        self.context: torch.Tensor | None = None  # [rows, ngram_len - 1]
        self.context_history: torch.Tensor | None = None  # [rows, context_history_size]
        self.num_calls = 0

    def _with_keys(self, hashes: torch.Tensor) -> torch.Tensor:
        """`[...]` hashes -> `[..., depth]`: each hash folded with each key."""
        return accumulate_hash(hashes[..., None], self.keys[:, None])

    def sample_g_values(self, ngram_keys: torch.Tensor) -> torch.Tensor:
        """The table's coin flips at `ngram_keys % table_size` (same shape as `ngram_keys`)."""
        return self.sampling_table[ngram_keys % self.sampling_table.shape[0]]

    @staticmethod
    def update_scores(scores: torch.Tensor, g_values: torch.Tensor) -> torch.Tensor:
        """Tournament sampling: `[rows, vocab]` scores and `[rows, vocab, depth]` g-values -> log-probs."""
        probs = torch.softmax(scores, dim=1)
        for i in range(g_values.shape[2]):
            g_at_depth = g_values[:, :, i]
            g_mass = (g_at_depth * probs).sum(dim=1, keepdim=True)
            probs = probs * (1 + g_at_depth - g_mass)
        log_probs = torch.log(probs)
        return torch.where(torch.isfinite(log_probs), log_probs, torch.finfo(log_probs.dtype).min)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows, vocab_size = scores.shape
        if self.debug_mode:
            scores = torch.ones_like(scores)
        if self.context is None or self.context_history is None:
            self.context = torch.zeros((rows, self.ngram_len - 1), dtype=torch.int64, device=self.device)
            self.context_history = torch.zeros((rows, self.context_history_size), dtype=torch.int64, device=self.device)
        else:
            self.context = torch.concat((self.context, input_ids[:, -1:]), dim=1)[:, 1:]
        self.num_calls += 1
        if self.skip_first_ngram_calls and self.num_calls < self.ngram_len:
            return scores
        ones = torch.ones(rows, device=self.device, dtype=torch.long)
        context_hash = accumulate_hash(ones, self.context)  # [rows]
        indices = torch.arange(vocab_size, device=self.device)
        continuation_hash = accumulate_hash(context_hash[:, None], indices[None, :, None])  # [rows, vocab]
        g_values = self.sample_g_values(self._with_keys(continuation_hash))  # [rows, vocab, depth]
        updated = self.update_scores(scores, g_values)
        is_repeated = (self.context_history == context_hash[:, None]).any(dim=1, keepdim=True)  # [rows, 1]
        self.context_history = torch.concat((context_hash[:, None], self.context_history), dim=1)[:, :-1]
        return torch.where(is_repeated, scores, updated)

    def compute_g_values(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[rows, length]` ids -> `[rows, length - ngram_len + 1, depth]` g-values of each n-gram."""
        ngrams = input_ids.unfold(dimension=1, size=self.ngram_len, step=1)  # [rows, ngrams, ngram_len]
        ones = torch.ones(ngrams.shape[:2], device=self.device, dtype=torch.long)
        return self.sample_g_values(self._with_keys(accumulate_hash(ones, ngrams)))

    def compute_context_repetition_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[rows, length - ngram_len + 1]`: True where the n-gram's context was not seen before in the row
        (within `context_history_size` contexts, zeros counting as seen, as the generation state does)."""
        rows = input_ids.shape[0]
        history = torch.zeros((rows, self.context_history_size), dtype=torch.int64, device=self.device)
        contexts = input_ids[:, :-1].unfold(dimension=1, size=self.ngram_len - 1, step=1)
        repeated = []
        for i in range(contexts.shape[1]):
            ones = torch.ones(rows, device=self.device, dtype=torch.long)
            context_hash = accumulate_hash(ones, contexts[:, i, :])[:, None]
            repeated.append((history == context_hash).any(dim=1, keepdim=True))
            history = torch.concat((context_hash, history), dim=1)[:, :-1]
        if not repeated:
            return torch.zeros((rows, 0), dtype=torch.bool, device=self.device)
        return torch.logical_not(torch.concat(repeated, dim=1))

    @staticmethod
    def compute_eos_token_mask(input_ids: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
        """`[rows, length]`: True before each row's first `eos_token_id` (everything when `None`)."""
        if eos_token_id is None:
            return torch.ones_like(input_ids, dtype=torch.bool)
        seen = torch.cumsum((input_ids == eos_token_id).long(), dim=1)
        return seen == 0
