"""`LeanDecoder` for a draft model's own caches: one sequence through a transformers `DynamicCache`.

Why. A draft model drafts one token per forward, so the module machinery `LeanDecoder` removes weighs most
there: SmolLM2's int8 draft (`default-int8`) takes ~11.4 ms a token through `model(...)` on 2 CPU cores and
~8.5 ms through `LeanDecoder` on the same weights and cache (its int8 projections are called as their
kernel, `lean_decoder._projection`). Drafts are only proposals (the target verifies them), but their
probabilities enter speculative sampling's acceptance and seeded sampling draws from them: so the lean
forward is used only where it gives the model's logits bitwise, which `draft_decoder` checks once per model
with a prompt, a decode step and a block (`LeanDecoder`'s exactness argument, over this cache).

`lean_draft_forward` is the `drafters.DraftForward` the draft service and the target's co-located draft give
their `ModelDrafter`s (the pure core does not import the runtime).

`CacheStep` appends each layer's keys and values to the cache as the model's attention does
(`DynamicCache.update`) and attends with transformers' sdpa function and the mask transformers gives it: none
for one token or a prompt from position 0 (sdpa's own causal handling), else the causal block over the cache.
Not for sliding-window attention (another cache layer and mask): `draft_decoder` declines such models.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, cast

import torch

from specwire.runtime.lean_decoder import LeanDecoder

__all__ = ["CacheStep", "draft_decoder", "lean_draft_forward", "lean_logits"]

log = logging.getLogger(__name__)

_decoders: weakref.WeakKeyDictionary[Any, LeanDecoder | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_PROBE = ([3, 5, 7, 11, 13, 17], [19], [23, 29, 31])  # a prompt, a decode step, a block


class CacheStep:
    """`LeanDecoder`'s `step` for `length` new tokens after `past` cached ones of one sequence (module docstring)."""

    def __init__(self, cache: Any, past: int, length: int, device: torch.device):
        self.cache = cache
        self.mask = None
        if length > 1 and past > 0:
            rows = torch.arange(length, device=device)[:, None] + past
            self.mask = (rows >= torch.arange(past + length, device=device)[None])[None, None]

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        key, value = self.cache.update(key, value, module.layer_idx)
        out, _ = sdpa_attention_forward(module, query, key, value, self.mask, dropout=0.0, scaling=scaling)
        return cast(torch.Tensor, out)


def lean_logits(decoder: LeanDecoder, ids: list[int], cache: Any, past: int, keep: int, device: Any) -> torch.Tensor:
    """The logits of the last `keep` of `ids` run after `past` cached tokens, `[1, keep, vocab]`; `cache` grows."""
    length = len(ids)
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    positions = torch.arange(past, past + length, device=device)[None]
    kept = torch.arange(length - keep, length, device=device)
    return decoder(tokens, positions, CacheStep(cache, past, length, device), kept)


def lean_draft_forward(
    model: Any, cache: Any, new_tokens: list[int], past: int, keep: int, device: Any
) -> torch.Tensor | None:
    """`drafters.DraftForward` through `draft_decoder(model)`: None where it declines (the model's own forward)."""
    decoder = draft_decoder(model)
    if decoder is None:
        return None
    return lean_logits(decoder, new_tokens, cache, past, min(keep, len(new_tokens)), device)


def draft_decoder(model: Any) -> LeanDecoder | None:
    """A `LeanDecoder` for `model` when it runs the model's forward bitwise over a `DynamicCache`, else None (and
    a log line saying why). Checked once per model; call it where the model's forwards run (its thread), before
    each forward: a model whose forward is wrapped on the instance or hooked (instrumentation, fault injection)
    runs its own forward, which the lean one would skip."""
    if "forward" in vars(model) or model._forward_hooks or model._forward_pre_hooks:
        return None
    with _lock:
        if model in _decoders:
            return _decoders[model]
    decoder, problem = None, LeanDecoder.unsupported(model)
    config = model.config.get_text_config(decoder=True)
    if not problem and getattr(config, "sliding_window", None) is not None:
        problem = "sliding-window attention"
    if not problem:
        decoder = LeanDecoder(model, small_blocks=False)  # bitwise the model's products (module docstring)
        try:
            problem = "" if _same_logits(model, decoder, config) else "its logits differ from the model's forward"
        except Exception as exc:  # noqa: BLE001 - any failure means: use the model's forward
            problem = f"it failed: {type(exc).__name__}: {exc}"
    if problem:
        log.info("draft model %s: lean forward not used: %s", type(model).__name__, problem)
        decoder = None
    with _lock:
        _decoders[model] = decoder
    return decoder


@torch.inference_mode()
def _same_logits(model: Any, decoder: LeanDecoder, config: Any) -> bool:
    from transformers import DynamicCache

    device = next(model.parameters()).device
    want_cache, got_cache = DynamicCache(config=config), DynamicCache(config=config)
    past = 0
    for ids in _PROBE:
        ids = [i % config.vocab_size for i in ids]
        tokens = torch.tensor([ids], dtype=torch.long, device=device)
        want = model(input_ids=tokens, past_key_values=want_cache, use_cache=True).logits
        got = lean_logits(decoder, ids, got_cache, past, len(ids), device)
        if want.shape != got.shape or not torch.equal(want, got):
            return False
        past += len(ids)
    return True
