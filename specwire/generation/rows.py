"""The model-side state of a batch of rows: what the decoding loops call to run the model.

A row is one sequence the model extends: a prompt repeated `max(num_beams, num_return_sequences)`
times gives that many rows. Three kinds of step cover every decoding mode:

- `prefill(input_ids)`: run the prompts (optionally in chunks) through the model, fill the KV cache,
  return the next-token logits `[rows, vocab]`.
- `decode(tokens)`: append one token per row, run it, return the next logits `[rows, vocab]`.
- `verify(candidates)`: append `k` candidate tokens per row in one forward and return the logits
  after each of them `[rows, k, vocab]`; `rollback(n)` then drops rejected positions from the
  cache. Speculative decoding verifies drafts with it; plain decoding is `k = 1`.

Row state owns only what the model has seen (KV cache, attention mask, position ids); the token
history lives with the loop, so a scheduler can feed one model steps from several requests. `Rows`
names the interface the loops use, which three types implement:

- `RowBatch`: one request's rows over a transformers `DynamicCache` (plain decoding, beam search).
- `RaggedRows`: a `RowBatch` whose rows advance by different numbers of tokens per round
  (speculative decoding); it adds `verify(candidates, valid)` and `discard` (`SpeculativeRows`).
- `specwire.runtime.slot_cache.SlotRows`: the target service's rows kept in shared KV slots, run in
  forwards packed with other requests' rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

__all__ = ["RaggedRows", "RowBatch", "Rows", "SpeculativeRows", "accepts_argument", "model_device"]


class Rows(Protocol):
    """The model-side state of a batch of rows, as the decoding loops drive it.

    Implemented by `RowBatch`, `RaggedRows` and `specwire.runtime.slot_cache.SlotRows`; the loops take
    any of them through their `rows_factory` argument (same constructor arguments as `RowBatch`).
    """

    @property
    def padding_lengths(self) -> torch.Tensor | None:
        """Left-padding length of every row `[rows]`, or `None` without padding."""
        ...

    def process(self, items: Sequence[tuple[Any, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Applies logits processors: `processors(input_ids, scores)` per item (see `RowBatch.process`)."""
        ...

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Runs the prompts `[rows, prompt_length]`; returns the next-token logits `[rows, vocab]`."""
        ...

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Appends one token per row `[rows]`; returns the next-token logits `[rows, vocab]`."""
        ...

    def verify(self, candidates: torch.Tensor) -> torch.Tensor:
        """Appends `k` tokens per row `[rows, k]`; returns the logits after each `[rows, k, vocab]`."""
        ...

    def rollback(self, num_positions: int) -> None:
        """Forgets the last `num_positions` positions of every row."""
        ...

    def reorder(self, rows: torch.Tensor) -> None:
        """Row `i` continues from row `rows[i]` (beam search parents)."""
        ...


class SpeculativeRows(Rows, Protocol):
    """`Rows` whose rows advance by different numbers of tokens per round (`RaggedRows`, `SlotRows`)."""

    def verify(self, candidates: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Appends a block per row `[rows, k]` where `valid` marks the real tokens; returns `[rows, k, vocab]`."""
        ...

    def discard(self, physical: torch.Tensor, real: torch.Tensor) -> None:
        """Drops each row's last `physical[row]` slots, of which `real[row]` were real tokens."""
        ...


def model_device(model: Any) -> torch.device:
    """The device of the model's parameters (its `device` attribute when it has one)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return cast(torch.device, next(model.parameters()).device)


def accepts_argument(model: Any, name: str) -> bool:
    """Whether `model.forward` takes the keyword argument `name` (`logits_to_keep`, ...)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _new_cache(model: Any, static_cache_len: int | None = None) -> Any:
    """A fresh cache built from the model's text config (so sliding-window layers are sized right): a
    `DynamicCache`, or a `StaticCache` of `static_cache_len` positions (`cache_implementation="static"`)."""
    from transformers import DynamicCache, StaticCache

    config = model.config
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if static_cache_len is not None:
        return StaticCache(config=text_config, max_cache_len=static_cache_len)
    return DynamicCache(config=text_config)


class RowBatch:
    """
    KV cache, attention mask and position ids for a batch of rows of one decoder-only model.

    The token history lives with the caller; this object only tracks what the model has seen. With
    `use_cache=False` it keeps the tokens itself and re-runs the full sequences each step.

    Args:
        model (`PreTrainedModel`):
            A transformers causal LM (decoder-only).
        attention_mask (`torch.LongTensor` of shape `(rows, prompt_length)`, *optional*):
            Prompt mask (0 = padding). `None` means no padding; so does an all-ones mask, which is dropped
            after computing positions, as transformers does.
        prompt_length (`int`):
            Length of the prompts that `prefill` will receive.
        rows (`int`):
            Number of rows.
        use_cache (`bool`, *optional*, defaults to `True`):
            Keep a KV cache between steps.
        prefill_chunk_size (`int`, *optional*):
            Run the prompt in chunks of this many positions.
        output_attentions (`bool`, *optional*, defaults to `False`):
            Keep every forward's attention weights in `attentions` (one tuple of per-layer
            `[rows, heads, query, key]` tensors per forward; the model must run eager attention).
        output_hidden_states (`bool`, *optional*, defaults to `False`):
            Keep every forward's hidden states in `hidden_states` (one tuple of per-layer
            `[rows, query, hidden]` tensors per forward, the embeddings first).
        static_cache_len (`int`, *optional*):
            Use a `StaticCache` of this many positions per row instead of a `DynamicCache`
            (`cache_implementation="static"`; the loops that roll back use a dynamic one).
        compiled_forward (`Callable`, *optional*):
            Runs the model's decoding forwards, and a chunked prefill's chunks, instead of `model(...)`: the
            compiled call (`specwire.generation.compilation`), used where transformers uses it.
        keep_last_hidden_states (`bool` or `Sequence[int]`, *optional*, defaults to `False`):
            `True`: ask every forward for the last layer's hidden states only (`output_hidden_states=-1`, as
            transformers' MTP assistant does) and keep those of the latest prefill (one `[rows, chunk,
            hidden]` tensor per chunk) or verify (`[rows, k, hidden]`) in `last_hidden_states`: the MTP
            drafter (`speculation.mtp`) drafts from them. A sequence of hidden-state indices (0: the
            embeddings) asks for those only (`output_hidden_states=[...]`, as transformers' DFlash generator
            does) and keeps them concatenated on the feature axis (`[rows, positions, hidden * len]`): the
            DFlash drafter (`speculation.dflash`) drafts from them.
    """

    def __init__(
        self,
        model: Any,
        *,
        attention_mask: torch.Tensor | None,
        prompt_length: int,
        rows: int,
        use_cache: bool = True,
        prefill_chunk_size: int | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        static_cache_len: int | None = None,
        compiled_forward: Callable[..., Any] | None = None,
        keep_last_hidden_states: bool | Sequence[int] = False,
    ):
        self.model = model
        # The hidden-state indices every forward returns and the rows keep (None: none).
        self.kept_hidden_layers: list[int] | None = None
        if keep_last_hidden_states is True:
            self.kept_hidden_layers = [-1]
        elif keep_last_hidden_states is not False:
            self.kept_hidden_layers = list(keep_last_hidden_states)
        self.last_hidden_states: list[torch.Tensor] = []
        self.compiled_forward = compiled_forward
        self.output_attentions = output_attentions
        self.output_hidden_states = output_hidden_states
        self.attentions: list[tuple[torch.Tensor, ...]] = []
        self.hidden_states: list[tuple[torch.Tensor, ...]] = []
        self.device = model_device(model)
        self.use_cache = use_cache
        self.prefill_chunk_size = prefill_chunk_size
        self._logits_to_keep = accepts_argument(model, "logits_to_keep")
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
            positions = attention_mask.long().cumsum(-1) - 1
            # Padding positions would be -1; transformers pins them to 0.
            self.position_ids = positions.masked_fill(attention_mask == 0, 0)
            # An all-ones mask carries no information; dropping it keeps the model on the same kernel path
            # as transformers (causal attention without an explicit mask).
            self.attention_mask = None if bool((attention_mask == 1).all()) else attention_mask
        else:
            self.position_ids = torch.arange(prompt_length, device=self.device).unsqueeze(0).expand(rows, -1)
            self.attention_mask = None
        self.cache = _new_cache(model, static_cache_len) if use_cache else None
        self.tokens: torch.Tensor | None = None  # only kept without a cache

    @property
    def length(self) -> int:
        """Positions per row the model has been given so far (prompt padding included)."""
        return self.position_ids.shape[1]

    @property
    def padding_lengths(self) -> torch.Tensor | None:
        """Left-padding length of every row `[rows]`, or `None` without padding."""
        if self.attention_mask is None:
            return None
        return (self.attention_mask != 0).int().argmax(dim=1)

    @staticmethod
    def process(items: Sequence[tuple[Any, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """
        Applies logits processors: `processors(input_ids, scores)` for each item, here one call each.

        The loops process through their rows, so that rows sharing forwards with other requests (the
        target service's `SlotRows`) can share the processing too, batched with theirs.

        Args:
            items (`Sequence[tuple[LogitsProcessorList, torch.Tensor, torch.Tensor]]`):
                `(processors, input_ids [n, len], scores [n, vocab])` per item.

        Returns:
            `list[torch.Tensor]`: the processed scores of each item.
        """
        return [processors(input_ids, scores) for processors, input_ids, scores in items]

    def _grow(self, n: int) -> None:
        """Extend mask and positions by `n` new positions per row."""
        rows = self.position_ids.shape[0]
        step = torch.arange(1, n + 1, device=self.device, dtype=self.position_ids.dtype).unsqueeze(0)
        self.position_ids = torch.cat([self.position_ids, self.position_ids[:, -1:] + step], dim=-1)
        if self.attention_mask is not None:
            ones = self.attention_mask.new_ones((rows, n))
            self.attention_mask = torch.cat([self.attention_mask, ones], dim=-1)

    @torch.no_grad()
    def _forward(
        self, new_ids: torch.Tensor, keep: int, upto: int | None = None, compiled: bool = True
    ) -> torch.Tensor:
        """Runs the model on `new_ids` (the positions not yet in the cache) and returns float32 logits;
        through `compiled_forward` when there is one, unless `compiled=False` (a prefill in one piece)."""
        total = self.position_ids.shape[1] if upto is None else upto
        n = new_ids.shape[1]
        if self.cache is None:
            assert self.tokens is not None  # prefill set it: without a cache the tokens are kept
            ids = self.tokens[:, :total]
            positions = self.position_ids[:, :total]
        else:
            ids = new_ids
            positions = self.position_ids[:, total - n : total]
        inputs: dict[str, Any] = {
            "input_ids": ids.contiguous(),
            "position_ids": positions.contiguous(),
            "use_cache": self.cache is not None,
            "return_dict": True,
        }
        if self.cache is not None:
            inputs["past_key_values"] = self.cache
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask[:, :total]
        if self._logits_to_keep:
            inputs["logits_to_keep"] = keep
        if self.output_attentions:
            inputs["output_attentions"] = True
        if self.output_hidden_states:
            inputs["output_hidden_states"] = True
        elif self.kept_hidden_layers is not None:
            layers = self.kept_hidden_layers
            inputs["output_hidden_states"] = layers[0] if len(layers) == 1 else list(layers)
        call = self.model
        if compiled and self.compiled_forward is not None:
            call = self.compiled_forward
            # A one-position slice keeps its row stride (the sequence length so far), which torch.compile
            # guards on: fresh row-major copies keep one graph for every step.
            for name in ("input_ids", "position_ids"):
                inputs[name] = inputs[name].clone(memory_format=torch.contiguous_format)
        outputs = call(**inputs)
        if self.output_attentions:
            self.attentions.append(tuple(layer.detach().clone() for layer in outputs.attentions))
        if self.output_hidden_states:
            self.hidden_states.append(tuple(layer.detach().clone() for layer in outputs.hidden_states))
        if self.kept_hidden_layers is not None:
            kept = [outputs.hidden_states[i].detach() for i in self.kept_hidden_layers]
            self.last_hidden_states.append(kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1))
        # Copy (and upcast) only the positions we need: the prefill's full logits can be large.
        return cast(torch.Tensor, outputs.logits[:, -keep:].to(dtype=torch.float32, copy=True))

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """
        Runs the prompts and fills the cache.

        Args:
            input_ids (`torch.LongTensor` of shape `(rows, prompt_length)`):
                The (expanded) prompts.

        Returns:
            `torch.FloatTensor` of shape `(rows, vocab_size)`: next-token logits.
        """
        input_ids = input_ids.to(self.device)
        self.last_hidden_states = []
        if self.cache is None:
            self.tokens = input_ids
            return self._forward(input_ids, 1, compiled=False)[:, -1]
        length = input_ids.shape[1]
        chunk = self.prefill_chunk_size or length
        logits: torch.Tensor | None = None
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            # transformers runs a chunked prefill's chunks through the compiled call, a whole prefill eagerly.
            chunked = self.prefill_chunk_size is not None
            logits = self._forward(input_ids[:, start:end], 1, upto=end, compiled=chunked)
            if end < length:  # transformers returns the outputs of a chunked prefill's last chunk only
                del self.attentions[len(self.attentions) - int(self.output_attentions) :]
                del self.hidden_states[len(self.hidden_states) - int(self.output_hidden_states) :]
        return cast(torch.Tensor, logits)[:, -1]  # set: a prompt has at least one position

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """
        Appends one token per row and runs it.

        Args:
            tokens (`torch.LongTensor` of shape `(rows,)`):
                The token each row appended.

        Returns:
            `torch.FloatTensor` of shape `(rows, vocab_size)`: next-token logits.
        """
        return self.verify(tokens.view(-1, 1))[:, -1]

    def verify(self, candidates: torch.Tensor) -> torch.Tensor:
        """
        Appends `k` tokens per row and runs them in one forward.

        Args:
            candidates (`torch.LongTensor` of shape `(rows, k)`):
                Tokens to append (e.g. the last accepted token followed by draft tokens).

        Returns:
            `torch.FloatTensor` of shape `(rows, k, vocab_size)`: the logits after each appended token.
        """
        candidates = candidates.to(self.device)
        self.last_hidden_states = []
        k = candidates.shape[1]
        self._grow(k)
        if self.cache is None:
            assert self.tokens is not None  # prefill set it: without a cache the tokens are kept
            self.tokens = torch.cat([self.tokens, candidates], dim=-1)
        return self._forward(candidates, k)

    def rollback(self, num_positions: int) -> None:
        """
        Forgets the last `num_positions` positions of every row (rejected draft tokens).

        Args:
            num_positions (`int`):
                Positions to drop (>= 0).
        """
        if num_positions <= 0:
            return
        if self.cache is not None:
            self.cache.crop(-num_positions)
        else:
            assert self.tokens is not None  # prefill set it: without a cache the tokens are kept
            self.tokens = self.tokens[:, :-num_positions]
        self.position_ids = self.position_ids[:, :-num_positions]
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[:, :-num_positions]

    def reorder(self, rows: torch.Tensor) -> None:
        """
        Replaces row `i` by a copy of row `rows[i]` (beam search parents).

        Args:
            rows (`torch.LongTensor` of shape `(rows,)`):
                Source row of every row.
        """
        rows = rows.to(self.device).long()
        if self.cache is not None:
            self.cache.reorder_cache(rows)
        else:
            assert self.tokens is not None  # prefill set it: without a cache the tokens are kept
            self.tokens = self.tokens.index_select(0, rows)
        self.position_ids = self.position_ids.index_select(0, rows)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.index_select(0, rows)


class RaggedRows(RowBatch):
    """A `RowBatch` whose rows advance by different numbers of tokens per round.

    `verify(candidates, valid)` appends a block per row where only `valid` slots are real tokens.
    `discard(physical, real)` drops each row's rejected slots: the slots every row rejects are
    cropped from the cache; the rest are masked out of attention (holes), and each row's next
    position continues from its own real length. A single row never needs holes.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.next_position = self.position_ids[:, -1] + 1  # [rows]

    def _grow(self, n: int, valid: torch.Tensor | None = None) -> None:
        rows = self.position_ids.shape[0]
        if valid is None:
            valid = torch.ones((rows, n), dtype=torch.long, device=self.device)
        valid = valid.long()
        offsets = valid.cumsum(-1) - valid  # position of each slot = next + real slots before it
        self.position_ids = torch.cat([self.position_ids, self.next_position[:, None] + offsets], dim=-1)
        self.next_position = self.next_position + valid.sum(-1)
        if self.attention_mask is None and not bool(valid.all()):
            self.attention_mask = torch.ones(
                (rows, self.position_ids.shape[1] - n), dtype=torch.long, device=self.device
            )
        if self.attention_mask is not None:
            self.attention_mask = torch.cat([self.attention_mask, valid], dim=-1)

    def verify(self, candidates: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Run a block per row (`valid` marks real slots) and return the logits `[rows, k, vocab]`."""
        candidates = candidates.to(self.device)
        self.last_hidden_states = []
        k = candidates.shape[1]
        self._grow(k, None if valid is None else valid.to(self.device))
        return self._forward(candidates, k)

    def discard(self, physical: torch.Tensor, real: torch.Tensor) -> None:
        """Drop each row's last `physical[row]` slots, of which `real[row]` were real tokens."""
        self.next_position = self.next_position - real.to(self.device)
        common = int(physical.min())
        if common > 0:
            super().rollback(common)
        rest = (physical - common).tolist()
        if any(rest):
            total = self.position_ids.shape[1]
            if self.attention_mask is None:
                self.attention_mask = torch.ones(
                    (self.position_ids.shape[0], total), dtype=torch.long, device=self.device
                )
            for row, n in enumerate(rest):
                if n:
                    self.attention_mask[row, total - n :] = 0
