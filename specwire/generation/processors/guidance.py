"""Unbatched classifier-free guidance (arXiv 2306.17806): the model is re-run on a negative prompt.

This is the one processor with per-step state, exactly as in transformers: it owns a second KV
cache for the unconditional (negative-prompt) branch and feeds it one token per call. It must
therefore be called once per decoding step, at consecutive row lengths (`L`, `L + 1`, ...); a call at
any other length raises instead of silently computing guidance against the wrong context. In
particular, speculative verification can't call it on several candidate prefixes of one step.
"""

from __future__ import annotations

from typing import Any

import torch


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
        unconditional_ids (`torch.LongTensor` of shape `(rows, neg_len)`, *optional*):
            The negative prompt (moved to the rows' device at the first call). Defaults to the last token
            of each row at the first call.
        unconditional_attention_mask (`torch.LongTensor` of shape `(rows, neg_len)`, *optional*):
            Its attention mask; defaults to all ones.
        use_cache (`bool`, *optional*, defaults to `True`):
            Keep a KV cache for the unconditional branch (otherwise the whole branch is re-run every step).
    """

    def __init__(
        self,
        guidance_scale: float,
        model: Any,
        unconditional_ids: torch.LongTensor | None = None,
        unconditional_attention_mask: torch.LongTensor | None = None,
        use_cache: bool = True,
    ):
        if model is None:
            raise ValueError(
                "`guidance_scale` != 1 needs the model to run the unconditional branch; pass `model=`."
            )
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)):
            raise ValueError(f"`guidance_scale` has to be a number (e.g. 1.5), but is {guidance_scale!r}.")
        self.guidance_scale = guidance_scale
        self.model = model
        self.use_cache = bool(use_cache)
        self._ids = unconditional_ids
        self._mask = unconditional_attention_mask
        self._past = None
        self._last_len: int | None = None  # row length at the previous call; None before the first

    def _unconditional_logits(self, input_ids: torch.LongTensor) -> torch.Tensor:
        cur_len = input_ids.shape[-1]
        if self._last_len is None:
            # A negative prompt from the wire is on the CPU; the model may be elsewhere.
            self._ids = input_ids[:, -1:] if self._ids is None else self._ids.to(input_ids.device)
            if self._mask is None:
                self._mask = torch.ones_like(self._ids, dtype=torch.long)
            else:
                self._mask = self._mask.to(input_ids.device)
            feed = self._ids
        else:
            if cur_len != self._last_len + 1:
                raise RuntimeError(
                    f"UnbatchedClassifierFreeGuidanceLogitsProcessor was called at row length {cur_len} "
                    f"after {self._last_len}; its unconditional KV cache only supports one call per step "
                    "at consecutive lengths. Build a new processor list per request and don't use it "
                    "for speculative verification."
                )
            self._mask = torch.cat([self._mask, torch.ones_like(input_ids[:, -1:], dtype=torch.long)], dim=1)
            if self.use_cache:
                feed = input_ids[:, -1:]  # the cache holds everything before it
            else:
                feed = torch.cat([self._ids, input_ids[:, -1:]], dim=1)
            self._ids = feed
        self._last_len = cur_len
        with torch.no_grad():
            out = self.model(
                feed, attention_mask=self._mask, use_cache=self.use_cache, past_key_values=self._past
            )
        self._past = getattr(out, "past_key_values", None)
        return out.logits

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = torch.nn.functional.log_softmax(scores, dim=-1)  # [rows, vocab]
        if self.guidance_scale == 1:
            return scores
        logits = self._unconditional_logits(input_ids)  # [rows, fed_len, vocab]
        unconditional = torch.nn.functional.log_softmax(logits[:, -1], dim=-1)  # [rows, vocab]
        return self.guidance_scale * (scores - unconditional) + unconditional
