"""Whole generate methods installed as server plugins (`specwire.generate_methods`): the contract and its runner.

transformers' `custom_generate` replaces `generate()`'s decoding loop with a Hub repository's code;
specwire runs no remote code, so an operator installs the method as a package instead. Its entry point
names a factory, as for the other plugin kinds (`specwire.generation.plugins`):

    make(args: dict, context: PluginContext) -> method

called once per request in the preparation pool, before any model work (`ValueError`, `TypeError` or
`KeyError` there: bad arguments, INVALID_ARGUMENT with the message). The target then calls

    method(inputs: GenerateMethodInputs) -> GenerateMethodOutput | torch.LongTensor

once, on the model thread, in place of the decoding loop. The contract:

- `inputs.model` is the served model. Call it (`model(input_ids=..., past_key_values=...)`, or
  `model.generate(...)`) on the calling thread only. The call holds the model thread from start to end:
  the other requests' forwards wait for it, so a method should be short, or bounded by the request's
  `max_new_tokens` and deadline.
- `inputs.check()` must be called at least once per decoding step. It raises `GenerationStopped` when
  the caller cancelled or its deadline passed: let it propagate (the request ends, the model thread is
  free again). It also tells the server's liveness watchdog the method is making progress.
- `inputs.logits_processor` and `inputs.stopping_criteria` are the request's own, built as the loops
  build them (transformers' processors from the config, the structured-output mask, the request's
  plugin processors, and the sampling warpers when `do_sample`; max length, max time, stop strings,
  EOS and the request's plugin criteria). A method that runs several passes calls
  `inputs.new_logits_processor()` for each (the structured-output mask keeps per-row state).
- Randomness comes from `inputs.generator` (seeded with the request's `seed`), never the global RNG.
- The method returns the sequences `[batch * num_return_sequences, input_len + new_tokens]`, the
  prompt columns unchanged, token ids inside the vocabulary, at most `config.max_length` columns;
  rows that finished early are padded. Optional: `scores` (per generated column, `[rows, vocab]`, as
  transformers' `output_scores`) and `finish_reasons` (per row, from `specwire.vocabulary.FINISH_REASONS`);
  without them a row's reason is that of the first stopping criterion that fires on it.
- A method that runs beam search declares `supports_beams = True` (an attribute of the object the
  factory returns); without it `num_beams > 1` is refused. Speculation never applies (refused when
  a request asks for it).

Anything else the method raises is its bug: `PluginFailed` (INTERNAL, naming the plugin; the traceback
goes to the server log with an id). A returned value that breaks the contract is one too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specwire.errors import Cancelled, DeadlineExceeded, FieldProblem, SpecwireError
from specwire.generation.loops.stop_codes import StopCodes, reason_names
from specwire.generation.outputs import GenerationResult, outputs_wanted
from specwire.generation.planning import GenerationPlan, model_limits
from specwire.generation.plugins import Plugin, plugin_failed
from specwire.generation.processors import build_logits_processors
from specwire.generation.sampling import make_generator
from specwire.generation.stopping import MaxTimeCriteria, StoppingCriteriaList
from specwire.vocabulary import FINISH_LENGTH, FINISH_REASONS, FINISH_TIME

__all__ = [
    "GenerateMethodInputs",
    "GenerateMethodOutput",
    "GenerateMethodSteps",
    "GenerationStopped",
    "GenerationTimedOut",
    "run_generate_method",
]


class GenerationStopped(Cancelled):
    """Raised by `GenerateMethodInputs.check()`: the caller cancelled (CANCELLED), or its deadline passed."""


class GenerationTimedOut(GenerationStopped):
    """`GenerationStopped` because the caller's deadline passed (DEADLINE_EXCEEDED)."""

    code = DeadlineExceeded.code


@dataclass
class GenerateMethodInputs:
    """
    What a generate method receives (see the module docstring for the contract).

    Args:
        model (`PreTrainedModel`): the served model; call it on the calling thread only.
        tokenizer (`PreTrainedTokenizerBase` or `None`): the model's tokenizer.
        input_ids (`torch.LongTensor` of shape `(batch * expand, input_len)`): the left-padded prompts,
            each repeated `expand = max(num_beams, num_return_sequences)` times, on the model's device.
        attention_mask (`torch.LongTensor` of shape `(batch * expand, input_len)`): their mask.
        config (`GenerationConfig`): the request's config, transformers' defaults applied, `max_length`
            final (`max_length - input_len` new tokens at most).
        logits_processor (`LogitsProcessorList`): the request's processors for these rows.
        stopping_criteria (`StoppingCriteriaList`): the request's stopping criteria.
        generator (`torch.Generator` or `None`): the request's randomness (None for a greedy request
            without a seed).
        args (`dict`): the request's JSON arguments (already given to the factory).
        check (`Callable[[], None]`): call every step; raises `GenerationStopped`.
        new_logits_processor (`Callable[[], LogitsProcessorList]`): a fresh list of the same processors.
    """

    model: Any
    tokenizer: Any
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    config: Any
    logits_processor: Any
    stopping_criteria: Any
    generator: torch.Generator | None
    args: dict[str, Any]
    check: Callable[[], None]
    new_logits_processor: Callable[[], Any]

    @property
    def input_len(self) -> int:
        """Prompt columns (left padding included)."""
        return int(self.input_ids.shape[1])

    @property
    def max_new_tokens(self) -> int:
        """New columns the output may have at most."""
        return int(self.config.max_length) - self.input_len


@dataclass
class GenerateMethodOutput:
    """
    What a generate method returns.

    Args:
        sequences (`torch.LongTensor` of shape `(batch * num_return_sequences, input_len + new)`):
            Prompt plus generated tokens, finished rows padded.
        scores (`tuple(torch.FloatTensor)`, *optional*): per generated column, `(rows, vocab_size)`.
        finish_reasons (`list[str]`, *optional*): per row, one of `specwire.vocabulary.FINISH_REASONS`.
    """

    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None = None
    finish_reasons: list[str] | None = None


class _Broken(Exception):
    """The method's output breaks the contract (reported as its bug)."""


def _processors(plan: GenerationPlan, model: Any, negative: tuple[Any, Any]) -> Any:
    """The request's processors for the plan's expanded rows, as `generate_from_plan` builds them."""
    _, mask = plan.expanded()
    padded = bool((mask == 0).any())
    return build_logits_processors(
        plan.config,
        input_len=plan.input_len,
        vocab_size=model_limits(model)[0],
        eos_token_ids=plan.eos_token_ids,
        num_beams=plan.num_beams,
        prompt_ids=plan.input_ids,
        prompt_pad_lengths=(mask != 0).int().argmax(dim=1) if padded else None,
        model=model,
        negative_prompt_ids=negative[0],
        negative_prompt_attention_mask=negative[1],
        structured=plan.structured,
        allowed_token_sequences=plan.allowed_token_sequences,
        user_processors=plan.logits_processor,
    )


def run_generate_method(
    plugin: Plugin,
    method: Any,
    args: dict[str, Any],
    model: Any,
    plan: GenerationPlan,
    *,
    check: Callable[[], None],
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    negative_prompt: tuple[Any, Any] = (None, None),
    max_position_embeddings: int | None = None,
    warnings: list[FieldProblem] | None = None,
) -> GenerationResult:
    """
    Runs a generate method plugin on `plan` and checks its output into a `GenerationResult`.

    Args:
        plugin (`Plugin`): the loaded plugin (its name goes into errors).
        method (`Callable[[GenerateMethodInputs], GenerateMethodOutput | torch.Tensor]`): what the factory built.
        args (`dict`): the request's arguments.
        model (`PreTrainedModel`): the served model (call on this thread).
        plan (`GenerationPlan`): the request's plan.
        check (`Callable[[], None]`): the cancellation/deadline check (`GenerateMethodSteps.check`).
        tokenizer, generator, max_position_embeddings: as for `generate_from_plan`.
        negative_prompt (`tuple`): negative prompt ids and mask, for classifier-free guidance.
        warnings (`list[FieldProblem]`, *optional*): receives what the method did not honour (e.g.
            `output_scores` without scores).

    Raises:
        `GenerationStopped`: cancelled or past the deadline.
        `PluginFailed`: the method raised, or its output breaks the contract.
    """
    config = plan.config
    plan.require_tokenizer(tokenizer)
    device = plan.input_ids.device
    if generator is None and plan.do_sample:
        generator = make_generator(config.seed, device)
    stop_codes = StopCodes.for_plan(plan, config, tokenizer, max_position_embeddings, device)
    input_ids, attention_mask = plan.expanded()
    inputs = GenerateMethodInputs(
        model=model,
        tokenizer=tokenizer,
        input_ids=input_ids,
        attention_mask=attention_mask,
        config=config,
        logits_processor=_processors(plan, model, negative_prompt),
        stopping_criteria=stop_codes.criteria,
        generator=generator,
        args=dict(args),
        check=check,
        new_logits_processor=lambda: _processors(plan, model, negative_prompt),
    )
    try:
        output = method(inputs)
        if isinstance(output, torch.Tensor):
            output = GenerateMethodOutput(output)
        if not isinstance(output, GenerateMethodOutput):
            raise _Broken(f"returned {type(output).__name__}, not GenerateMethodOutput or a tensor")
        return _result(output, plan, model, stop_codes, warnings)
    except SpecwireError:  # its check() raising GenerationStopped, or our own refusals
        raise
    except Exception as exc:
        raise plugin_failed(plugin, "generating", exc) from exc


def _result(
    output: GenerateMethodOutput,
    plan: GenerationPlan,
    model: Any,
    stop_codes: StopCodes,
    warnings: list[FieldProblem] | None,
) -> GenerationResult:
    """The checked output as a `GenerationResult` (raises `_Broken` on a contract breach)."""
    sequences = output.sequences
    rows = int(plan.input_ids.shape[0]) * int(plan.config.num_return_sequences)
    input_len, vocab_size = plan.input_len, model_limits(model)[0]
    if sequences.dtype not in (torch.int64, torch.int32) or sequences.dim() != 2 or sequences.shape[0] != rows:
        raise _Broken(f"returned sequences {sequences.dtype} {tuple(sequences.shape)}, not int64 ({rows}, length)")
    if not input_len < sequences.shape[1] <= plan.max_length:
        raise _Broken(f"returned {sequences.shape[1]} columns; {input_len + 1}..{plan.max_length} allowed")
    sequences = sequences.to(plan.input_ids.device, torch.long)
    prompts = plan.input_ids.repeat_interleave(int(plan.config.num_return_sequences), dim=0)
    if not torch.equal(sequences[:, :input_len], prompts):
        raise _Broken("changed the prompt columns of its sequences")
    if int(sequences.min()) < 0 or int(sequences.max()) >= vocab_size:
        raise _Broken(f"returned token ids outside [0, {vocab_size})")
    return_dict, keep_scores, keep_logits = outputs_wanted(plan.config)
    scores = _scores(output.scores, sequences.shape, input_len, vocab_size) if keep_scores else None
    for name, wanted, given in (
        ("output_scores", keep_scores, scores is not None),
        ("output_logits", keep_logits, False),
        ("output_attentions", return_dict and plan.config.output_attentions, False),
        ("output_hidden_states", return_dict and plan.config.output_hidden_states, False),
    ):
        if wanted and not given and warnings is not None:
            warnings.append(
                FieldProblem(f"config.{name}", True, "not honoured: the generate method returns none", "warning")
            )
    return GenerationResult(
        sequences=sequences,
        scores=scores,
        finish_reasons=_finish_reasons(output.finish_reasons, sequences, plan, stop_codes),
        prompt_length=input_len,
    )


def _scores(scores: Any, shape: torch.Size, input_len: int, vocab_size: int) -> tuple[torch.Tensor, ...] | None:
    """The method's scores, checked: one `[rows, vocab]` tensor per generated column (None: it gave none)."""
    if scores is None:
        return None
    scores = tuple(scores)
    want = (shape[0], vocab_size)
    if len(scores) != shape[1] - input_len or any(
        not isinstance(s, torch.Tensor) or tuple(s.shape) != want for s in scores
    ):
        raise _Broken(f"returned scores that are not one ({shape[0]}, {vocab_size}) tensor per generated column")
    return tuple(s.float() for s in scores)


def _finish_reasons(
    given: list[str] | None, sequences: torch.Tensor, plan: GenerationPlan, stop_codes: StopCodes
) -> list[str]:
    """The method's reasons (checked), else per row the first stopping criterion that fires on a prefix."""
    if given is not None:
        given = [str(r) for r in given]
        if len(given) != sequences.shape[0] or not set(given) <= set(FINISH_REASONS):
            raise _Broken(f"returned finish_reasons {given[:8]!r}: one per row, each one of {list(FINISH_REASONS)}")
        return given
    names = reason_names()
    # `max_time` is a clock, not a property of a prefix: after a slow method it would claim every row at
    # its first column. The prefixes are scanned without it; it names only rows nothing else ended.
    timers = [c for c in stop_codes.criteria if isinstance(c, MaxTimeCriteria)]
    untimed = StoppingCriteriaList([c for c in stop_codes.criteria if not isinstance(c, MaxTimeCriteria)])
    scan = StopCodes(untimed, plan.eos_token_ids, sequences.device)
    found: list[str | None] = [None] * sequences.shape[0]
    for end in range(plan.input_len + 1, sequences.shape[1] + 1):
        codes = scan(sequences[:, :end], None).tolist()
        for row, code in enumerate(codes):
            if found[row] is None and code:
                found[row] = names[int(code)]
        if all(found):
            break
    for row, reason in enumerate(found):
        if reason is None:
            if any(bool(timer(sequences, None).any()) for timer in timers):
                found[row] = FINISH_TIME
            elif sequences.shape[1] < plan.max_length:
                raise _Broken(f"row {row} stopped with no stopping criterion met: return its finish_reasons")
            else:
                found[row] = FINISH_LENGTH
    return [str(r) for r in found]


@dataclass
class GenerateMethodSteps:
    """
    The target's step iterator for a generate method: its one step runs the whole method, and its
    `StopIteration` carries the `GenerationResult` (the engine drives it like a decoding loop).

    Args:
        run (`Callable[[Callable[[], None]], GenerationResult]`): runs the method with this `check`.
        on_model_thread (`Callable`, *optional*): runs `fn()` on the model thread (the batched
            scheduler's, for the sequential lane); None: the calling thread is the model thread.
        deadline (`float`, *optional*): the caller's deadline on `time.monotonic()`'s clock.
        heartbeat (`Callable[[], None]`, *optional*): called by `check`, so the liveness watchdog sees progress.
    """

    run: Callable[[Callable[[], None]], GenerationResult]
    on_model_thread: Callable[..., Any] | None = None
    deadline: float | None = None
    heartbeat: Callable[[], None] | None = None
    _stopped: threading.Event = field(default_factory=threading.Event)
    _started: bool = False

    def __iter__(self) -> GenerateMethodSteps:
        return self

    def __next__(self) -> Any:
        if self._started:
            raise StopIteration
        self._started = True
        self.check()  # a request cancelled while it waited for the model thread costs nothing
        if self.on_model_thread is None:
            result = self.run(self.check)
        else:
            result = self.on_model_thread(self.run, self.check)
        raise StopIteration(result)

    def check(self) -> None:
        """Raises `GenerationStopped` once the request is cancelled or past its deadline."""
        if self._stopped.is_set():
            raise GenerationStopped("the request was cancelled while its generate method ran")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise GenerationTimedOut("the request's deadline passed while its generate method ran")
        if self.heartbeat is not None:
            self.heartbeat()

    def cancel(self) -> None:
        """The request ended: the method's next `check()` raises (thread-safe, from any thread)."""
        self._stopped.set()

    def close(self) -> None:
        self.cancel()
