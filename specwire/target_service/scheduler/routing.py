"""Routing: which requests the slot cache serves, and which run in the sequential lane.

The lane runs `Engine`'s per-request path (one request per forward, with a `DynamicCache`), its model
calls posted to the scheduler thread (`BatchScheduler.forward`). It takes what the slot cache cannot
serve: `use_cache=False`, classifier-free guidance (its processor runs its own forward), attention
weights or hidden states in the output (the model's own forward returns them), group beam search (its
groups pick one after the other within a step), contrastive search and DoLa (hidden states), a static
cache, more rows than slots, longer than a slot, padding that is not left padding, and prompt rows with
no unmasked token. A model `slot_support` refuses, or one the start-up probe refused, sends every
request there. So do `use_mtp` and `speculation_type`: their drafts read the target's hidden states.
"""

from __future__ import annotations

from typing import Any

from specwire.generation.config import GenerationMode, uses_static_cache
from specwire.runtime.slot_cache import SlotKVCache


def lane_reason(plan: Any, cache: SlotKVCache) -> str:
    """Why the request `plan` (a `GenerationPlan`) runs in the sequential lane, "" when `cache` serves it.

    Args:
        plan (`GenerationPlan`): the request's resolved plan (`prepare_generation`).
        cache (`SlotKVCache`): the scheduler's slots.
    """
    config = plan.config
    rows = plan.rows
    if not config.use_cache:
        return "use_cache=False"
    if config.guidance_scale is not None and config.guidance_scale != 1:
        return "classifier-free guidance"
    if config.use_mtp:
        return "use_mtp (the MTP draft reads the target's last hidden states; the packed forward returns none)"
    if config.speculation_type is not None:
        return "speculation_type (the DFlash draft reads the target's hidden states; the packed forward returns none)"
    if config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states):
        return "output_attentions / output_hidden_states (the packed forward returns neither)"
    if config.num_beam_groups is not None and config.num_beam_groups > 1:
        return "group beam search (its groups pick one after the other within a step)"
    mode = config.get_generation_mode()
    if mode is GenerationMode.CONSTRAINED_BEAM_SEARCH:
        return "constrained beam search (its candidates depend on each hypothesis' constraint progress)"
    if mode is GenerationMode.CONTRASTIVE_SEARCH:
        return "contrastive search (it ranks its candidates by hidden states and selects cache rows)"
    if mode is GenerationMode.DOLA_GENERATION:
        return "DoLa decoding (it reads earlier layers' hidden states every step)"
    if uses_static_cache(config):
        return f"cache_implementation={config.cache_implementation!r} (a StaticCache of its own)"
    if rows > cache.num_slots:
        return f"{rows} rows > {cache.num_slots} slots"
    if plan.max_length > cache.slot_tokens:
        return f"max_length {plan.max_length} > {cache.slot_tokens} slot tokens"
    mask = plan.attention_mask
    # Only left padding can be skipped: a 0 after a 1 changes what the reference computes.
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        return "padding that is not left padding"
    # A row that is all padding (pad ids with no mask sent) has no token for a slot to start from;
    # transformers still generates from it, and so does the lane.
    if not bool(mask.any(dim=1).all()):
        return "a prompt row with no unmasked token"
    return ""
