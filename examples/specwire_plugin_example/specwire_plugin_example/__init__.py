"""An example specwire server plugin package (see the README's "Server plugins").

Each factory takes the request's JSON arguments and a `PluginContext` (tokenizer, vocab size,
device, the effective config) and returns a transformers-style callable. Bad arguments raise
`ValueError`: the caller gets INVALID_ARGUMENT with the message.
"""

from __future__ import annotations

from typing import Any

import torch


class BanTokens:
    """Sets the scores of the given token ids to -inf (transformers' `SuppressTokensLogitsProcessor`)."""

    def __init__(self, token_ids: list[int], vocab_size: int, device: Any):
        self.mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.mask[token_ids] = True

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(self.mask[: scores.shape[-1]].to(scores.device), -float("inf"))


def make_ban_tokens(args: dict, context: Any) -> BanTokens:
    """Bans token ids: {"token_ids": [int, ...]}."""
    ids = args.get("token_ids")
    if set(args) != {"token_ids"} or not isinstance(ids, list) or not ids:
        raise ValueError(f'give {{"token_ids": [int, ...]}} (a non-empty list), got {args!r}')
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < context.vocab_size]
    if bad:
        raise ValueError(f"token_ids must be ints in [0, {context.vocab_size}), got {bad}")
    return BanTokens(ids, context.vocab_size, context.device)


class MaxSentences:
    """Stops a row once its generated text holds `n` sentence ends ('.', '!' or '?')."""

    def __init__(self, n: int, tokenizer: Any, input_len: int):
        self.n, self.tokenizer, self.input_len = n, tokenizer, input_len

    def __call__(self, input_ids: torch.Tensor, scores: Any = None) -> torch.Tensor:
        # A pure function of `input_ids` (no state between calls): under speculation the server asks
        # about every position of an accepted block, not once per step.
        done = []
        for row in input_ids[:, self.input_len :].tolist():
            text = self.tokenizer.decode(row, skip_special_tokens=True)
            done.append(sum(text.count(c) for c in ".!?") >= self.n)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def make_max_sentences(args: dict, context: Any) -> MaxSentences:
    """Stops after N sentences: {"n": int >= 1}."""
    n = args.get("n")
    if set(args) != {"n"} or not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f'give {{"n": int >= 1}}, got {args!r}')
    if context.tokenizer is None:
        raise ValueError("max_sentences needs the model's tokenizer, and this server has none")
    return MaxSentences(n, context.tokenizer, context.input_len)


class StopOnTokens:
    """Stops a row when its last generated token is one of `token_ids`."""

    def __init__(self, token_ids: list[int], input_len: int):
        self.ids, self.input_len = torch.tensor(token_ids, dtype=torch.long), input_len

    def __call__(self, input_ids: torch.Tensor, scores: Any = None) -> torch.Tensor:
        if input_ids.shape[1] <= self.input_len:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return torch.isin(input_ids[:, -1], self.ids.to(input_ids.device))


def make_stop_on_tokens(args: dict, context: Any) -> StopOnTokens:
    """Stops on any of these token ids: {"token_ids": [int, ...]} (like eos_token_id, kept in the output)."""
    ids = args.get("token_ids")
    if set(args) != {"token_ids"} or not isinstance(ids, list) or not ids:
        raise ValueError(f'give {{"token_ids": [int, ...]}} (a non-empty list), got {args!r}')
    return StopOnTokens(ids, context.input_len)
