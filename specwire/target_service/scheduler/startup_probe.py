"""The batched scheduler's start-up: size the slot cache, and check that packed forwards serve this model.

Runs once, on the scheduler thread (the probe runs forwards, and every forward of a service runs on
that thread: `specwire.model_thread`). Two checks decide how requests are served:

- Packed forwards must give what `RowBatch` (the per-request path) gives on this model, up to the
  rounding of its dtype (`close_logits`); else every request is served sequentially.
- `LeanDecoder` (`specwire.runtime.lean_decoder`: the model's own ops without transformers' module
  machinery, ~13% less time per SmolLM2 decode step on 2 CPU cores) runs the packed forwards only when
  the model has the Llama layout and its logits are bitwise those of `model(...)` (compared with its
  small blocks off: they round 2 to 4 rows as one-row forwards do; see that module).

A lean decoder then runs one packed forward of each small-block row count (`_warm_small_blocks`), so that its
small blocks are checked here, not on the first verify of a request, and times one-token forwards with one-row
products padded to a small block and without (`_choose_single_rows`), keeping the faster: the same logits either
way, and on 2 CPU cores a SmolLM2 decode step ~17% faster padded.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

import torch

from specwire.generation.rows import RowBatch
from specwire.runtime.lean_decoder import SMALL_BLOCK_ROWS, LeanDecoder
from specwire.runtime.slot_cache import SlotKVCache, SlotRows, execute, install_slot_attention
from specwire.target_service.scheduler.options import SchedulerOptions

log = logging.getLogger("specwire.target_service.scheduler")

# `_choose_single_rows`: timed one-token forwards each way, and how much faster padding must be to be kept.
SINGLE_ROW_ROUNDS = 10
SINGLE_ROW_MARGIN = 0.05


@dataclasses.dataclass
class SlotSetup:
    """What the start-up found: the slot cache and the lean forward, or why there is no slot cache.

    Args:
        cache (`SlotKVCache`, *optional*): the slots, None when the batched path cannot serve this model.
        decoder (`LeanDecoder`, *optional*): the packed forwards' decoder, None for `model(...)`.
        unsupported (`str`, defaults to `""`): why `cache` is None.
    """

    cache: SlotKVCache | None = None
    decoder: LeanDecoder | None = None
    unsupported: str = ""


def close_logits(want: torch.Tensor, have: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether two forwards' logits agree up to the rounding of the model's dtype.

    The packed and the `RowBatch` forward multiply in different shapes, so the sums are rounded in a
    different order: a float32 (or float64) model agrees to 1e-3, a bfloat16 or float16 one to a
    couple of units in the last place of its largest logit (SmolLM2 in bfloat16: 0.125 on logits up
    to 28, one ulp).
    """
    if torch.finfo(dtype).bits >= 32:
        return torch.allclose(want, have, rtol=1e-3, atol=1e-3)
    ulps = 2 * torch.finfo(dtype).eps
    return torch.allclose(want, have, rtol=ulps, atol=ulps * float(want.abs().max()))


def build_slot_cache(model: Any, options: SchedulerOptions, max_position_embeddings: int | None) -> SlotSetup:
    """The slot cache `options` ask for, after the probes (see the module docstring).

    Args:
        model (`PreTrainedModel`): the served model (its attention gets the slot attention installed).
        options (`SchedulerOptions`): slot count, slot length, memory budget, lean forward.
        max_position_embeddings (`int`, *optional*): the model's context length (2048 when unknown).
    """
    context = max_position_embeddings or 2048
    slot_tokens = options.slot_tokens or min(context, 2048)
    per_slot = SlotKVCache.bytes_per_slot(model, slot_tokens)
    slots = min(options.max_batch_rows, int(options.kv_cache_mb * 2**20 // per_slot))
    if slots < 1:
        return SlotSetup(unsupported=f"kv_cache_mb={options.kv_cache_mb} holds no slot of {slot_tokens} tokens")
    with torch.inference_mode():
        install_slot_attention(model)
        problem = _probe(model)
        if problem:
            return SlotSetup(unsupported=problem)
        decoder = _lean_decoder(model) if options.lean_forward else None
        if decoder is not None:
            _warm_small_blocks(model, decoder)
            _choose_single_rows(model, decoder)
        cache = SlotKVCache(model, slots, slot_tokens)
        adopt = getattr(model, "adopt_cache", None)  # a tensor-parallel model: its other ranks allocate theirs
        if adopt is not None:
            adopt(cache)
    forward = "transformers"
    if decoder is not None:
        forward = "lean, one-row products padded" if decoder.small_blocks.single_rows else "lean"
    log.info(
        "batched scheduler: %d slots x %d tokens (%.0f MiB), %s forward",
        slots,
        slot_tokens,
        slots * per_slot / 2**20,
        forward,
    )
    return SlotSetup(cache=cache, decoder=decoder)


def _lean_decoder(model: Any) -> LeanDecoder | None:
    """A `LeanDecoder` when this model supports one and it reproduces the model's logits bitwise."""
    problem = LeanDecoder.unsupported(model)
    if not problem:
        decoder = LeanDecoder(model)
        try:
            with decoder.model_products():
                same = all(
                    torch.equal(want, got)
                    for want, got in zip(_packed_outputs(model, None), _packed_outputs(model, decoder), strict=True)
                )
            problem = "" if same else "its logits differ from the model's own forward"
        except Exception as exc:  # noqa: BLE001 - any failure means: use the model's forward
            problem = f"it failed: {type(exc).__name__}: {exc}"
    if problem:
        log.info("lean forward not used: %s", problem)
        return None
    return decoder


def _warm_small_blocks(model: Any, decoder: LeanDecoder) -> None:
    """One packed forward of each row count small blocks compute (`SMALL_BLOCK_ROWS`), through `decoder`: each
    weight shape and row count is checked on its first use (`SmallBlocks`), and MKL is slow on a shape's first
    product, so a request's first verify of 2 to 4 tokens cost up to twice a warm one (SmolLM2 on one core: 123
    against 72 ms for 3 tokens, 106 against 60 for 4). The speculation controller priced a fresh target's verifies
    by that first one: on a fresh pinned remote target whose first request drafted from its first round, a first
    verify of 2 tokens measured at 114 ms (a plain round: ~55) kept that request and the next three from drafting
    again (16.5 tok/s, plain decoding's speed); with this warm-up its first request ran 30.2 tok/s."""
    rows, ids = _prefilled_probe_row(model, decoder)
    for count in range(2, SMALL_BLOCK_ROWS + 1):  # a verify's logits: every position's, unlike a prefill's last
        rows.verify(ids[:, :count])


def _choose_single_rows(model: Any, decoder: LeanDecoder) -> None:
    """Pads one-row products to a small block (`SmallBlocks.single_rows`) where a decode step measured faster that
    way: alternating one-token forwards each way, after one of each (the first padded one checks every shape), by
    more than `SINGLE_ROW_MARGIN` of the median. MKL computes a one-row float32 product on one thread: on the 2-core
    EPYC a SmolLM2 decode step took ~48 ms padded against ~58 ms (2 threads), and ~60 against ~56 ms on one thread.
    The logits are the same either way (each shape's padded product is used only where bitwise the one-row one)."""
    if not decoder.has_small_blocks:
        return
    rows, ids = _prefilled_probe_row(model, decoder)
    token = ids[0, :1]
    took: dict[bool, list[float]] = {False: [], True: []}
    for repeat in range(SINGLE_ROW_ROUNDS + 1):
        for padded in (False, True) if repeat % 2 else (True, False):
            decoder.small_blocks.single_rows = padded
            started = time.perf_counter()
            rows.decode(token)
            if repeat:
                took[padded].append(time.perf_counter() - started)
            rows.rollback(1)
    padded_s, plain_s = statistics.median(took[True]), statistics.median(took[False])
    decoder.small_blocks.single_rows = padded_s < (1 - SINGLE_ROW_MARGIN) * plain_s
    log.debug("one-token forward: %.1f ms padded, %.1f ms not", padded_s * 1e3, plain_s * 1e3)


def _probe(model: Any) -> str:
    """Packed forwards must give what `RowBatch` gives on this model (else: serve sequentially)."""
    reference = RowBatch(model, attention_mask=None, prompt_length=4, rows=2)
    ids = _probe_ids(model)
    try:
        wanted = [reference.prefill(ids), reference.verify(ids[:, :2])]
        got = _packed_outputs(model, None)
    except Exception as exc:  # noqa: BLE001 - any failure means: not supported
        return f"packed forward failed: {type(exc).__name__}: {exc}"
    for want, have in zip(wanted, got, strict=True):
        if want.shape != have.shape or not close_logits(want, have, model.dtype):
            return "packed forwards do not reproduce this model's logits"
    return ""


def _probe_ids(model: Any) -> torch.Tensor:
    vocab = int(model.config.get_text_config().vocab_size)
    return ((torch.arange(8).view(2, 4) * 7 + 3) % vocab).to(model.device)


def _probe_rows(model: Any, decoder: LeanDecoder | None, slots: list[int]) -> SlotRows:
    """Rows of the probe's 4-token prompts in `slots` of a small slot cache of their own, their forwards packed
    through `decoder` (None: the model's own forward)."""
    cache = SlotKVCache(model, max(slots) + 1, 16)
    return SlotRows(
        lambda work: execute(model, cache, [work], decoder=decoder),
        slots,
        attention_mask=None,
        prompt_length=4,
        rows=len(slots),
        device=cache.device,
    )


def _prefilled_probe_row(model: Any, decoder: LeanDecoder) -> tuple[SlotRows, torch.Tensor]:
    """One probe row through `decoder`, its 4-token prompt prefilled, and that prompt (`[1, 4]`)."""
    rows = _probe_rows(model, decoder, [0])
    ids = _probe_ids(model)[:1]
    rows.prefill(ids)
    return rows, ids


def _packed_outputs(model: Any, decoder: LeanDecoder | None) -> list[torch.Tensor]:
    """The probe's logits through packed forwards: a 2-row prefill, then a 2-token verify."""
    rows = _probe_rows(model, decoder, [1, 2])
    ids = _probe_ids(model)
    return [rows.prefill(ids), rows.verify(ids[:, :2])]
