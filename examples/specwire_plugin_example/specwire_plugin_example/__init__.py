"""An example specwire server plugin package (see the README's "Server plugins"): processors, stopping
criteria and a generate method (`best_of_n`).

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


class BestOfN:
    """Best-of-n sampling: draws `n` samples per row with the request's processors, stopping criteria and
    seeded generator, and returns for each row the sample the model finds most likely (the highest mean
    log-probability of its tokens under the processed scores, the `compute_transition_scores(...,
    normalize_logits=True)` of transformers), a cheap self-consistency re-ranking.

    Pass `k` is what transformers' `generate(do_sample=True)` gives as the `k`-th call after
    `torch.manual_seed(seed)`: one `torch.multinomial` draw per step over the rows, finished rows fed
    the pad token, as its sampling loop does.
    """

    def __init__(self, n: int):
        self.n = n

    def __call__(self, inputs: Any) -> Any:
        from specwire.generation.generate_methods import GenerateMethodOutput

        passes = [self._sample(inputs) for _ in range(self.n)]  # (sequences, per-step scores, mean log-prob)
        width = max(seq.shape[1] for seq, _, _ in passes)
        pad = inputs.config.pad_token_id if inputs.config.pad_token_id is not None else 0
        sequences = torch.stack([_pad_columns(seq, width, pad) for seq, _, _ in passes])  # [n, rows, width]
        best = torch.stack([mean for _, _, mean in passes]).argmax(dim=0)  # [rows]
        rows = torch.arange(best.shape[0], device=best.device)
        steps = []
        for t in range(width - inputs.input_len):
            filler = torch.full_like(passes[0][1][0], -float("inf"))
            filler[:, pad] = 0.0  # a finished pass's later steps: the pad token, certain
            steps.append(torch.stack([s[t] if t < len(s) else filler for _, s, _ in passes])[best, rows])
        return GenerateMethodOutput(sequences=sequences[best, rows], scores=tuple(steps))

    @staticmethod
    def _sample(inputs: Any) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """One pass of transformers' sampling loop; its sequences, processed scores and mean log-probs."""
        processors, criteria = inputs.new_logits_processor(), inputs.stopping_criteria
        ids, mask = inputs.input_ids, inputs.attention_mask
        pad = inputs.config.pad_token_id if inputs.config.pad_token_id is not None else 0
        unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
        total = torch.zeros(ids.shape[0], device=ids.device)
        count = torch.zeros(ids.shape[0], device=ids.device)
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        step_ids, cache, steps = ids, None, []
        while True:
            inputs.check()  # the contract: once per step (cancellation and the deadline)
            out = inputs.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=position_ids[:, -step_ids.shape[1] :],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            scores = processors(ids, out.logits[:, -1, :].float())  # [rows, vocab]
            token = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=inputs.generator).squeeze(1)
            logprob = torch.log_softmax(scores, dim=-1).gather(1, token[:, None]).squeeze(1)
            total += torch.where(unfinished, logprob, torch.zeros_like(logprob))
            count += unfinished.float()
            token = torch.where(unfinished, token, torch.full_like(token, pad))
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1], dim=1)
            steps.append(scores)
            unfinished &= ~criteria(ids, scores)
            if not bool(unfinished.any()):
                return ids, steps, total / count.clamp(min=1)
            step_ids = token[:, None]


def _pad_columns(sequences: torch.Tensor, width: int, pad: int) -> torch.Tensor:
    extra = width - sequences.shape[1]
    return torch.nn.functional.pad(sequences, (0, extra), value=pad) if extra else sequences


def make_best_of_n(args: dict, context: Any) -> BestOfN:
    """Best-of-n sampling: {"n": int in 1..16}; the request sets do_sample=True (and a seed to repeat it)."""
    n = args.get("n")
    if set(args) != {"n"} or not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
        raise ValueError(f'give {{"n": int in 1..16}}, got {args!r}')
    if not getattr(context.config, "do_sample", False):
        raise ValueError("best_of_n draws samples: set do_sample=True (greedy decoding gives n equal answers)")
    return BestOfN(n)
