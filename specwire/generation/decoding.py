"""The decoding loop: greedy, multinomial sampling, beam search and beam-sample, with `generate()` semantics.

Structure. Generation is a sequence of *steps over a batch of rows*. A row is one sequence the model
extends: a prompt repeated `max(num_beams, num_return_sequences)` times gives that many rows. Three
kinds of step cover every decoding mode:

- `RowBatch.prefill(input_ids)`: run the prompts (optionally in chunks) through the model, fill the
  KV cache, return the next-token logits `[rows, vocab]`.
- `RowBatch.decode(tokens)`: append one token per row, run it, return the next logits `[rows, vocab]`.
- `RowBatch.verify(candidates)`: append `k` candidate tokens per row in one forward and return the
  logits after each of them `[rows, k, vocab]`; `RowBatch.rollback(n)` then drops rejected positions
  from the cache. Speculative decoding verifies drafts with it; plain decoding is `k = 1`.

`RowBatch` owns only model-side state (KV cache, attention mask, position ids), so a scheduler can hold
one per model and feed it steps from several requests, and `RowBatch.reorder` / `RowBatch.select`
move rows around (beam parents, rows that leave the batch). Around the steps, the loop applies the
logits processors, picks tokens (`sampling.py`, or the vectorised `BeamSearch` of `beam_search.py`),
runs the stopping criteria and records outputs. It is a Python generator: each step yields a
`StepEvent`, and the final `GenerationResult` is the generator's return value (`StopIteration.value`).
Cancellation is the caller closing or abandoning the generator: no work runs past the current step.

Semantics follow transformers 5.23's `generate()` for decoder-only models, in this order:

1. Refuse (`config.check_runnable`) the modes transformers 5 dropped (group/constrained beam search,
   contrastive search, DoLa) and the ones specwire does not run (token healing, SynthID watermarking)
   with `UnsupportedModeError` naming the field; refuse token ids past the model's vocabulary.
2. Apply the global defaults to unset fields (`max_length=20`, `top_k=50`, ...; the config passed in
   is already merged request > model `generation_config.json`).
3. Special tokens: `eos_token_id` becomes a list; `pad_token_id` defaults to `eos[0]`.
4. Attention mask: given, or inferred as `input_ids != pad` when the pad id occurs in the prompt and is
   not an EOS id, else all ones. Position ids are `cumsum(mask) - 1` (left padding gets position 0).
   An all-ones mask is then dropped, as transformers does (it changes the attention kernel path).
5. Rows are expanded with `repeat_interleave(max(num_beams, num_return_sequences))`.
6. Lengths: `max_new_tokens` wins (`max_length = input_len + max_new_tokens`); with no length set
   anywhere, 20 new tokens capped at `max_position_embeddings`; an explicit `max_length` is absolute.
   `min_new_tokens` sets `min_length = input_len + min_new_tokens`. `input_len >= max_length` raises.
7. Processors and stopping criteria are built (`processors` / `stopping` modules), then the loop runs.

Assisted-generation flags (`prompt_lookup_num_tokens`, `assistant_early_exit`, `use_mtp`) are ignored
here: speculation is the target service's strategy built on `RowBatch.verify`, and it keeps this loop's
output (identical tokens for greedy, the same distribution for sampling). Attention/hidden-state outputs
are not returned, and the KV cache is always a `DynamicCache` (`cache_implementation` is ignored).

Greedy/sampling: each step processes the raw float32 logits, picks `argmax` or draws from
`softmax(scores)` with the request's generator, and, only when an EOS criterion exists, replaces the
token of rows that already finished with `pad_token_id`. The loop ends when every row finished.
Beam search: processors act on `log_softmax(logits)`; see `beam_search.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import torch

from specwire.generation.argument_errors import InvalidGenerationArgument, UnsupportedModeError
from specwire.generation.beam_search import BeamSearch
from specwire.generation.config import check_runnable
from specwire.generation.outputs import GenerationResult, StepEvent, compute_transition_scores
from specwire.generation.processors import build_logits_processors
from specwire.generation.sampling import make_generator, select_tokens
from specwire.generation.stopping import build_stopping_criteria
from specwire.vocabulary import FINISH_LENGTH, FINISH_REASON_NAMES, FinishReason

# Transformers' default when no length is set anywhere: this many *new* tokens.
DEFAULT_NEW_TOKENS = 20


# ---------------------------------------------------------------------------------------------------
# Model-side state of a batch of rows
# ---------------------------------------------------------------------------------------------------


def _accepts(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _new_cache(model: Any) -> Any:
    """A fresh DynamicCache built from the model's text config (so sliding-window layers are sized right)."""
    from transformers import DynamicCache

    config = model.config
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
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
    ):
        self.model = model
        self.device = _model_device(model)
        self.use_cache = use_cache
        self.prefill_chunk_size = prefill_chunk_size
        self._logits_to_keep = _accepts(model, "logits_to_keep")
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
        self.cache = _new_cache(model) if use_cache else None
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
            items (`Sequence[tuple[LogitsProcessorList, torch.LongTensor, torch.FloatTensor]]`):
                `(processors, input_ids [n, len], scores [n, vocab])` per item.

        Returns:
            `list[torch.FloatTensor]`: the processed scores of each item.
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
    def _forward(self, new_ids: torch.Tensor, keep: int, upto: int | None = None) -> torch.Tensor:
        """Runs the model on `new_ids` (the positions not yet in the cache) and returns float32 logits."""
        total = self.position_ids.shape[1] if upto is None else upto
        n = new_ids.shape[1]
        if self.cache is None:
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
        outputs = self.model(**inputs)
        # Copy (and upcast) only the positions we need: the prefill's full logits can be large.
        return outputs.logits[:, -keep:].to(dtype=torch.float32, copy=True)

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
        if self.cache is None:
            self.tokens = input_ids
            return self._forward(input_ids, 1)[:, -1]
        length = input_ids.shape[1]
        chunk = self.prefill_chunk_size or length
        logits = None
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            logits = self._forward(input_ids[:, start:end], 1, upto=end)
        return logits[:, -1]

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
        k = candidates.shape[1]
        self._grow(k)
        if self.cache is None:
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
            self.tokens = self.tokens.index_select(0, rows)
        self.position_ids = self.position_ids.index_select(0, rows)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.index_select(0, rows)

    def select(self, rows: torch.Tensor) -> None:
        """
        Keeps only `rows` (in that order), e.g. when requests leave a shared batch.

        Args:
            rows (`torch.LongTensor` of shape `(kept_rows,)`):
                Rows to keep.
        """
        rows = rows.to(self.device).long()
        if self.cache is not None:
            self.cache.batch_select_indices(rows)
        else:
            self.tokens = self.tokens.index_select(0, rows)
        self.position_ids = self.position_ids.index_select(0, rows)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.index_select(0, rows)


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


# ---------------------------------------------------------------------------------------------------
# Preparing a generation (config resolution, special tokens, lengths)
# ---------------------------------------------------------------------------------------------------


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


# Config fields holding token ids that the loop indexes the scores or the embedding with. An id past
# the model's vocabulary is refused up front, naming the field: transformers fails later, inside the
# loop ("The model vocabulary size is ..." at the first processor call, or an index error).
# `eos_token_id` and `pad_token_id` (often from the model's own generation_config.json) are checked
# only where they are used as indices; see `check_token_ids`.
_TOKEN_ID_FIELDS = (
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
    "sequence_bias",
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
                f"token ids must be in [0, {vocab_size}) for this model's vocabulary; use ids of the "
                "model's tokenizer",
            )


def prepare_generation(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: Any,
    max_position_embeddings: int | None = None,
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

    Returns:
        `GenerationPlan`

    Raises:
        `UnsupportedModeError`: a removed decoding mode is selected.
        `ValueError` (`InvalidArgument`): inconsistent values, or `input_len >= max_length`.
    """
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
    device = _model_device(model)
    input_ids = input_ids.to(device)
    # Whether a max_length was set anywhere (request or model config) decides the "20 new tokens" rule, so
    # it must be read before the global default (max_length=20) fills the field.
    has_default_max_length = config.max_length is None
    config = check_runnable(config)
    rows = input_ids.shape[0] * max(int(config.num_beams), int(config.num_return_sequences))
    check_token_ids(config, model_limits(model)[0], input_ids, rows)

    # Special tokens: EOS is always a list; the pad id falls back to the first EOS id.
    eos = _as_id_list(config.eos_token_id) or None  # an empty list means no EOS, as None does
    pad = config.pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None and eos:
        pad = eos[0]
    pad = int(pad) if pad is not None else None

    # Attention mask: inferred from padding only when the pad id is in the prompt and is not an EOS id.
    if attention_mask is None:
        can_infer = pad is not None and bool((input_ids == pad).any()) and (not eos or pad not in eos)
        attention_mask = (input_ids != pad).long() if can_infer else torch.ones_like(input_ids, dtype=torch.long)
    else:
        attention_mask = attention_mask.to(device).long()

    input_len = input_ids.shape[1]
    if max_position_embeddings is None:
        max_position_embeddings = getattr(model.config, "max_position_embeddings", None)

    # Lengths: max_new_tokens wins; with nothing set, 20 new tokens capped at the context length.
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
            stacklevel=3,
        )

    num_beams = int(config.num_beams)
    return GenerationPlan(
        config=config,
        input_ids=input_ids,
        attention_mask=attention_mask,
        expand=max(num_beams, int(config.num_return_sequences)),
        eos_token_ids=eos,
        pad_token_id=pad,
        max_length=int(max_length),
        input_len=input_len,
        num_beams=num_beams,
        do_sample=bool(config.do_sample),
    )


# ---------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------


def _reason_names() -> dict[int, str]:
    return dict(FINISH_REASON_NAMES)


class _StopCodes:
    """Per-row finish reason codes from the stopping criteria, with EOS reported over length.

    `StoppingCriteriaList.finish_reasons` names the first criterion in list order, and the max-length
    criterion comes first; a row whose last token is an EOS id at the length limit is reported as "eos"
    (the model chose to stop), as TGI and vLLM report it. Which rows stop is unchanged.
    """

    def __init__(self, criteria: Any, eos_token_ids: list[int] | None, device: torch.device):
        self.criteria = criteria
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device) if eos_token_ids else None

    def __call__(self, input_ids: torch.Tensor, scores: Any) -> torch.Tensor:
        codes = self.criteria.finish_reasons(input_ids, scores).to(input_ids.device)  # [rows]
        if self.eos is not None:
            ended_on_eos = torch.isin(input_ids[:, -1], self.eos)
            codes = torch.where((codes == FinishReason.LENGTH) & ended_on_eos, int(FinishReason.EOS), codes)
        return codes


def iter_generate(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: Any,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
    rows_factory: Callable[..., Any] | None = None,
) -> Generator[StepEvent, None, GenerationResult]:
    """
    Generates with transformers `generate()` semantics, one step at a time.

    Validation, length resolution and the construction of processors and stopping criteria happen in this
    call (errors raise here, before any forward pass; the `max_time` clock starts here); the returned
    generator runs the model. Iterate it to get `StepEvent`s; its return value (`StopIteration.value`,
    or `yield from`) is the `GenerationResult`. Stop iterating (or `close()` it) to cancel: nothing runs
    past the current step.

    Args:
        model (`PreTrainedModel`):
            A transformers decoder-only causal LM (e.g. `LoadedModel.model`).
        input_ids (`torch.LongTensor` of shape `(batch, input_len)`):
            Left-padded prompts.
        attention_mask (`torch.LongTensor` of shape `(batch, input_len)`, *optional*):
            0 on padding; inferred from `pad_token_id` when missing (see module docstring).
        config (`GenerationConfig`):
            Merged request > model config; unset fields get transformers' global defaults.
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            Needed for `stop_strings`.
        generator (`torch.Generator`, *optional*):
            Randomness for sampling, on the model's device. Defaults to one seeded with `config.seed`
            (or from OS entropy when no seed is set); the global RNG is never used.
        negative_prompt_ids (`torch.LongTensor` of shape `(batch, neg_len)`, *optional*):
            Negative prompt for classifier-free guidance (`guidance_scale`).
        negative_prompt_attention_mask (`torch.LongTensor` of shape `(batch, neg_len)`, *optional*):
            Its mask.
        max_position_embeddings (`int`, *optional*):
            Context length for the default-length cap; read from the model config when `None`.
        rows_factory (`Callable`, *optional*):
            Builds the model-side state instead of `RowBatch` (same constructor arguments and methods),
            e.g. the target service's slot-cache rows that share one forward with other requests.

    Returns:
        `Generator[StepEvent, None, GenerationResult]`

    Raises:
        `UnsupportedModeError`: group/constrained beam search, contrastive search, DoLa, low_memory beams,
            token healing, SynthID watermarking.
        `ValueError`: invalid combinations (see `prepare_generation`), or `stop_strings` without a tokenizer.
    """
    plan = prepare_generation(
        model, input_ids, attention_mask, config=config, max_position_embeddings=max_position_embeddings
    )
    config = plan.config
    plan.require_tokenizer(tokenizer)
    device = plan.input_ids.device
    expanded_ids, expanded_mask = plan.expanded()
    rows = (rows_factory or RowBatch)(
        model,
        attention_mask=expanded_mask,
        prompt_length=plan.input_len,
        rows=expanded_ids.shape[0],
        use_cache=bool(config.use_cache),
        prefill_chunk_size=getattr(config, "prefill_chunk_size", None),
    )
    vocab_size, max_position_embeddings = model_limits(model, max_position_embeddings)
    processors = build_logits_processors(
        config,
        input_len=plan.input_len,
        vocab_size=vocab_size,
        eos_token_ids=plan.eos_token_ids,
        num_beams=plan.num_beams,
        prompt_ids=plan.input_ids,
        prompt_pad_lengths=rows.padding_lengths,
        model=model,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
    )
    criteria = build_stopping_criteria(
        config,
        max_length=plan.max_length,
        eos_token_ids=plan.eos_token_ids,
        tokenizer=tokenizer,
        max_position_embeddings=max_position_embeddings,
    )
    if plan.do_sample and generator is None:
        generator = make_generator(config.seed, device)
    if generator is not None and generator.device.type != device.type:
        raise InvalidGenerationArgument.for_field(
            "generator",
            str(generator.device),
            f"the generator must live on the model's device ({device}); "
            f"create it with torch.Generator(device={str(device)!r})",
        )
    stop_codes = _StopCodes(criteria, plan.eos_token_ids, device)
    if plan.num_beams > 1:
        return _beam_loop(plan, rows, expanded_ids, processors, stop_codes, generator)
    return _sample_loop(plan, rows, expanded_ids, processors, stop_codes, generator)


def generate(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: Any,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    max_position_embeddings: int | None = None,
) -> GenerationResult:
    """
    Runs `iter_generate` to the end and returns its `GenerationResult`.

    Args:
        model, input_ids, attention_mask, config, tokenizer, generator, negative_prompt_ids,
        negative_prompt_attention_mask, max_position_embeddings: as for `iter_generate`.

    Returns:
        `GenerationResult`
    """
    steps = iter_generate(
        model,
        input_ids,
        attention_mask,
        config=config,
        tokenizer=tokenizer,
        generator=generator,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        max_position_embeddings=max_position_embeddings,
    )
    return drain(steps)


def drain(steps: Iterator[StepEvent]) -> GenerationResult:
    """
    Consumes a step generator and returns its result.

    Args:
        steps (`Generator[StepEvent, None, GenerationResult]`):
            What `iter_generate` returned.

    Returns:
        `GenerationResult`
    """
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def _outputs_wanted(config: Any) -> tuple[bool, bool, bool]:
    """(return_dict, keep scores, keep logits), as transformers' flags combine."""
    return_dict = bool(config.return_dict_in_generate)
    return return_dict, return_dict and bool(config.output_scores), return_dict and bool(config.output_logits)


def _sample_loop(
    plan: GenerationPlan,
    rows: RowBatch,
    input_ids: torch.Tensor,
    processors: Any,
    stop_codes: _StopCodes,
    generator: torch.Generator | None,
) -> Generator[StepEvent, None, GenerationResult]:
    """Greedy and multinomial sampling over `rows` (one row per returned sequence)."""
    config = plan.config
    return_dict, keep_scores, keep_logits = _outputs_wanted(config)
    names = _reason_names()
    scores: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    raw_logits: tuple[torch.Tensor, ...] | None = () if keep_logits else None
    num_rows = input_ids.shape[0]
    device = input_ids.device
    running = torch.ones(num_rows, dtype=torch.bool, device=device)
    reason_codes = torch.zeros(num_rows, dtype=torch.long, device=device)
    # Only an EOS criterion turns finished rows into padding (transformers' `has_eos_stopping_criteria`).
    pad_finished = plan.eos_token_ids is not None and plan.pad_token_id is not None
    pad = torch.tensor(plan.pad_token_id if pad_finished else 0, device=device)

    logits = rows.prefill(input_ids)  # [rows, V]
    step = 0
    while True:
        with torch.no_grad():
            next_scores = rows.process([(processors, input_ids, logits)])[0]  # [rows, V]
            if keep_scores:
                scores += (next_scores,)
            if keep_logits:
                raw_logits += (logits,)
            tokens = select_tokens(next_scores, do_sample=plan.do_sample, generator=generator)  # [rows]
            if pad_finished:
                tokens = torch.where(running, tokens, pad)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
            codes = stop_codes(input_ids, scores)  # [rows] FinishReason codes, 0 = running
            stopped = codes != 0
            newly = running & stopped
            reason_codes = torch.where(newly, codes, reason_codes)
            was_running = running
            running = running & ~stopped

        # One device-to-host copy per step for everything the event needs.
        host = torch.stack([tokens, was_running.long(), newly.long(), codes, running.long()]).tolist()
        token_list, was_list, newly_list, codes_list, running_list = host
        done = not any(running_list)
        yield StepEvent(
            step=step,
            tokens=[[token_list[r]] if was_list[r] else [] for r in range(num_rows)],
            finish_reasons=[
                names.get(codes_list[r], FINISH_LENGTH) if newly_list[r] else None for r in range(num_rows)
            ],
            final=done,
        )
        if done:
            break
        step += 1
        logits = rows.decode(tokens)

    finish = [names.get(code, FINISH_LENGTH) for code in reason_codes.tolist()]
    return GenerationResult(
        sequences=input_ids,
        scores=scores if return_dict else None,
        logits=raw_logits if return_dict else None,
        finish_reasons=finish,
        prompt_length=plan.input_len,
    )


def _beam_fill_value(eos: list[int] | None, pad: int | None) -> int:
    # transformers computes `pad_token_id or eos_token_id[0]` on a tensor pad id: pad id 0 is falsy there,
    # so it fills with eos[0]; without EOS ids it fills with -1 even when a pad id exists.
    if eos is None:
        return -1
    return pad if pad else eos[0]


def _beam_loop(
    plan: GenerationPlan,
    rows: RowBatch,
    input_ids: torch.Tensor,
    processors: Any,
    stop_codes: _StopCodes,
    generator: torch.Generator | None,
) -> Generator[StepEvent, None, GenerationResult]:
    """Beam search and beam-sample over `rows` (`batch * num_beams`)."""
    config = plan.config
    return_dict, keep_scores, keep_logits = _outputs_wanted(config)
    names = _reason_names()
    scores: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    raw_logits: tuple[torch.Tensor, ...] | None = () if keep_logits else None
    search = BeamSearch(
        input_ids,
        num_beams=plan.num_beams,
        max_length=plan.max_length,
        num_eos=len(plan.eos_token_ids or []),
        length_penalty=float(config.length_penalty),
        early_stopping=config.early_stopping,
        do_sample=plan.do_sample,
        fill_value=_beam_fill_value(plan.eos_token_ids, plan.pad_token_id),
    )
    nrs = int(config.num_return_sequences)
    out_rows = search.batch_size * nrs

    logits = rows.prefill(input_ids)  # [batch * num_beams, V]
    sequences = input_ids
    step = 0
    while True:
        with torch.no_grad():
            log_probs = torch.log_softmax(logits, dim=-1)
            log_probs = rows.process([(processors, sequences, log_probs)])[0]  # [batch * num_beams, V]
            if keep_logits:
                raw_logits += (logits,)
            if keep_scores:
                scores += (log_probs,)
            # The criteria see the scores recorded so far, as in transformers.
            parents = search.step(  # [batch * num_beams] parent row of every new running row
                log_probs, lambda candidates, recorded=scores: stop_codes(candidates, recorded), generator
            )
        if search.done:
            break
        yield StepEvent(step=step, tokens=[[] for _ in range(out_rows)], finish_reasons=[None] * out_rows)
        step += 1
        rows.reorder(parents)
        sequences = search.running_sequences()
        logits = rows.decode(search.last_tokens())

    final = search.finalize(nrs)
    finish = [names.get(code, FINISH_LENGTH) for code in final.reason_codes.tolist()]
    prompt_length = plan.input_len
    generated = final.sequences[:, prompt_length:]
    used = (final.beam_indices != -1).sum(dim=1).tolist()
    yield StepEvent(
        step=step,
        tokens=[generated[r, : used[r]].tolist() for r in range(out_rows)],
        finish_reasons=finish,
        final=True,
    )
    return GenerationResult(
        sequences=final.sequences,
        scores=scores if return_dict else None,
        logits=raw_logits if return_dict else None,
        beam_indices=final.beam_indices if return_dict else None,
        sequences_scores=final.sequences_scores if keep_scores else None,
        finish_reasons=finish,
        prompt_length=prompt_length,
    )


__all__ = [
    "DEFAULT_NEW_TOKENS",
    "GenerationPlan",
    "GenerationResult",
    "InvalidGenerationArgument",
    "RowBatch",
    "StepEvent",
    "UnsupportedModeError",
    "check_token_ids",
    "compute_transition_scores",
    "drain",
    "generate",
    "iter_generate",
    "prepare_generation",
]
