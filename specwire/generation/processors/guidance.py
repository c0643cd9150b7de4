"""Unbatched classifier-free guidance (arXiv 2306.17806): the model is re-run on a negative prompt.

This is the one processor with per-step state, exactly as in transformers: it owns a second KV
cache for the unconditional (negative-prompt) branch and feeds it one token per call. It must
therefore be called once per decoding step, at consecutive row lengths (`L`, `L + 1`, ...); a call at
any other length raises instead of silently computing guidance against the wrong context. In
particular, speculative verification can't call it on several candidate prefixes of one step.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from specwire.generation.argument_errors import InvalidGenerationArgument


def broadcast_rows(tensor: torch.Tensor, rows: int, field: str) -> torch.Tensor:
    """`tensor [n, len]` with one row per generated row: as is (`n == rows`), one row repeated for every
    row (`n == 1`), or one row per prompt repeated for that prompt's `rows // n` rows (`[p0, p0, p1, p1]`,
    the order of transformers' row expansion).

    Raises:
        `InvalidGenerationArgument`: when `n` is none of those.
    """
    n = tensor.shape[0]
    if n == rows:
        return tensor
    if n >= 1 and rows % n == 0:
        return tensor.repeat_interleave(rows // n, dim=0)
    raise InvalidGenerationArgument.for_field(
        field,
        tuple(tensor.shape),
        f"give one negative prompt for the whole batch, or one per prompt; got {n} rows for {rows} generated rows",
    )


class UnbatchedClassifierFreeGuidanceLogitsProcessor:
    r"""Mixes conditional and unconditional log-probabilities: `u + guidance_scale * (log_softmax(s) - u)`.

    `u` is the model's next-token log-softmax on the negative prompt followed by the tokens generated
    so far. The output is in log-probability space. On the first call the unconditional branch is
    primed with `unconditional_ids` (default: the last token of each row); every later call appends
    the row's newest token.

    Args:
        guidance_scale (`float`):
            Guidance strength; > 1 pushes away from the negative prompt, 1 only log-softmaxes.
        model (`torch.nn.Module`):
            The causal LM, called as `model(ids, attention_mask=..., use_cache=..., past_key_values=...)`
            and returning an object with `.logits` (and `past_key_values` when caching).
        unconditional_ids (`torch.LongTensor` of shape `(n, neg_len)`, *optional*):
            The negative prompt (moved to the rows' device at the first call): one row for every row
            (`n = 1`), one per prompt, or one per row (see `broadcast_rows`). Defaults to the last token
            of each row at the first call.
        unconditional_attention_mask (`torch.LongTensor` of shape `(n, neg_len)`, *optional*):
            Its attention mask, broadcast like the ids; defaults to all ones.
        use_cache (`bool`, *optional*, defaults to `True`):
            Keep a KV cache for the unconditional branch (otherwise the whole branch is re-run every step).
    """

    def __init__(
        self,
        guidance_scale: float,
        model: Any,
        unconditional_ids: torch.Tensor | None = None,
        unconditional_attention_mask: torch.Tensor | None = None,
        use_cache: bool = True,
    ):
        if model is None:
            raise ValueError("`guidance_scale` != 1 needs the model to run the unconditional branch; pass `model=`.")
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)):
            raise ValueError(f"`guidance_scale` has to be a number (e.g. 1.5), but is {guidance_scale!r}.")
        if (
            unconditional_ids is not None
            and unconditional_attention_mask is not None
            and unconditional_attention_mask.shape != unconditional_ids.shape
        ):
            raise InvalidGenerationArgument.for_field(
                "negative_prompt_attention_mask",
                tuple(unconditional_attention_mask.shape),
                f"give one mask entry per negative prompt token: shape {tuple(unconditional_ids.shape)}",
            )
        self.guidance_scale = guidance_scale
        self.model = model
        self.use_cache = bool(use_cache)
        self._ids = unconditional_ids
        self._mask = unconditional_attention_mask
        self._past = None
        self._last_len: int | None = None  # row length at the previous call; None before the first

    def _unconditional_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        cur_len = input_ids.shape[-1]
        if self._last_len is None:
            rows = input_ids.shape[0]
            # A negative prompt from the wire is on the CPU; the model may be elsewhere. One negative
            # prompt serves every row: each row's unconditional branch is that prompt followed by the
            # row's own tokens (transformers fails at the second step when the row counts differ).
            if self._ids is None:
                self._ids = input_ids[:, -1:]
            else:
                self._ids = broadcast_rows(self._ids.to(input_ids.device), rows, "negative_prompt_ids")
            if self._mask is None:
                self._mask = torch.ones_like(self._ids, dtype=torch.long)
            else:
                self._mask = broadcast_rows(self._mask.to(input_ids.device), rows, "negative_prompt_attention_mask")
            feed = self._ids
        else:
            if cur_len != self._last_len + 1:
                raise RuntimeError(
                    f"UnbatchedClassifierFreeGuidanceLogitsProcessor was called at row length {cur_len} "
                    f"after {self._last_len}; its unconditional KV cache only supports one call per step "
                    "at consecutive lengths. Build a new processor list per request and don't use it "
                    "for speculative verification."
                )
            # The first call (`_last_len is None`) set both.
            assert self._mask is not None and self._ids is not None
            self._mask = torch.cat([self._mask, torch.ones_like(input_ids[:, -1:], dtype=torch.long)], dim=1)
            if self.use_cache:
                feed = input_ids[:, -1:]  # the cache holds everything before it
            else:
                feed = torch.cat([self._ids, input_ids[:, -1:]], dim=1)
            self._ids = feed
        self._last_len = cur_len
        with torch.no_grad():
            out = self.model(feed, attention_mask=self._mask, use_cache=self.use_cache, past_key_values=self._past)
        self._past = getattr(out, "past_key_values", None)
        return cast(torch.Tensor, out.logits)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = torch.nn.functional.log_softmax(scores, dim=-1)  # [rows, vocab]
        if self.guidance_scale == 1:
            return scores
        logits = self._unconditional_logits(input_ids)  # [rows, fed_len, vocab]
        unconditional = torch.nn.functional.log_softmax(logits[:, -1], dim=-1)  # [rows, vocab]
        return self.guidance_scale * (scores - unconditional) + unconditional
