"""Planning a generation: the config resolved against the prompts before the first forward pass.

`prepare_generation` does what transformers 5.23's `generate()` does before decoding, for
decoder-only models, in this order, and returns a `GenerationPlan` the loops run from:

1. Refuse (`config.check_runnable`) the modes specwire does not run (low_memory beams, token
   healing) with `UnsupportedModeError` naming the field; group and constrained beam search,
   contrastive search and DoLa, which transformers 5 dropped and specwire runs with transformers
   4.55.4's semantics, get that release's rules; refuse token ids past the model's vocabulary.
2. Apply the global defaults to unset fields (`max_length=20`, `top_k=50`, ...; the config passed in
   is already merged request > model `generation_config.json`).
3. Special tokens: `eos_token_id` becomes a list; `pad_token_id` defaults to `eos[0]`.
4. Attention mask: given, or inferred as `input_ids != pad` when the pad id occurs in the prompt and is
   not an EOS id, else all ones. (The rows turn it into position ids, `cumsum(mask) - 1`, and drop an
   all-ones mask, as transformers does.)
5. Rows are expanded with `repeat_interleave(max(num_beams, num_return_sequences))`
   (`GenerationPlan.expanded`).
6. Lengths: `max_new_tokens` wins (`max_length = input_len + max_new_tokens`); with no length set
   anywhere, 20 new tokens capped at `max_position_embeddings`; an explicit `max_length` is absolute.
   `min_new_tokens` sets `min_length = input_len + min_new_tokens`. `input_len >= max_length` raises.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, cast

import torch

from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.config import check_runnable
from specwire.generation.rows import model_device

__all__ = [
    "DEFAULT_NEW_TOKENS",
    "GenerationPlan",
    "check_token_ids",
    "model_limits",
    "prepare_generation",
    "resolved_eos_token_ids",
]

# Transformers' default when no length is set anywhere: this many *new* tokens.
DEFAULT_NEW_TOKENS = 20


@dataclasses.dataclass
class GenerationPlan:
    """
    Everything resolved before the first forward pass.

    Args:
        config (`GenerationConfig`):
            The config with global defaults applied and the final `max_length` / `min_length`.
        input_ids (`torch.LongTensor` of shape `(batch, input_len)`):
            The prompts as given (on the model's device).
        attention_mask (`torch.LongTensor` of shape `(batch, input_len)`):
            Given or inferred mask (before dropping an all-ones mask).
        expand (`int`):
            Rows per prompt: `max(num_beams, num_return_sequences)`.
        eos_token_ids (`list[int]`, *optional*):
            EOS ids, or `None`.
        pad_token_id (`int`, *optional*):
            Pad id (`eos[0]` when unset).
        max_length (`int`):
            Final total length limit.
        input_len (`int`):
            Prompt length (padding included).
        num_beams (`int`):
            Beams per prompt.
        do_sample (`bool`):
            Sampling or beam-sample.
        structured (`CompiledGrammar`, *optional*):
            The request's structured-output spec, compiled for the model's tokenizer.
        allowed_token_sequences (`tuple[tuple[int, ...], ...]`, *optional*):
            The serializable `prefix_allowed_tokens_fn`: generated tokens follow one of these, then EOS.
        logits_processor (`tuple`, *optional*):
            User logits processors (server plugins, `specwire.generation.plugins`), applied where
            transformers merges a user `logits_processor` list, after the structured-output mask.
        stopping_criteria (`tuple`, *optional*):
            User stopping criteria, appended after specwire's own as transformers merges them.
    """

    config: Any
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    expand: int
    eos_token_ids: list[int] | None
    pad_token_id: int | None
    max_length: int
    input_len: int
    num_beams: int
    do_sample: bool
    structured: Any = None
    allowed_token_sequences: tuple[tuple[int, ...], ...] | None = None
    logits_processor: tuple[Any, ...] = ()
    stopping_criteria: tuple[Any, ...] = ()

    @property
    def rows(self) -> int:
        """Rows the loop runs: prompts times `expand`."""
        return int(self.input_ids.shape[0]) * self.expand

    @property
    def max_new_tokens(self) -> int:
        """Steps the loop may run at most."""
        return self.max_length - self.input_len

    def expanded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts and mask with each prompt repeated `expand` times, rows ordered `[b0, b0, .., b1, ..]`."""
        if self.expand == 1:
            return self.input_ids, self.attention_mask
        return (
            self.input_ids.repeat_interleave(self.expand, dim=0),
            self.attention_mask.repeat_interleave(self.expand, dim=0),
        )

    def require_tokenizer(self, tokenizer: Any) -> None:
        """Stop strings are matched on token text: refuse them without the model's tokenizer."""
        if self.config.stop_strings is not None and tokenizer is None:
            raise InvalidGenerationArgument.for_field(
                "stop_strings", self.config.stop_strings, "stop_strings need the model's tokenizer to be passed"
            )


def model_limits(model: Any, max_position_embeddings: int | None = None) -> tuple[int, int | None]:
    """The model's vocabulary size and context length (`max_position_embeddings` wins when given)."""
    vocab_size = int(model.config.get_text_config().vocab_size)
    if max_position_embeddings is None:
        max_position_embeddings = getattr(model.config, "max_position_embeddings", None)
    return vocab_size, max_position_embeddings


def _as_id_list(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


# The field that selects each mode transformers 5 moved to Hub `custom_generate` recipes.
_TOKEN_ID_FIELDS = (
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
    "sequence_bias",
    "force_words_ids",
    "constraints",
)


def _flat_ids(name: str, value: Any) -> list[int]:
    """The integer ids a token-id field mentions (other shapes are left to the config's validation)."""
    if isinstance(value, torch.Tensor):
        return [] if torch.is_floating_point(value) else [int(v) for v in value.reshape(-1).tolist()]
    if name == "sequence_bias":
        if isinstance(value, dict):
            keys = list(value)
        else:
            keys = [pair[0] for pair in value if isinstance(pair, (list, tuple)) and pair]
        return [t for key in keys if isinstance(key, (list, tuple)) for t in _flat_ids("", key)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _flat_ids("", item)]
    if isinstance(value, dict):  # a constraint as plain data: its token ids
        return [t for item in value.values() for t in _flat_ids("", item)]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return []


def check_token_ids(config: Any, vocab_size: int, input_ids: torch.Tensor | None = None, rows: int = 1) -> None:
    """
    Refuses token ids outside `[0, vocab_size)` in the config's id fields and in the prompts.

    `eos_token_id` is checked when a processor indexes the scores with it (`min_length`,
    `min_new_tokens`, `exponential_decay_length_penalty`), `pad_token_id` when more than one row runs
    (a finished row is fed the pad token while the others go on); elsewhere transformers never indexes
    with them, so a model config's out-of-range special id keeps working as it does there.

    Args:
        config (`GenerationConfig`):
            The merged config with the global defaults applied.
        vocab_size (`int`):
            The model's vocabulary size (the width of its logits).
        input_ids (`torch.LongTensor` of shape `(batch, input_len)`, *optional*):
            The prompts.
        rows (`int`, *optional*, defaults to 1):
            Rows the generation runs (prompts x `max(num_beams, num_return_sequences)`).

    Raises:
        `InvalidGenerationArgument`: naming the field, the first bad id, the vocabulary size and the fix.
    """
    names = list(_TOKEN_ID_FIELDS)
    if (
        (config.min_length or 0) > 0
        or (config.min_new_tokens or 0) > 0
        or config.exponential_decay_length_penalty is not None
    ):
        names.append("eos_token_id")
    if rows > 1:
        names.append("pad_token_id")
    for name in names:
        value = getattr(config, name, None)
        if value is None:
            continue
        bad = [t for t in _flat_ids(name, value) if not 0 <= t < vocab_size]
        if bad:
            raise InvalidGenerationArgument.for_field(
                name,
                value,
                f"token id {bad[0]} is outside this model's vocabulary of {vocab_size} ids (valid ids are "
                f"0..{vocab_size - 1}); use ids of the model's tokenizer (GetModelInfo gives vocab_size) "
                "or remove it",
            )
    if input_ids is not None and input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab_size:
            raise InvalidGenerationArgument.for_field(
                "input_ids",
                low if low < 0 else high,
                f"token ids must be in [0, {vocab_size}) for this model's vocabulary; use ids of the model's tokenizer",
            )


def prepare_generation(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: Any,
    max_position_embeddings: int | None = None,
    structured_output: Any = None,
    tokenizer: Any = None,
    allowed_token_sequences: Any = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
) -> GenerationPlan:
    """
    Resolves a merged config against the prompts the way transformers' `generate()` does before decoding.

    Args:
        model (`PreTrainedModel`):
            The causal LM.
        input_ids (`torch.LongTensor` of shape `(batch, input_len)`):
            Left-padded prompts.
        attention_mask (`torch.LongTensor` of shape `(batch, input_len)`, *optional*):
            Prompt mask; inferred from the pad id when missing.
        config (`GenerationConfig`):
            Merged request/model config (unset fields allowed).
        max_position_embeddings (`int`, *optional*):
            Context length for the default-length cap; read from the model config when `None`.
        structured_output (`StructuredOutput`, *optional*):
            A JSON schema, regex, grammar or choice list the output must match; compiled here (cached per
            spec), so a spec the library refuses raises before any forward pass.
        tokenizer (`PreTrainedTokenizerFast`, *optional*):
            The model's tokenizer; needed for `structured_output`.
        allowed_token_sequences (`Sequence[Sequence[int]]`, *optional*):
            Allowed generated sequences (the serializable form of `prefix_allowed_tokens_fn`, see
            `processors.prefix`); checked here against the vocabulary.
        logits_processor (`Sequence[LogitsProcessor]`, *optional*):
            User processors (`(input_ids, scores) -> scores`, pure functions of their inputs: under
            speculation they are called for every candidate position); see `GenerationPlan`.
        stopping_criteria (`Sequence[StoppingCriteria]`, *optional*):
            User criteria (`(input_ids, scores) -> BoolTensor (rows,)`).

    Returns:
        `GenerationPlan`

    Raises:
        `UnsupportedModeError`: a removed decoding mode is selected.
        `ValueError` (`InvalidArgument`): inconsistent values, or `input_len >= max_length`.
    """
    _check_shapes(input_ids, attention_mask)
    device = model_device(model)
    input_ids = input_ids.to(device)
    # Whether a max_length was set anywhere (request or model config) decides the "20 new tokens" rule, so
    # it must be read before the global default (max_length=20) fills the field.
    has_default_max_length = config.max_length is None
    config = check_runnable(config)
    rows = input_ids.shape[0] * max(int(config.num_beams), int(config.num_return_sequences))
    check_token_ids(config, model_limits(model)[0], input_ids, rows)

    eos, pad = _special_tokens(config)
    if attention_mask is None:
        attention_mask = _infer_attention_mask(input_ids, eos, pad)
    else:
        attention_mask = attention_mask.to(device).long()
    input_len = input_ids.shape[1]
    if max_position_embeddings is None:
        max_position_embeddings = getattr(model.config, "max_position_embeddings", None)
    config = _resolve_lengths(config, input_len, has_default_max_length, max_position_embeddings)

    structured = None
    if structured_output is not None:
        from specwire.generation.structured import compile_structured_output

        structured = compile_structured_output(structured_output, tokenizer, model_limits(model)[0], eos)
    allowed = _checked_sequences(allowed_token_sequences, model_limits(model)[0], eos)
    num_beams = int(config.num_beams)
    return GenerationPlan(
        config=config,
        input_ids=input_ids,
        attention_mask=attention_mask,
        expand=max(num_beams, int(config.num_return_sequences)),
        eos_token_ids=eos,
        pad_token_id=pad,
        max_length=int(config.max_length),
        input_len=input_len,
        num_beams=num_beams,
        do_sample=bool(config.do_sample),
        structured=structured,
        allowed_token_sequences=allowed,
        logits_processor=tuple(logits_processor or ()),
        stopping_criteria=tuple(stopping_criteria or ()),
    )


def _checked_sequences(sequences: Any, vocab_size: int, eos: list[int] | None) -> tuple[tuple[int, ...], ...] | None:
    """Allowed token sequences as tuples, refused when empty, out of the vocabulary, or without an EOS id."""
    if sequences is None:
        return None
    field = "allowed_token_sequences"
    rows = tuple(tuple(int(t) for t in sequence) for sequence in sequences)
    if not rows or not all(rows):
        raise InvalidGenerationArgument.for_field(
            field, [list(r) for r in rows], "give at least one sequence, and no empty sequence"
        )
    bad = [t for row in rows for t in row if not 0 <= t < vocab_size]
    if bad:
        raise InvalidGenerationArgument.for_field(
            field, bad[0], f"token ids must be in [0, {vocab_size}) for this model's vocabulary"
        )
    if not eos:
        raise InvalidGenerationArgument.for_field(
            "eos_token_id",
            None,
            "allowed_token_sequences end a row with EOS once it completed a sequence; set eos_token_id",
        )
    return rows


def _check_shapes(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    if input_ids.dim() != 2:
        raise InvalidGenerationArgument.for_field(
            "input_ids", tuple(input_ids.shape), "input_ids must be 2-D [batch, length]"
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise InvalidGenerationArgument.for_field(
            "attention_mask",
            tuple(attention_mask.shape),
            f"attention_mask must be 2-D with the shape of input_ids {tuple(input_ids.shape)}",
        )


def resolved_eos_token_ids(config: Any) -> list[int] | None:
    """The EOS ids a plan resolves from a merged config (a list, or `None` when there is none)."""
    return _special_tokens(config)[0]


def _special_tokens(config: Any) -> tuple[list[int] | None, int | None]:
    """EOS ids as a list (or `None`) and the pad id, which falls back to the first EOS id."""
    eos = _as_id_list(config.eos_token_id) or None  # an empty list means no EOS, as None does
    pad = config.pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None and eos:
        pad = eos[0]
    return eos, int(pad) if pad is not None else None


def _infer_attention_mask(input_ids: torch.Tensor, eos: list[int] | None, pad: int | None) -> torch.Tensor:
    """Padding is inferred only when the pad id is in the prompt and is not an EOS id; else all ones."""
    can_infer = pad is not None and bool((input_ids == pad).any()) and (not eos or pad not in eos)
    return (input_ids != cast(int, pad)).long() if can_infer else torch.ones_like(input_ids, dtype=torch.long)


def _resolve_lengths(
    config: Any, input_len: int, has_default_max_length: bool, max_position_embeddings: int | None
) -> Any:
    """The config with its final `max_length` (and `min_length` from `min_new_tokens`).

    `max_new_tokens` wins; with nothing set, 20 new tokens capped at the context length.
    """
    updates: dict[str, Any] = {}
    if config.max_new_tokens is not None:
        max_length = input_len + config.max_new_tokens
    elif has_default_max_length:
        max_length = input_len + DEFAULT_NEW_TOKENS
        if max_position_embeddings is not None:
            max_length = min(max_length, max_position_embeddings)
    else:
        max_length = config.max_length
    updates["max_length"] = max_length
    if config.min_new_tokens is not None:
        updates["min_length"] = input_len + config.min_new_tokens
    config = dataclasses.replace(config, **updates)

    if input_len >= max_length:
        raise InvalidGenerationArgument.for_field(
            "max_length",
            max_length,
            f"the input length is {input_len}, but max_length is {max_length}: increase max_length or, "
            "better, set max_new_tokens",
        )
    if config.min_length is not None and config.min_length > max_length:
        warnings.warn(
            f"Unfeasible length constraints: min_length ({config.min_length}) is larger than max_length "
            f"({max_length}); generation stops at max_length.",
            UserWarning,
            stacklevel=4,
        )
    return config
