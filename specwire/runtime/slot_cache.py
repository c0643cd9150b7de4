"""A slot-based KV cache shared by many requests, and packed forwards over it.

The target service's batched scheduler runs ONE model forward per step for every request that has
work. This module is the model side of that: pure torch (plus transformers' attention interface),
no threads, no gRPC.

Layout. `SlotKVCache` preallocates, per layer, keys and values of shape
`[num_slots, kv_heads, slot_tokens, head_dim]`. A *slot* holds the KV history of one row (one
sequence); a request takes as many slots as it has rows and gives them back when it ends, so
requests join and leave without touching anybody else's cache (no `torch.cat` or
`batch_select_indices` over the whole batch, as a shared `DynamicCache` would need). The memory
budget is `num_slots * slot_tokens` positions, fixed at start-up.

Each slot keeps only real tokens: left padding of a prompt is never written, and rejected draft
tokens are dropped by moving the row's cursor back. So a row's physical index equals its position id
(`cumsum(mask) - 1` in transformers), and attention inside a slot is plain causal attention over
`[0, cursor)`: no holes, no padding masks.

Packed forward (`PackedStep`). The tokens of every participating row are concatenated into one
sequence `[1, N]` (a decode row gives 1 token, a verify row its block, a prefill row a chunk of its
prompt), with each token's own position id. Every linear layer therefore runs on exactly N tokens
(no padding to the longest row), and prefills join decode and verify steps in the same forward.
Only attention needs to know the rows: `slot_attention` (registered with transformers'
`AttentionInterface` and selected through the model config) writes the new keys/values into their
slots, then runs transformers' own `sdpa_attention_forward` per group of rows over each slot's
history (rows of one request with equal cursors and adjacent slots form one group, so a lone
request runs the very kernel calls of an unbatched forward). Without the packed-step marker in the
forward's kwargs the function is exactly `sdpa_attention_forward`, so every other forward of the
model (the sequential lane, classifier-free guidance) is unchanged.

`SlotRows` is the per-request view used by the unchanged decoding loops (a
`specwire.generation.rows.SpeculativeRows`, like `RowBatch`/`RaggedRows`): `prefill`/`decode`/`verify`
hand a `SlotWork` to a `submit` callable (the scheduler) and return its logits; `rollback`/`discard`
move cursors; `reorder` (beam parents) remaps slots and queues the copies that children of a shared
parent need, applied before the next forward.

Supported models: decoder-only models whose attention layers call the attention interface with
`module.layer_idx` and no sliding window, running with `sdpa` (Llama, SmolLM2, Qwen2/3, Mistral
without sliding window, ...). `slot_support` says why a model is not supported; the scheduler then
serves it sequentially.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from specwire.generation.rows import RowBatch

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PackedStep",
    "SlotKVCache",
    "SlotRows",
    "SlotWork",
    "install_slot_attention",
    "run_packed",
    "slot_support",
]

ATTN_IMPLEMENTATION = "specwire_slots"
_STEP_KWARG = "specwire_step"


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _kv_heads(model: Any) -> int:
    """KV heads per layer as this process holds them: a tensor-parallel shard (transformers'
    `tp_size`) holds `num_key_value_heads / tp_size` of them, while its config still names them all."""
    config = _text_config(model)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return int(heads // (getattr(model, "tp_size", None) or 1))


def slot_support(model: Any) -> str:
    """Why `model` cannot run packed forwards over a `SlotKVCache` ("" when it can)."""
    config = _text_config(model)
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ("sdpa", ATTN_IMPLEMENTATION):
        return f"attention implementation {implementation!r} (batching needs sdpa)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if getattr(config, name, None) is None:
            return f"config has no {name}"
    return ""


def _slot_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """sdpa, except inside a packed step, where keys/values go to their slots first."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    step = kwargs.pop(_STEP_KWARG, None)
    if step is None:
        return cast(
            tuple[torch.Tensor, Any],  # transformers' (attention output, weights)
            sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            ),
        )
    return step.attend(module, query, key, value, scaling), None


def install_slot_attention(model: Any) -> None:
    """Route the model's attention through `slot_attention` (sdpa for every ordinary forward)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _slot_attention)
    # Ordinary forwards get sdpa's masks; packed steps pass a ready 4-D mask, so none is built.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.config._attn_implementation = ATTN_IMPLEMENTATION


class SlotKVCache:
    """
    Preallocated keys and values for `num_slots` rows of up to `slot_tokens` positions each.

    Args:
        model (`PreTrainedModel`):
            The decoder-only model (layer count, KV heads, head size, dtype and device are read from it;
            a tensor-parallel shard's KV heads are its share, `num_key_value_heads / tp_size`).
        num_slots (`int`):
            Rows the cache can hold at once.
        slot_tokens (`int`):
            Positions per row (prompt and generated tokens; padding is not stored).
    """

    def __init__(self, model: Any, num_slots: int, slot_tokens: int):
        if num_slots < 1 or slot_tokens < 2:
            raise ValueError(f"a slot cache needs num_slots >= 1 and slot_tokens >= 2, got {num_slots}, {slot_tokens}")
        config = _text_config(model)
        heads = config.num_attention_heads
        self.kv_heads = _kv_heads(model)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.num_layers = config.num_hidden_layers
        self.num_slots = num_slots
        self.slot_tokens = slot_tokens
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        shape = (num_slots, self.kv_heads, slot_tokens, self.head_dim)
        # Uninitialised on purpose: a position is always written before anything attends to it, and
        # untouched pages cost no resident memory until requests reach them.
        self.keys = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.values = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.free = list(range(num_slots))

    @staticmethod
    def bytes_per_slot(model: Any, slot_tokens: int) -> int:
        """Memory one slot takes (keys and values of every layer)."""
        config = _text_config(model)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        size = next(model.parameters()).element_size()
        return cast(int, 2 * config.num_hidden_layers * _kv_heads(model) * head_dim * slot_tokens * size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` free slots (adjacent ones when possible, so a request's rows share kernel calls)."""
        if count > len(self.free):
            return None
        self.free.sort()
        for start in range(len(self.free) - count + 1):
            run = self.free[start : start + count]
            if run[-1] - run[0] == count - 1:
                del self.free[start : start + count]
                return run
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def release(self, slots: Sequence[int]) -> None:
        self.free.extend(slots)

    def copy(self, copies: Sequence[tuple[int, int]], length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` for every `(src, dst)`."""
        if not copies or length <= 0:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for buffers in (self.keys, self.values):
            for layer in buffers:
                layer[dst, :, :length] = layer[src, :, :length]


@dataclasses.dataclass
class SlotWork:
    """
    One request's share of a forward: tokens to append to some of its slots.

    Args:
        slots (`list[int]`): the slot of every row.
        tokens (`list[list[int]]`): the tokens each row appends (a prefill's prompt, a decode's token,
            a verify block), written from `cursors[row]` on.
        cursors (`list[int]`): positions each row already holds.
        keep_all (`bool`): return logits after every token (decode/verify) or only after the last
            token of each row (prefill).
        copies (`list[tuple[int, int]]`): slot copies `(src, dst)` of `copy_length` positions to make
            before the forward (beam search parents shared by several children).
    """

    slots: list[int]
    tokens: list[list[int]]
    cursors: list[int]
    keep_all: bool
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    copy_length: int = 0
    # Filled in by whoever runs the work:
    done_tokens: list[int] = dataclasses.field(default_factory=list)  # per row, tokens run so far
    outputs: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)  # per row, [n, vocab] pieces

    def __post_init__(self) -> None:
        self.done_tokens = [0] * len(self.slots)
        self.outputs = [[] for _ in self.slots]

    @property
    def remaining(self) -> int:
        return sum(len(t) - d for t, d in zip(self.tokens, self.done_tokens, strict=True))

    @property
    def finished(self) -> bool:
        return self.remaining == 0


@dataclasses.dataclass
class _Group:
    start: int  # first packed token
    rows: int  # rows in the group (adjacent slots, same cursor and length)
    length: int  # tokens per row
    slot: int  # first slot
    cursor: int  # positions each row held before this step
    mask: torch.Tensor | None


class PackedStep:
    """
    The rows of one packed forward: where each token's keys go and how attention groups rows.

    Args:
        cache (`SlotKVCache`): the shared cache.
        pieces (`list[tuple[int, int, int]]`): `(slot, cursor, num_tokens)` per row piece, in packed order.
    """

    def __init__(self, cache: SlotKVCache, pieces: Sequence[tuple[int, int, int]]):
        self.cache = cache
        # Kept as given: a tensor-parallel follower rebuilds the step on its own shard from them.
        self.pieces = [(int(slot), int(cursor), int(n)) for slot, cursor, n in pieces]
        device = cache.device
        slots = torch.tensor([p[0] for p in pieces], dtype=torch.long)
        cursors = torch.tensor([p[1] for p in pieces], dtype=torch.long)
        counts = torch.tensor([p[2] for p in pieces], dtype=torch.long)
        token_slot = slots.repeat_interleave(counts)  # [N]
        starts = counts.cumsum(0) - counts
        offsets = torch.arange(int(counts.sum())) - starts.repeat_interleave(counts)
        self.positions = (cursors.repeat_interleave(counts) + offsets).to(device)  # [N]
        heads = torch.arange(cache.kv_heads)
        rows_index = token_slot[:, None] * cache.kv_heads + heads[None]  # [N, kv_heads]
        self.write_index = (rows_index * cache.slot_tokens + self.positions.cpu()[:, None]).reshape(-1).to(device)
        self.groups: list[_Group] = []
        masks: dict[tuple[int, int], torch.Tensor | None] = {}
        start = 0
        for slot, cursor, n in pieces:
            last = self.groups[-1] if self.groups else None
            if (
                last is not None
                and last.length == n
                and last.cursor == cursor
                and last.slot + last.rows == slot
                and last.start + last.rows * last.length == start
            ):
                last.rows += 1
            else:
                key = (cursor, n)
                if key not in masks:
                    # One token, or a prompt from position 0: sdpa's own causal handling (as unbatched).
                    masks[key] = (
                        None
                        if n == 1 or cursor == 0
                        else (
                            torch.arange(n, device=device)[:, None] + cursor
                            >= torch.arange(cursor + n, device=device)[None]
                        )[None, None]
                    )
                self.groups.append(_Group(start, 1, n, slot, cursor, masks[key]))
            start += n
        self.num_tokens = start

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """Write this step's keys/values of layer `module.layer_idx` and attend every row to its slot.

        `query` `[1, heads, N, head_dim]`, `key`/`value` `[1, kv_heads, N, head_dim]`; returns
        `[1, N, heads, head_dim]` as transformers' attention functions do.
        """
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        cache = self.cache
        layer = module.layer_idx
        keys, values = cache.keys[layer], cache.values[layer]
        d = cache.head_dim
        keys.view(-1, d).index_copy_(0, self.write_index, key[0].transpose(0, 1).reshape(-1, d))
        values.view(-1, d).index_copy_(0, self.write_index, value[0].transpose(0, 1).reshape(-1, d))
        heads = query.shape[1]
        outputs = []
        for g in self.groups:
            end = g.cursor + g.length
            q = query[0, :, g.start : g.start + g.rows * g.length].reshape(heads, g.rows, g.length, d).transpose(0, 1)
            k = keys[g.slot : g.slot + g.rows, :, :end]
            v = values[g.slot : g.slot + g.rows, :, :end]
            out, _ = sdpa_attention_forward(module, q, k, v, g.mask, dropout=0.0, scaling=scaling)
            outputs.append(out.reshape(1, g.rows * g.length, heads, d))  # out: [rows, length, heads, d]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def run_packed(
    model: Any,
    cache: SlotKVCache,
    pieces: Sequence[tuple[int, int, list[int]]],
    keep: Sequence[int],
    decoder: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """
    One packed forward.

    Args:
        model (`PreTrainedModel`): with `install_slot_attention` applied.
        cache (`SlotKVCache`): where the rows' histories live.
        pieces (`list[tuple[int, int, list[int]]]`): `(slot, cursor, tokens)` per row piece, in packed order.
        keep (`list[int]`): packed indices whose next-token logits are wanted.
        decoder (`LeanDecoder`, *optional*): runs the forward instead of `model(...)`, with the same
            logits (`specwire.runtime.lean_decoder`).

    Returns:
        `torch.FloatTensor` of shape `(len(keep), vocab_size)`: float32 logits.
    """
    step = PackedStep(cache, [(slot, cursor, len(tokens)) for slot, cursor, tokens in pieces])
    ids = torch.tensor([t for _, _, tokens in pieces for t in tokens], dtype=torch.long, device=cache.device)
    keep_index = torch.tensor(list(keep), dtype=torch.long, device=cache.device)
    if decoder is not None:
        with torch.no_grad():
            logits = decoder(ids[None], step.positions[None], step, keep_index)
        return logits[0].to(dtype=torch.float32, copy=True)
    with torch.no_grad():
        outputs = model(
            input_ids=ids[None],
            position_ids=step.positions[None],
            # A ready 4-D mask makes transformers skip mask construction; slot_attention ignores it.
            attention_mask=_NO_MASK.to(cache.device) if _NO_MASK.device != cache.device else _NO_MASK,
            use_cache=False,
            logits_to_keep=keep_index,
            return_dict=True,
            **{_STEP_KWARG: step},
        )
    return cast(torch.Tensor, outputs.logits[0].to(dtype=torch.float32, copy=True))


_NO_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


class SlotRows:
    """
    Model state of one request's rows, kept in shared slots (`specwire.generation.rows.SpeculativeRows`).

    Args:
        submit (`Callable[[SlotWork], None]`):
            Runs a work item (in a shared forward) and returns when its `outputs` are filled.
        slots (`list[int]`):
            One slot per row.
        attention_mask (`torch.LongTensor` of shape `(rows, prompt_length)`, *optional*):
            Prompt mask (0 = padding, never stored).
        prompt_length (`int`):
            Length of the prompts `prefill` will receive.
        rows (`int`):
            Number of rows.
        device (`torch.device`):
            The cache's device.
        process (`Callable`, *optional*):
            Applies logits processors (`RowBatch.process`'s contract), e.g. batched with other
            requests' rows; defaults to one call per item, here.
    """

    def __init__(
        self,
        submit: Callable[[SlotWork], object],
        slots: list[int],
        *,
        attention_mask: torch.Tensor | None,
        prompt_length: int,
        rows: int,
        device: torch.device,
        process: Callable[[list[Any]], list[torch.Tensor]] | None = None,
    ):
        if len(slots) != rows:
            raise ValueError(f"{rows} rows need {rows} slots, got {len(slots)}")
        self.submit = submit
        self.slots = list(slots)
        self.cursors = [0] * rows
        self.device = device
        self.prompt_length = prompt_length
        self.attention_mask = None
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            self.attention_mask = attention_mask.to(device)
        self._copies: list[tuple[int, int]] = []
        self._copy_length = 0
        self.process = process or RowBatch.process

    @property
    def padding_lengths(self) -> torch.Tensor | None:
        """Left-padding length of every row `[rows]`, or `None` without padding."""
        if self.attention_mask is None:
            return None
        return (self.attention_mask != 0).int().argmax(dim=1)

    def _run(self, tokens: list[list[int]], keep_all: bool) -> list[torch.Tensor]:
        work = SlotWork(list(self.slots), tokens, list(self.cursors), keep_all, self._copies, self._copy_length)
        self._copies, self._copy_length = [], 0
        self.submit(work)
        for r, row_tokens in enumerate(tokens):
            self.cursors[r] += len(row_tokens)
        return [torch.cat(pieces) if len(pieces) > 1 else pieces[0] for pieces in work.outputs]

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Runs the prompts (padding skipped) and returns the next-token logits `[rows, vocab]`."""
        if self.attention_mask is None:
            tokens = input_ids.tolist()
        else:
            keep = self.attention_mask.bool().cpu()
            tokens = [row[mask].tolist() for row, mask in zip(input_ids.cpu(), keep, strict=True)]
        return torch.stack(self._run(tokens, keep_all=False))[:, -1]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Appends one token per row and returns the next logits `[rows, vocab]`."""
        return torch.stack(self._run([[t] for t in tokens.view(-1).tolist()], keep_all=True))[:, -1]

    def verify(self, candidates: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Appends a block per row (only `valid` slots) and returns the logits `[rows, k, vocab]`."""
        k = candidates.shape[1]
        ids = candidates.tolist()
        flags = valid.bool().tolist() if valid is not None else [[True] * k for _ in ids]
        tokens = [
            [t for t, f in zip(row, row_flags, strict=True) if f] for row, row_flags in zip(ids, flags, strict=True)
        ]
        pieces = self._run(tokens, keep_all=True)
        if all(p.shape[0] == k for p in pieces):
            return torch.stack(pieces)
        out = pieces[0].new_zeros((len(pieces), k, pieces[0].shape[-1]))
        for r, (piece, row_flags) in enumerate(zip(pieces, flags, strict=True)):
            out[r, torch.tensor(row_flags, dtype=torch.bool)] = piece
        return out

    def rollback(self, num_positions: int) -> None:
        """Forgets the last `num_positions` positions of every row."""
        if num_positions > 0:
            self.cursors = [c - num_positions for c in self.cursors]

    def discard(self, physical: torch.Tensor, real: torch.Tensor) -> None:
        """Drops each row's last `real[row]` tokens (invalid slots of a verify block were never stored)."""
        for r, n in enumerate(real.tolist()):
            self.cursors[r] -= int(n)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row `i` continues from row `rows[i]`: a parent's slot goes to its first child, the others get copies."""
        parents = rows.tolist()
        old_slots, old_cursors = self.slots, self.cursors
        taken: set[int] = set()
        new_slots: list[int | None] = [None] * len(parents)
        for i, p in enumerate(parents):
            if old_slots[p] not in taken:
                taken.add(old_slots[p])
                new_slots[i] = old_slots[p]
        spare = [s for s in old_slots if s not in taken]
        for i, p in enumerate(parents):
            if new_slots[i] is None:
                new_slots[i] = spare.pop()
                self._copies.append((old_slots[p], cast(int, new_slots[i])))  # just filled
                self._copy_length = max(self._copy_length, old_cursors[p])
        self.slots = [int(s) for s in cast(list[int], new_slots)]  # every None filled above
        self.cursors = [old_cursors[p] for p in parents]


def execute(
    model: Any,
    cache: SlotKVCache,
    works: Sequence[SlotWork],
    token_budget: int | None = None,
    decoder: Callable[..., torch.Tensor] | None = None,
) -> int:
    """
    Runs `works` (or, for prefills, as much as `token_budget` allows) in one packed forward.

    Works with `keep_all` (decode and verify steps) always run whole; prefills are cut into chunks
    across forwards when the budget runs out, in order. Logits land in each work's `outputs`.

    Args:
        model (`PreTrainedModel`): with `install_slot_attention` applied.
        cache (`SlotKVCache`): the shared cache.
        works (`list[SlotWork]`): step works first, then prefills in admission order.
        token_budget (`int`, *optional*): most tokens to run (step works are never cut).
        decoder (`LeanDecoder`, *optional*): runs the forward instead of `model(...)` (see `run_packed`).

    Returns:
        `int`: the number of tokens run.
    """
    budget = token_budget if token_budget is not None else 1 << 62
    pieces: list[tuple[int, int, list[int]]] = []
    keep: list[int] = []
    owners: list[tuple[SlotWork, int, int]] = []
    index = 0
    for work in works:
        if work.copies:
            cache.copy(work.copies, work.copy_length)
            work.copies = []
        # Rows in slot order: after a beam reorder, a request's adjacent slots are attended as one
        # group again (see `PackedStep`); each row's logits still land in its own `outputs[r]`.
        for r in sorted(range(len(work.tokens)), key=work.slots.__getitem__):
            tokens = work.tokens[r]
            done = work.done_tokens[r]
            left = len(tokens) - done
            take = left if work.keep_all else min(left, budget)
            if take <= 0:
                continue
            pieces.append((work.slots[r], work.cursors[r] + done, tokens[done : done + take]))
            if work.keep_all:
                keep.extend(range(index, index + take))
                owners.append((work, r, take))
            elif done + take == len(tokens):
                keep.append(index + take - 1)
                owners.append((work, r, 1))
            work.done_tokens[r] += take
            index += take
            budget -= take
    if not pieces:
        return 0
    logits = run_packed(model, cache, pieces, keep, decoder)
    offset = 0
    for work, r, n in owners:
        work.outputs[r].append(logits[offset : offset + n])
        offset += n
    return index
