"""What one request may cost on this target: the limits in force and the checks that enforce them.

Every limit is checked before any model work (no forward, no KV slot, no stop-string table), so a
request that would exhaust the service's memory is refused with INVALID_ARGUMENT naming the field(s),
the value, the limit and the fix, instead of OOM-killing the target and every request running on it.
The checks run in three stages, cheapest first:

1. `check_prompts` on the wire request, before tokenization: prompt count, text characters, token counts.
2. `check_config` on the merged config, before validation and tokenization: beams, rows per prompt,
   stop strings, bias entries.
3. `check_job` on the prompts as tensors: `max_model_len` (prompt + new tokens, vLLM's rule), the
   `max_new_tokens` cap, rows, and the output budget of `output_scores`/`output_logits`. A length that
   the caller did not set (the model's generation_config.json, or transformers' 20 new tokens) is
   clipped to the limits instead of refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specwire.errors import FieldProblem, InvalidArgument
from specwire.generation.config import GenerationConfig
from specwire.serving import DEFAULT_MAX_MESSAGE_BYTES

# transformers' default when neither max_length nor max_new_tokens is set anywhere.
DEFAULT_NEW_TOKENS = 20
# The share of a message that scores/logits may fill by default: the token ids, texts and the
# other fields of the response take the rest.
OUTPUT_SHARE_OF_MESSAGE = 0.75


@dataclass(frozen=True)
class RequestLimits:
    """The most one request may ask of this target.

    Args:
        max_model_len (`int`): prompt tokens + new tokens of a row (`--max-model-len`; default: the
            model's `max_position_embeddings`).
        max_new_tokens (`int`, *optional*): new tokens per row (`--max-new-tokens`); `None` means
            only `max_model_len` bounds them.
        max_request_rows (`int`, defaults to 256): rows decoded for one request: prompts x
            max(`num_beams`, `num_return_sequences`) (`--max-request-rows`).
        max_prompts (`int`, defaults to 64): prompts per request.
        max_beams (`int`, defaults to 16): `num_beams` (`--max-beams`).
        max_stop_strings (`int`, defaults to 64): entries of `stop_strings` (`--max-stop-strings`).
        max_stop_string_chars (`int`, defaults to 256): characters of one stop string
            (`--max-stop-string-chars`).
        max_bias_entries (`int`, defaults to 16384): token ids in `sequence_bias` + `bad_words_ids` +
            `force_words_ids` (`--max-bias-entries`).
        max_output_bytes (`int`, defaults to 12 MiB): bytes `output_scores` and `output_logits` take,
            rows x new tokens x vocabulary x 4 per tensor (`--max-output-bytes`); must fit in one
            response message.
        max_prompt_chars (`int`, defaults to 1,000,000): characters of text over all prompts of a
            request, checked before tokenization (`--max-prompt-chars`).
    """

    max_model_len: int
    max_new_tokens: int | None = None
    max_request_rows: int = 256
    max_prompts: int = 64
    max_beams: int = 16
    max_stop_strings: int = 64
    max_stop_string_chars: int = 256
    max_bias_entries: int = 16384
    max_output_bytes: int = int(DEFAULT_MAX_MESSAGE_BYTES * OUTPUT_SHARE_OF_MESSAGE)  # 12 MiB
    max_prompt_chars: int = 1_000_000

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{item.name} must be a positive integer, got {value!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a new one), got {self.max_model_len}")

    @classmethod
    def for_model(cls, max_position_embeddings: int | None, **overrides: Any) -> RequestLimits:
        """Limits for a model: `max_model_len` defaults to its context length (`None` values are defaults).

        A `max_model_len` above the model's context would let requests run past the positions it was
        trained for, so it is refused.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        context = max_position_embeddings or None
        max_model_len = given.pop("max_model_len", None) or context
        if max_model_len is None:
            # A model without learned positions (none declared): no context bound but the wire's int32.
            max_model_len = 2**31 - 1
        if context is not None and max_model_len > context:
            raise ValueError(
                f"--max-model-len {max_model_len} is above the model's max_position_embeddings {context}: "
                f"use at most {context}"
            )
        return cls(max_model_len=max_model_len, **given)


# -- stage 1: the wire request, before tokenization ------------------------------------------------


def check_prompts(prompts, limits: RequestLimits, field_name: str = "prompts") -> None:
    """Prompt count, text size and token counts of a wire request, before anything is tokenized.

    Text is capped by characters, which costs nothing, since tokenizing an oversized text is the very
    work to avoid; token prompts by their count (each must leave room for one new token).
    """
    if len(prompts) > limits.max_prompts:
        raise InvalidArgument.for_field(
            field_name,
            len(prompts),
            f"at most {limits.max_prompts} prompts per request on this target: split the batch",
        )
    chars = 0
    for i, prompt in enumerate(prompts):
        kind = prompt.WhichOneof("input")
        if kind == "text":
            chars += len(prompt.text)
        elif kind == "token_ids" and len(prompt.token_ids.ids) >= limits.max_model_len:
            count = len(prompt.token_ids.ids)
            raise InvalidArgument.for_field(
                f"{field_name}[{i}].token_ids",
                f"{count} tokens",
                f"this target's max_model_len is {limits.max_model_len} tokens (prompt + new tokens, "
                f"--max-model-len): send at most {limits.max_model_len - 1} prompt tokens",
            )
    if chars > limits.max_prompt_chars:
        raise InvalidArgument.for_field(
            field_name,
            f"{chars} characters of text",
            f"at most {limits.max_prompt_chars} characters of prompt text per request on this target "
            f"(--max-prompt-chars): shorten the prompts or split the batch",
        )


# -- stage 2: the merged config, before validation and tokenization ---------------------------------


def _count_ids(value: Any, depth: int = 0) -> int:
    """Integers in a nested list (bad words, force words); shapes validation refuses count as found."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return 1
    if isinstance(value, (list, tuple)) and depth < 4:
        return sum(_count_ids(v, depth + 1) for v in value)
    return 0


def bias_entries(config: GenerationConfig) -> int:
    """Token ids in `sequence_bias` + `bad_words_ids` + `force_words_ids`."""
    count = 0
    bias = config.sequence_bias
    if isinstance(bias, dict):
        count += sum(_count_ids(list(k)) if isinstance(k, tuple) else 1 for k in bias)
    elif isinstance(bias, (list, tuple)):
        count += sum(_count_ids(entry[0]) if isinstance(entry, (list, tuple)) and entry else 0 for entry in bias)
    return count + _count_ids(config.bad_words_ids) + _count_ids(config.force_words_ids)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_config(config: GenerationConfig, limits: RequestLimits) -> None:
    """Beams, rows per prompt, stop strings and bias entries of the merged config."""
    beams = _int(config.num_beams)
    if beams is not None and beams > limits.max_beams:
        raise InvalidArgument.for_field(
            "config.num_beams", beams, f"at most {limits.max_beams} beams on this target (--max-beams)"
        )
    returns = _int(config.num_return_sequences)
    if returns is not None and returns > limits.max_request_rows:
        raise InvalidArgument.for_field(
            "config.num_return_sequences",
            returns,
            f"at most {limits.max_request_rows} rows per request on this target (--max-request-rows)",
        )
    stops = config.stop_strings
    stops = [stops] if isinstance(stops, str) else stops
    if isinstance(stops, (list, tuple)):
        if len(stops) > limits.max_stop_strings:
            raise InvalidArgument.for_field(
                "config.stop_strings",
                f"{len(stops)} strings",
                f"at most {limits.max_stop_strings} stop strings on this target (--max-stop-strings)",
            )
        for i, stop in enumerate(stops):
            if isinstance(stop, str) and len(stop) > limits.max_stop_string_chars:
                raise InvalidArgument.for_field(
                    f"config.stop_strings[{i}]",
                    f"{len(stop)} characters",
                    f"a stop string has at most {limits.max_stop_string_chars} characters on this target "
                    f"(--max-stop-string-chars)",
                )
    entries = bias_entries(config)
    if entries > limits.max_bias_entries:
        raise InvalidArgument(
            f"sequence_bias + bad_words_ids + force_words_ids hold {entries} token ids: at most "
            f"{limits.max_bias_entries} on this target (--max-bias-entries); send fewer entries",
            [
                FieldProblem(
                    f"config.{name}",
                    f"{entries} token ids in all",
                    f"at most {limits.max_bias_entries} token ids in sequence_bias + bad_words_ids + "
                    f"force_words_ids (--max-bias-entries)",
                )
                for name in ("sequence_bias", "bad_words_ids", "force_words_ids")
                if getattr(config, name) is not None
            ],
        )


# -- stage 3: the prompts as tensors -------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model that the attention weights and hidden states of a response depend on."""

    layers: int
    heads: int
    hidden: int

    @classmethod
    def of(cls, model: Any) -> ModelShape | None:
        """The shape of a transformers model, or `None` when its config does not say."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        sizes = [getattr(config, name, None) for name in ("num_hidden_layers", "num_attention_heads", "hidden_size")]
        if not all(isinstance(size, int) for size in sizes):
            return None
        layers, heads, hidden = (int(size) for size in sizes)  # type: ignore[arg-type]  # ints, checked above
        return cls(layers, heads, hidden)


def _model_output_bytes(
    rows: int, new_tokens: int, input_len: int, config: GenerationConfig, shape: ModelShape | None
) -> int:
    """Bytes of `attentions` and `hidden_states`: per generated token, per layer, float32.

    The first forward runs the prompt (query = prompt length); later ones one token each with a cache, or
    the whole sequence without one (transformers' layout, `RowBatch`).
    """
    if shape is None or not config.return_dict_in_generate:
        return 0
    cached = config.use_cache is not False
    keys = [input_len + t for t in range(new_tokens)]
    queries = [input_len] + [1] * (new_tokens - 1) if cached else keys
    size = 0
    if config.output_attentions:
        size += shape.layers * rows * shape.heads * sum(q * k for q, k in zip(queries, keys, strict=True)) * 4
    if config.output_hidden_states:
        size += (shape.layers + 1) * rows * shape.hidden * sum(queries) * 4
    return size


def output_bytes(
    rows: int,
    new_tokens: int,
    vocab_size: int,
    config: GenerationConfig,
    input_len: int = 0,
    shape: ModelShape | None = None,
) -> int:
    """Bytes the response's `scores` and `logits` take (rows x steps x vocabulary x 4 per tensor), plus its
    `attentions` and `hidden_states` when asked for and the model's `shape` is given."""
    tensors = int(bool(config.output_scores)) + int(bool(config.output_logits))
    return tensors * rows * new_tokens * vocab_size * 4 + _model_output_bytes(
        rows, new_tokens, input_len, config, shape
    )


def _most_new_tokens(budget: int, size_of: Any, upto: int) -> int:
    """The largest `n <= upto` with `size_of(n) <= budget` (sizes grow with `n`)."""
    low, high = 0, upto
    while low < high:
        middle = (low + high + 1) // 2
        if size_of(middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def check_job(
    config: GenerationConfig,
    prompts: int,
    input_len: int,
    vocab_size: int,
    limits: RequestLimits,
    caller_set_length: bool,
    max_position_embeddings: int | None = None,
    shape: ModelShape | None = None,
) -> GenerationConfig:
    """Lengths, rows and the output budget of a tokenized request; returns the config, clipped if needed.

    Args:
        config (`GenerationConfig`): the merged config (request > model; global defaults not applied).
        prompts (`int`): prompts in the batch.
        input_len (`int`): tokens of the (left-padded) prompt batch.
        vocab_size (`int`): the model's vocabulary (width of a score row).
        limits (`RequestLimits`): the limits in force.
        caller_set_length (`bool`): the request (its overrides or its config) set `max_new_tokens` or
            `max_length`. A length from the model's own config, or transformers' default, is clipped
            to the limits instead of refused.
        max_position_embeddings (`int`, *optional*): the model's context, which transformers' 20-token
            default is capped at.
        shape (`ModelShape`, *optional*): the model's sizes, for the bytes of `attentions` and
            `hidden_states`.
    """
    if input_len >= limits.max_model_len:
        raise InvalidArgument.for_field(
            "prompts",
            f"{input_len} tokens",
            f"this target's max_model_len is {limits.max_model_len} tokens (prompt + new tokens, "
            f"--max-model-len): shorten the prompt to at most {limits.max_model_len - 1} tokens",
        )
    # How transformers resolves the length (see `prepare_generation`): max_new_tokens wins; with no
    # length anywhere, 20 new tokens capped at the context; else max_length.
    if config.max_new_tokens is not None:
        field, total = "max_new_tokens", input_len + int(config.max_new_tokens)
    elif config.max_length is None:
        field, total = "", input_len + DEFAULT_NEW_TOKENS
        if max_position_embeddings:
            total = min(total, max_position_embeddings)
    else:
        field, total = "max_length", int(config.max_length)
    new_tokens = total - input_len
    cap = limits.max_model_len - input_len
    if limits.max_new_tokens is not None:
        cap = min(cap, limits.max_new_tokens)
    if new_tokens > cap:
        if caller_set_length and field:
            raise _length_refusal(field, config, input_len, new_tokens, limits)
        # Not the caller's choice: stop at the limit, as transformers stops at the model's context.
        config = dataclasses.replace(config, max_new_tokens=cap, max_length=None)
        new_tokens = cap
    beams = _int(config.num_beams) or 1
    rows = prompts * max(beams, _int(config.num_return_sequences) or 1)
    if rows > limits.max_request_rows:
        raise InvalidArgument(
            f"this request decodes {rows} rows ({prompts} prompts x max(num_beams, num_return_sequences)): "
            f"at most {limits.max_request_rows} on this target (--max-request-rows); send fewer prompts "
            f"or fewer beams/return sequences",
            [
                FieldProblem("prompts", prompts, f"{rows} rows > {limits.max_request_rows} (--max-request-rows)"),
                FieldProblem(
                    "config.num_return_sequences",
                    config.num_return_sequences,
                    f"{rows} rows > {limits.max_request_rows} (--max-request-rows)",
                ),
            ],
        )
    size = output_bytes(rows, new_tokens, vocab_size, config, input_len, shape)
    if size > limits.max_output_bytes:
        fits = _most_new_tokens(
            limits.max_output_bytes,
            lambda n: output_bytes(rows, n, vocab_size, config, input_len, shape),
            new_tokens,
        )
        outputs = ["output_scores", "output_logits"]
        if _model_output_bytes(rows, new_tokens, input_len, config, shape):
            outputs += ["output_attentions", "output_hidden_states"]
        names = [n for n in outputs if getattr(config, n)]
        message = (
            f"{' and '.join(names)} for {rows} rows x {new_tokens} new tokens x a {vocab_size}-token vocabulary "
            f"(prompt of {input_len} tokens) take {size} bytes, above this target's output budget of "
            f"{limits.max_output_bytes} bytes "
            f"(--max-output-bytes; the response must fit in one message): set max_new_tokens <= {fits}, "
            f"send fewer rows, or drop {' / '.join(names)} (compute transition scores client-side)"
        )
        raise InvalidArgument(message, [FieldProblem(f"config.{n}", True, message) for n in names])
    return config


def _length_refusal(
    field: str, config: GenerationConfig, input_len: int, new_tokens: int, limits: RequestLimits
) -> InvalidArgument:
    value = getattr(config, field)
    over_model = input_len + new_tokens > limits.max_model_len
    if over_model:
        # vLLM's max_model_len message: both parts of the length, the limit and the fix.
        fix = limits.max_model_len - input_len
        if limits.max_new_tokens is not None:
            fix = min(fix, limits.max_new_tokens)
        message = (
            f"this target's max_model_len is {limits.max_model_len} tokens (--max-model-len), but the request "
            f"asks for {input_len + new_tokens} ({input_len} in the prompt, {new_tokens} new): shorten the "
            f"prompt or set max_new_tokens <= {fix}"
        )
    else:
        message = (
            f"the request asks for {new_tokens} new tokens, above this target's cap of {limits.max_new_tokens} "
            f"(--max-new-tokens): set max_new_tokens <= {limits.max_new_tokens}"
        )
    problems = [FieldProblem(f"config.{field}", value, message)]
    if over_model:
        problems.insert(0, FieldProblem("prompts", f"{input_len} tokens", message))
    return InvalidArgument(message, problems)


def default_output_bytes(max_message_bytes: int) -> int:
    """The output budget that fits a response of `max_message_bytes` (scores/logits take 3/4 of it)."""
    return max(1, int(max_message_bytes * OUTPUT_SHARE_OF_MESSAGE))
