"""The forward of a Llama-style decoder as a plain sequence of torch calls, for packed steps.

Why. On a small model most of a decode step is not arithmetic: SmolLM2-135M on 2 CPU cores spends
~20 ms of a ~32 ms forward in matrix products and the rest in module calls, decorators, keyword
plumbing, mask and output bookkeeping around ~800 small ops. `LeanDecoder` computes the same on the
same weights (no copies) without that machinery: ~27 ms per decode step (~31.7 through `model(...)`).
At ~2,000 torch calls per step, each call counts: RMSNorm's float32 round trip is skipped on float32
hidden states (where `.to` returns the same tensor), a SiLU module is called as `F.silu` (its whole
forward), and `rotate_half`'s four ops are one roll (see `_rotate`). Together ~1.1 ms (~4%) less per
decode step.

Exactness. Each op computes what transformers' modeling code computes, element for element, on
tensors of the same shapes, in the same order: the embedding, the model's own rotary module, RMSNorm
as `weight * (x * rsqrt(mean(x^2) + eps))` with the float32 round trip (an identity on float32), the
q/k/v projections, the rotation `x * cos + rotate_half(x) * sin` (the same products, from a roll:
see `_rotate`), attention through `PackedStep.attend` (transformers' sdpa function), the o
projection, the gated MLP with the model's own activation, the final norm and the LM head on the
kept positions only. The logits are therefore bitwise those of `model(...)` (small blocks aside, below);
the batched scheduler checks that with a probe at start-up and falls back to `model(...)` otherwise.

LM head. On CPU, MKL's matrix product for a few rows against the tall `[vocab, hidden]` head weight is
slow: SmolLM2's head takes ~18 ms for 11 rows against ~9 ms for 16 on a 2-core Xeon, and on a 2-core
EPYC ~22 ms for 2 rows and ~33 ms for 3 against ~10 ms for 1 (a verify block of 1 or 2 drafts). Computed
in chunks of 1024 vocabulary rows it takes ~8 ms for 11 rows (Xeon), ~15 and ~17 ms for 2 and 3 (EPYC),
and every output is the same dot product with the same kernel, so the logits are bitwise those of one
product. `_Head` checks that for each row count from 2 to 33 (a verify block of up to 32 drafts, or
decode rows of several requests packed into one forward) the first time it sees that count, on that
call's own hidden states, and chunks only the counts where it holds. Measured after a 406-token
prompt (Xeon): a forward keeping 11 positions (a `prompt_lookup_num_tokens=10` verify block) takes
~67 ms instead of ~75 ms, 8 positions ~58 instead of ~65 ms.

Small blocks. MKL's float32 product of 2 to 4 rows against a weight, as `F.linear` asks for it, costs up
to twice the one-row product in this memory-bound regime: on the 2-core EPYC a SmolLM2 forward after 64
tokens took ~64 ms for 1 token, ~95 ms for 2, ~118 ms for 3 and ~108 ms for 4 (`python -m
bench.verify_blocks`). Computed the other way round, `weight @ block^T` on a block padded to 4 rows, the
same blocks took ~53, ~55 and ~62 ms: a verify of up to 3 drafts costs what a plain step costs. On that CPU
each row of that product is bitwise the row's own one-row product, what a forward of that token alone
computes. `SmallBlocks` checks that for each weight shape and row count from 2 to 4 the first time it sees
them, on that call's own input, and uses the product only where it holds (float32 CPU weights; not int8
ones). A verify block's projections, and those of a few packed requests, then round as decoding each token
alone does (what plain decoding of the same tokens computes) instead of as `model(...)` rounds that block;
everything else is unchanged. The probes that check this decoder against `model(...)` run it with small
blocks off (`LeanDecoder.model_products`); `--packed-forward transformers` serves `model(...)`'s own
products. A draft model's decoder (`lean_draft`) keeps them off: its probabilities must be the model's.

Single rows. MKL computes a one-row float32 product (a decode step of one request) on one thread; the same row
padded to a small block runs on every thread and, where `SmallBlocks` checks it, is bitwise the one-row product.
On the 2-core EPYC, a SmolLM2 decode step after 64 tokens took ~48 ms padded against ~58 ms (`python -m
bench.verify_blocks`, block 1), and over 3 alternating pairs of services (a client in its own process) plain greedy
ran 1.16x (chat) and 1.22x (code edit) faster. On one thread it took ~60 against ~56 ms, and with a client
in the service's process competing for the 2 cores, plain greedy ran 0.88x-0.95x. `SmallBlocks.single_rows` is
therefore off unless set: the batched scheduler's start-up times both and keeps the faster. The logits do not
change with it.

Supported: decoder-only models whose layers have the Llama layout (`input_layernorm`, `self_attn`
with `q/k/v/o_proj` and no q/k norms, `post_attention_layernorm`, `mlp` with `gate/up/down_proj`)
and no embedding scale: Llama, SmolLM2, Mistral, Qwen2 (projection biases are used when present).
`LeanDecoder.unsupported(model)` says why another model is not.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F

__all__ = ["SMALL_BLOCK_ROWS", "LeanDecoder", "SmallBlocks"]

log = logging.getLogger(__name__)

_MODEL_TYPES = ("llama", "mistral", "qwen2")
_NORM_ATTRIBUTES = ("input_layernorm", "post_attention_layernorm")
_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Row counts whose LM head may run in vocabulary chunks on CPU, and the chunk size (module docstring).
_CHUNKED_HEAD_ROWS = range(2, 34)
_HEAD_CHUNK = 1024
# Row counts whose float32 CPU projections may run as `weight @ block^T`, on a block of this many rows.
SMALL_BLOCK_ROWS = 4


def _is_projection(module: Any) -> bool:
    """A plain linear layer, or one quantized to int8 by `quantize_dynamic` (`specwire.models.quantize_int8`)."""
    if isinstance(module, torch.nn.Linear):
        return True
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    return isinstance(module, DynamicLinear) and module._packed_params.dtype == torch.qint8


def _small_block_product(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(hidden, weight, bias)` for at most `SMALL_BLOCK_ROWS` rows as `weight @ block^T`, the rows padded
    with zeros to a block of `SMALL_BLOCK_ROWS` (module docstring)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = flat.shape[0]
    block = flat.new_zeros(SMALL_BLOCK_ROWS, flat.shape[1])
    block[:rows] = flat
    out = torch.mm(weight, block.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*hidden.shape[:-1], weight.shape[0])


def _one_row_products(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Every row's product as a forward of that row alone computes it (`[1, 1, in]`)."""
    rows = hidden.reshape(-1, 1, 1, hidden.shape[-1])
    products = [F.linear(row, weight, bias) for row in rows]
    return torch.cat(products, dim=1).view(*hidden.shape[:-1], weight.shape[0])


class SmallBlocks:
    """Where float32 CPU projections of 2 to `SMALL_BLOCK_ROWS` rows (and of one row, with `single_rows`) run as
    `weight @ block^T` (module docstring).

    Each weight shape and row count is checked the first time it is seen, on that call's own input: the small
    block's product is used from then on when every row of it is bitwise that row's one-row product, else
    `F.linear`. `enabled` False computes every product as `model(...)` does. `single_rows` (off unless set: the
    batched scheduler's start-up sets it where it measured it faster) also pads one-row products.
    """

    def __init__(self) -> None:
        self.enabled = True
        self.single_rows = False
        # (out features, in features, rows) -> whether the small block's rows are the one-row products.
        self.exact: dict[tuple[int, int, int], bool] = {}

    def apply_to(self, rows: int) -> bool:
        """Whether a product of `rows` rows goes through a small block (where its check holds)."""
        return self.enabled and (1 < rows <= SMALL_BLOCK_ROWS or (rows == 1 and self.single_rows))

    def product(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The small block's product of `hidden` where it applies and holds, else None (use `F.linear`)."""
        rows = hidden.numel() // hidden.shape[-1]
        if not self.apply_to(rows):
            return None
        key = (weight.shape[0], weight.shape[1], rows)
        exact = self.exact.get(key)
        if exact is False:
            return None
        out = _small_block_product(hidden, weight, bias)
        if exact is None:
            exact = self.exact[key] = torch.equal(out, _one_row_products(hidden, weight, bias))
            log.debug("small-block product of %d rows against a %dx%d weight: %s", rows, *key[:2], exact)
        return out if exact else None


def _small_blocks_apply(weight: torch.Tensor) -> bool:
    """Whether `SmallBlocks` may compute products with `weight`: float32, on CPU (MKL's products)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def _linear(module: torch.nn.Linear, small_blocks: SmallBlocks | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`F.linear` on the layer's weight and bias, through `small_blocks` where they may apply."""
    weight, bias = module.weight, module.bias
    if small_blocks is None or not _small_blocks_apply(weight):
        return lambda hidden: F.linear(hidden, weight, bias)

    def project(hidden: torch.Tensor) -> torch.Tensor:
        out = small_blocks.product(hidden, weight, bias)
        return F.linear(hidden, weight, bias) if out is None else out

    return project


def _projection(module: Any, small_blocks: SmallBlocks | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A projection's forward as one call: `F.linear` on a linear layer's weight and bias (see `_linear`), or
    the int8 kernel with the packed weights as a dynamically quantized layer's `forward` calls it (its float32
    output's `.to` is the same tensor)."""
    if isinstance(module, torch.nn.Linear):
        return _linear(module, small_blocks)
    packed = module._packed_params._packed_params
    reduce_range = module.version is not None and module.version >= 4
    return lambda hidden: torch.ops.quantized.linear_dynamic(hidden, packed, reduce_range=reduce_range)


def _rms_parts(module: Any) -> tuple[torch.Tensor, float]:
    return module.weight, float(module.variance_epsilon)


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `LlamaRMSNorm.forward`, op for op (its float32 round trip is a no-op on float32)."""
    if hidden.dtype == torch.float32:
        return weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps))
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(dtype)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """`sin` with its first half negated, for `_rotate`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` with one roll instead of four ops: `rotate_half(x)`
    is `cat(-x2, x1)` and `roll(x, half)` is `cat(x2, x1)`, so the product with `sin` is the product of
    the roll with `_signed_sin(sin)`, bitwise (a product's sign does not change its magnitude)."""
    return (x * cos) + (torch.roll(x, x.shape[-1] // 2, -1) * signed_sin)


def _activation(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation: `F.silu` itself for the SiLU modules (their forward is that one call), else the module."""
    from transformers.activations import SiLUActivation

    if type(module).forward is SiLUActivation.forward or (
        type(module).forward is torch.nn.SiLU.forward and not module.inplace
    ):
        return F.silu
    return cast(Callable[[torch.Tensor], torch.Tensor], module)  # an nn.Module: called on the hidden states


class _Head:
    """The LM head: the small block's product where it holds (`SmallBlocks`), else the chunked product for the
    row counts where it is bitwise the plain one (an int8 head: its kernel, unchunked). Each candidate row
    count is checked the first time it is seen: the plain product is returned, and compared with the chunked
    one of the same hidden states."""

    def __init__(self, module: Any, small_blocks: SmallBlocks):
        self.small_blocks = small_blocks
        self.project = None if isinstance(module, torch.nn.Linear) else _projection(module)
        # Row count -> whether its chunked product is bitwise the plain one (absent: not checked yet).
        self.chunked_rows: dict[int, bool] = {}
        if self.project is not None:
            return
        self.weight, self.bias = module.weight, module.bias
        weights = self.weight.split(_HEAD_CHUNK)
        biases = [None] * len(weights) if self.bias is None else self.bias.split(_HEAD_CHUNK)
        self.chunks = list(zip(weights, biases, strict=True))
        self.may_chunk = self.weight.device.type == "cpu" and len(self.chunks) > 1
        self.small_float32 = _small_blocks_apply(self.weight)

    def _chunked(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(hidden, weight, bias) for weight, bias in self.chunks], dim=-1)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` `[1, rows, hidden_size]` -> logits `[1, rows, vocab]`."""
        if self.project is not None:
            return self.project(hidden)
        if self.small_float32:
            small = self.small_blocks.product(hidden, self.weight, self.bias)
            if small is not None:
                return small
        rows = hidden.shape[1]
        chunked = self.chunked_rows.get(rows)
        if chunked:
            return self._chunked(hidden)
        logits = F.linear(hidden, self.weight, self.bias)
        if chunked is None and self.may_chunk and rows in _CHUNKED_HEAD_ROWS:
            self.chunked_rows[rows] = torch.equal(logits, self._chunked(hidden))
        return logits


class _Layer:
    def __init__(self, layer: Any, small_blocks: SmallBlocks):
        attention, mlp = layer.self_attn, layer.mlp
        self.attention = attention  # `PackedStep.attend` reads `layer_idx` and sdpa's module attributes
        self.input_norm = _rms_parts(layer.input_layernorm)
        self.post_norm = _rms_parts(layer.post_attention_layernorm)
        modules = [getattr(attention, n) for n in _ATTENTION_PROJECTIONS] + [getattr(mlp, n) for n in _MLP_PROJECTIONS]
        # q, k, v, o, gate, up, down: as `model(...)` computes them, and through `small_blocks` (a forward whose row
        # count they apply to picks these, so that any other forward pays nothing for them).
        self.projections = tuple(_projection(module) for module in modules)
        self.small_projections = tuple(_projection(module, small_blocks) for module in modules)
        self.act = _activation(mlp.act_fn)
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling


class LeanDecoder:
    """
    Packed forwards of a supported decoder without transformers' module machinery (see the module
    docstring). Build with `LeanDecoder.unsupported(model)` returning "" first.

    Args:
        model (`PreTrainedModel`): a `*ForCausalLM` with the Llama layout; its weights are used in place.
        small_blocks (`bool`, defaults to `True`): compute float32 CPU blocks of 2 to 4 rows (and of one row, with
            `small_blocks.single_rows` set) as `SmallBlocks` finds exact (module docstring); False computes every
            product as `model(...)` does.
    """

    def __init__(self, model: Any, small_blocks: bool = True):
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = _rms_parts(base.norm)
        self.small_blocks = SmallBlocks()
        self.small_blocks.enabled = small_blocks
        self.head = _Head(model.lm_head, self.small_blocks)
        self.layers = [_Layer(layer, self.small_blocks) for layer in base.layers]
        projections = [model.lm_head] + [getattr(base.layers[0].mlp, n) for n in _MLP_PROJECTIONS]
        # Whether any product here may go through small blocks (float32 CPU weights).
        self.has_small_blocks = any(
            isinstance(module, torch.nn.Linear) and _small_blocks_apply(module.weight) for module in projections
        )

    @contextlib.contextmanager
    def model_products(self) -> Iterator[None]:
        """Computes every product as `model(...)` does (small blocks off), for the probes comparing the two."""
        enabled, self.small_blocks.enabled = self.small_blocks.enabled, False
        try:
            yield
        finally:
            self.small_blocks.enabled = enabled

    @staticmethod
    def unsupported(model: Any) -> str:
        """Why `model` cannot run through `LeanDecoder` ("" when it can)."""
        config = model.config
        if getattr(config, "model_type", None) not in _MODEL_TYPES:
            return f"model type {getattr(config, 'model_type', None)!r} is not one of {_MODEL_TYPES}"
        base = getattr(model, "model", None)
        if base is None or not all(hasattr(base, n) for n in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return "no Llama-style base model"
        if not _is_projection(getattr(model, "lm_head", None)):
            return "no lm_head, or one that is not a linear layer"
        for layer in base.layers:
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attention is None or mlp is None or not hasattr(mlp, "act_fn"):
                return "a layer without the Llama layout"
            if any(hasattr(attention, n) for n in ("q_norm", "k_norm")):
                return "attention with q/k norms"
            for module, names in ((attention, _ATTENTION_PROJECTIONS), (mlp, _MLP_PROJECTIONS)):
                if not all(_is_projection(getattr(module, n, None)) for n in names):
                    return "projections that are neither linear layers nor int8 dynamic ones"
            norms = [getattr(layer, n, None) for n in _NORM_ATTRIBUTES]
            if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
                return "layer norms that are not RMSNorm"
        return ""

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, step: Any, keep: torch.Tensor) -> torch.Tensor:
        """
        One packed forward.

        Args:
            ids (`torch.LongTensor` of shape `(1, N)`): the packed tokens.
            positions (`torch.LongTensor` of shape `(1, N)`): each token's position id.
            step (`PackedStep`): where keys/values go and how rows attend.
            keep (`torch.LongTensor`): packed indices whose logits are wanted.

        Returns:
            `torch.FloatTensor` of shape `(1, len(keep), vocab_size)`: the model's logits dtype.
        """
        hidden = self.embed(ids)
        cos, sin = self.rotary(hidden, positions)
        cos, signed_sin = cos.unsqueeze(1), _signed_sin(sin.unsqueeze(1))
        batch, length = hidden.shape[:2]
        small = self.small_blocks.apply_to(batch * length)
        for layer in self.layers:
            q, k, v, o, gate, up, down = layer.small_projections if small else layer.projections
            shape = (batch, length, -1, layer.head_dim)
            residual = hidden
            hidden = _rms_norm(hidden, *layer.input_norm)
            query = q(hidden).view(shape).transpose(1, 2)
            key = k(hidden).view(shape).transpose(1, 2)
            value = v(hidden).view(shape).transpose(1, 2)
            query = _rotate(query, cos, signed_sin)
            key = _rotate(key, cos, signed_sin)
            attended = step.attend(layer.attention, query, key, value, layer.scaling)
            attended = attended.reshape(batch, length, -1).contiguous()
            hidden = residual + o(attended)
            residual = hidden
            hidden = _rms_norm(hidden, *layer.post_norm)
            hidden = down(layer.act(gate(hidden)) * up(hidden))
            hidden = residual + hidden
        hidden = _rms_norm(hidden, *self.norm)
        return self.head(hidden[:, keep, :])
