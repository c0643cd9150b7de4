"""Drafters: per-request sessions that propose speculative tokens for every row.

A drafter is the state one generation request keeps on the draft side: each row's tokens so far
and, for a draft model, each row's KV cache. The target drives it in rounds:

1. `propose(num_tokens)` returns up to `num_tokens` draft tokens per row (fewer when the draft
   stops early: an EOS, the confidence threshold, or no prompt-lookup match), plus the draft's
   probabilities of them when the target samples (rejection sampling needs `q`).
2. The target verifies; `feedback(num_accepted, appended)` tells the drafter, per row, how many
   of its tokens were accepted and which tokens the target appended after them (the correction or
   bonus token). The drafter rolls its cache back to the accepted prefix; it never re-encodes it.

Rows are independent: each accepts its own number of tokens (batch > 1, `num_return_sequences` > 1).
The draft service serves these sessions over a gRPC stream; the target can also run them in-process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import torch

from specwire.generation.rows import accepts_argument
from specwire.generation.sampling import greedy_tokens
from specwire.generation.speculation.prompt_lookup import (
    BannedFn,
    SuffixMatcher,
    banned_fn_from_processors,
    prompt_lookup_candidates,
)
from specwire.generation.speculation.schedules import ConfidenceStop

if TYPE_CHECKING:
    from specwire.generation.processors.base import LogitsProcessorList

__all__ = [
    "PROMPT_LOOKUP_RULES",
    "DraftFailure",
    "DraftForward",
    "ForwardRunner",
    "Drafter",
    "Hindsight",
    "ModelDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "open_model_drafter",
]


# A draft model's forward over one row's cache, `(model, cache, new_tokens, past, keep, device)`: the logits of
# (at least) the last `keep` new tokens, `[1, n, vocab]`, or None where the model's own forward must run. The
# services pass `specwire.runtime.lean_draft.lean_draft_forward` (the pure core does not import the runtime).
DraftForward = Callable[[Any, Any, list[int], int, int, Any], "torch.Tensor | None"]
# `run(fn, *args)`: runs `fn(*args)` on the thread that runs the target's forwards and returns its result
# (`BatchScheduler.forward`).
ForwardRunner = Callable[..., Any]


class DraftFailure(RuntimeError):
    """The drafter cannot continue (unreachable, past its deadline, or its stream died)."""


@dataclass
class Proposal:
    """One block of draft tokens.

    Args:
        tokens (`list[list[int]]`): per row, the proposed tokens (possibly none).
        probs (`list[torch.Tensor | None]`): per row, the draft's processed probabilities of shape
            `(len(tokens[row]), vocab)` when the session returns them, else `None`.
        hindsight (`list[Hindsight]`, *optional*): per row, what the draft's guesses of the target's tokens
            it caught up on since the last proposal (the controller's time off) say; None from a drafter that
            does not report it.
        ahead_hit (`bool`, *optional*, defaults to `False`): the proposal came from blocks drafted ahead while the
            target verified (a remote draft service's overlap, `draft_ahead`), none discarded: the target waited
            only for what drafting ahead had not finished. The speculation controller prices such rounds apart.
    """

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]
    hindsight: list[Hindsight] | None = None
    ahead_hit: bool = False


class Hindsight(NamedTuple):
    """Of the target's tokens a draft caught up on without having drafted before them: how many it `checked`,
    how often it was sure enough to go on drafting after its guess (`confident`: its confidence threshold),
    and how many of those sure guesses were right (`kept`: its greedy token given the same prefix is the
    target's, a draft it would have had kept and gone on after). `kept / confident`, not the share of right
    guesses, is the acceptance a block sees: the draft is sure where it is right, and stops where it is not
    (SmolLM2's int8 draft on the chat answer: 12 of 14 right and 12 sure, all of them right). Read from
    the draft's raw logits, without the request's processors, in one forward over all the tokens: a draft
    quantized dynamically (`default-int8`) scales its activations over that forward, so a guess can differ from
    the one token-by-token drafting makes (SmolLM2's int8 draft: 8 of 14 against 5 on the code edit's first
    tokens). Evidence of what drafting would have had, for the speculation controller, never for output."""

    checked: int = 0
    kept: int = 0
    confident: int = 0

    def __add__(self, other: object) -> Hindsight:
        assert isinstance(other, Hindsight)
        return Hindsight(*(a + b for a, b in zip(self, other, strict=True)))


class Drafter(Protocol):
    """A per-request drafting session (in-process or behind the draft service).

    `close()` releases what the session holds (a draft-service stream, KV caches). The decoding loop
    calls it on every way out (finish, error, the caller closing the loop on cancel or deadline), and
    again is harmless: it must be idempotent and must not block.
    """

    def propose(self, num_tokens: int) -> Proposal: ...

    def feedback(self, num_accepted: list[int], appended: list[list[int]], finished: list[bool]) -> None: ...

    def close(self) -> None: ...


def _eos_list(config: Any) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _draft_processors(config: Any, prompt: list[int], vocab_size: int, model: Any = None) -> LogitsProcessorList:
    """The request's logits processors as the draft applies them.

    Like transformers' assistant, the draft uses the target's processors except the length ones
    (min length is the target's business: a draft that may stop early only loses acceptance), and
    without classifier-free guidance (it would need the target's unconditional pass).
    """
    from specwire.generation.processors import build_logits_processors

    draft_config = dataclasses.replace(
        config.with_defaults() if hasattr(config, "with_defaults") else config,
        min_length=0,
        min_new_tokens=None,
        guidance_scale=None,
        forced_eos_token_id=None,
    )
    return build_logits_processors(
        draft_config,
        input_len=len(prompt),
        vocab_size=vocab_size,
        eos_token_ids=_eos_list(draft_config) or None,
        num_beams=1,
        prompt_ids=torch.tensor([prompt], dtype=torch.long),
        model=model,
    )


PROMPT_LOOKUP_RULES = ("longest", "transformers")


class PromptLookupDrafter:
    """Prompt lookup, per row (see `prompt_lookup`).

    Args:
        rows (`list[list[int]]`): each row's tokens so far (prompt without padding).
        config (`GenerationConfig`): the request's effective config (`max_matching_ngram_size`,
            `eos_token_id`, and the processors used for transformers' banned-token check).
        vocab_size (`int`): the target model's vocabulary size.
        rule (`str`, defaults to `"longest"`): `"longest"`, specwire's rule (`SuffixMatcher`: the
            longest suffix match of at least 2 tokens, or 1 when `max_matching_ngram_size=1`), or
            `"transformers"`, transformers' exact candidate rule. Proposals of either rule are cut
            before the first token the request's processors ban and before the first EOS.
    """

    def __init__(self, rows: list[list[int]], config: Any, vocab_size: int, rule: str = "longest"):
        if rule not in PROMPT_LOOKUP_RULES:
            raise ValueError(f"rule must be one of {PROMPT_LOOKUP_RULES}, got {rule!r}")
        self.rule = rule
        self.finished = [False] * len(rows)
        self.ngram = config.max_matching_ngram_size
        self.eos = _eos_list(config)
        # An empty processor list never bans a token: skip transformers' check for it.
        processors = [p if len(p) else None for p in (_draft_processors(config, r, vocab_size) for r in rows)]
        self.banned_fn = banned_fn_from_processors(processors, vocab_size)
        self.checks = [p is not None for p in processors]
        # Each row's tokens so far live in its matcher (`.tokens`), kept in step by `feedback`.
        self.matchers = [SuffixMatcher(r, min_match=min(self.ngram or 2, 2)) for r in rows]
        self._last: list[list[int]] = [[] for _ in rows]

    def propose(self, num_tokens: int) -> Proposal:
        tokens: list[list[int]] = []
        for i, matcher in enumerate(self.matchers):
            row = matcher.tokens
            if self.finished[i] or num_tokens <= 0:
                tokens.append([])
            elif self.rule == "longest":
                tokens.append(self._checked(i, matcher.propose(num_tokens)))
            else:
                candidates, lengths = prompt_lookup_candidates(
                    torch.tensor([row], dtype=torch.long),
                    num_tokens,
                    # The target bounds the draft length by its own max_length; no second bound here.
                    max_length=len(row) + num_tokens + 1,
                    max_matching_ngram_size=self.ngram,
                    eos_token_ids=self.eos or None,
                    banned_fn=cast(BannedFn, lambda _row, prefix, cand, i=i: self.banned_fn(i, prefix, cand)),
                )
                tokens.append(candidates[0, : int(lengths[0])].tolist())
        self._last = tokens
        return Proposal(tokens, [None] * len(tokens))

    def _checked(self, i: int, proposal: list[int]) -> list[int]:
        """`proposal` cut before its first banned token, then before its first EOS."""
        if proposal and self.checks[i]:
            banned = self.banned_fn(i, torch.tensor(self.matchers[i].tokens), torch.tensor(proposal)).nonzero()
            if banned.numel():
                proposal = proposal[: int(banned[0, 0])]
        for position, token in enumerate(proposal):
            if token in self.eos:
                return proposal[:position]
        return proposal

    def feedback(self, num_accepted: list[int], appended: list[list[int]], finished: list[bool]) -> None:
        for i, (n, extra) in enumerate(zip(num_accepted, appended, strict=True)):
            self.matchers[i].extend(self._last[i][:n] + list(extra))
            self.finished[i] = self.finished[i] or finished[i]

    def close(self) -> None:
        self.matchers = []


class _RowCache:
    """One row's draft state: tokens so far, and how many of them the KV cache holds."""

    def __init__(self, tokens: list[int], cache: Any):
        self.tokens = tokens
        self.cache = cache
        self.cached = 0  # tokens[:cached] are in the cache
        self.drafted: list[int] = []
        # tokens[checked_from:] were emitted by the target with no block of this session before them (time off),
        # so the draft's guess of each is a fair check; `hindsight` counts the checks since the last proposal.
        self.checked_from = len(tokens)
        self.hindsight = Hindsight()


class ModelDrafter:
    """Drafts with a causal LM, one KV cache per row, rolled back to the accepted prefix each round.

    Args:
        model (`PreTrainedModel`): the draft model; it must share the target's tokenizer.
        rows (`list[list[int]]`): each row's tokens so far (prompt without padding).
        config (`GenerationConfig`): the request's effective config: `do_sample`, the processors and
            warpers, `assistant_confidence_threshold`, `eos_token_id`.
        vocab_size (`int`): the target's vocabulary size (draft probabilities are cut or padded to it).
        return_probs (`bool`): return the draft's probabilities (the target samples).
        generator (`torch.Generator`, *optional*): randomness of the draft's own sampling.
        forward (`DraftForward`, *optional*): a faster forward of the same logits (the services' lean one).
        run_forward (`ForwardRunner`, *optional*): where the draft's forwards run (a co-located draft: the thread of
            the target's forwards, with the process's torch threads); the calling thread without it.
    """

    def __init__(
        self,
        model: Any,
        rows: list[list[int]],
        config: Any,
        vocab_size: int,
        return_probs: bool = False,
        generator: torch.Generator | None = None,
        forward: DraftForward | None = None,
        run_forward: ForwardRunner | None = None,
    ):
        from transformers import DynamicCache

        self.model = model
        self.forward = forward
        self.run_forward = run_forward
        self.vocab_size = vocab_size
        self.do_sample = bool(config.do_sample)
        self.return_probs = return_probs
        self.generator = generator
        self.eos = set(_eos_list(config))
        self.confidence = ConfidenceStop.from_config(config)
        self.processors = [_draft_processors(config, r, vocab_size) for r in rows]
        self.device = next(model.parameters()).device
        text_config = model.config.get_text_config(decoder=True)
        self.rows = [_RowCache(list(r), DynamicCache(config=text_config)) for r in rows]
        self.finished = [False] * len(rows)
        # Only the last position's logits are read: a catch-up over a 400-token prompt would otherwise run
        # the LM head (the vocabulary wide) 400 times.
        self._last_logits = {"logits_to_keep": 1} if accepts_argument(model, "logits_to_keep") else {}

    def _next_scores(self, row: _RowCache, new_tokens: list[int]) -> torch.Tensor:
        """Run `new_tokens` through the row's cache: the scores of the token after them `[1, draft_vocab]`.

        Greedy, the positions before tokens of the target's time off (`_RowCache.checked_from`) keep their
        logits too, and their argmax is checked against those tokens (`Proposal.hindsight`).
        """
        start, end = row.cached, row.cached + len(new_tokens) - 1  # the positions this forward computes
        first = max(row.checked_from, start + 1)  # position p guesses token p + 1: the first token checked
        checks = 0 if self.do_sample else max(min(len(row.tokens), end + 2) - first, 0)
        all_logits = self._forward(row, new_tokens, checks + 1)
        row.cached += len(new_tokens)
        if checks:
            offset = first - 1 - (end - all_logits.shape[1] + 1)  # the logits of position first - 1
            logits = all_logits[0, offset : offset + checks].float()
            guessed = greedy_tokens(logits)
            right = guessed == torch.tensor(row.tokens[first : first + checks], device=guessed.device)
            sure = ~self.confidence(guessed, logits) if self.confidence.enabled else torch.ones_like(right)
            row.hindsight += Hindsight(checks, int((right & sure).sum()), int(sure.sum()))
        return all_logits[:, -1, :].float()  # [1, draft_vocab]

    def _forward(self, row: _RowCache, new_tokens: list[int], keep: int) -> torch.Tensor:
        """The logits of (at least) the last `keep` of `new_tokens` run through the row's cache, `[1, n, draft_vocab]`,
        on the thread `run_forward` says (the calling thread without it)."""
        if self.run_forward is not None:
            return cast(torch.Tensor, self.run_forward(self._logits, row, new_tokens, keep))
        return self._logits(row, new_tokens, keep)

    def _logits(self, row: _RowCache, new_tokens: list[int], keep: int) -> torch.Tensor:
        """`_forward`'s logits, through the `forward` given (a lean one, `DraftForward`) where it answers, else the
        model's own."""
        if self.forward is not None:
            logits = self.forward(self.model, row.cache, new_tokens, row.cached, keep, self.device)
            if logits is not None:
                return logits
        kept = {"logits_to_keep": keep} if self._last_logits else {}
        ids = torch.tensor([new_tokens], dtype=torch.long, device=self.device)
        return cast(torch.Tensor, self.model(input_ids=ids, past_key_values=row.cache, use_cache=True, **kept).logits)

    def _fit_vocab(self, scores: torch.Tensor) -> torch.Tensor:
        # A draft's head may be wider or narrower than the target's vocabulary (padding rows).
        width = scores.shape[-1]
        if width > self.vocab_size:
            return scores[:, : self.vocab_size]
        if width < self.vocab_size:
            pad = torch.full((1, self.vocab_size - width), float("-inf"), device=scores.device)
            return torch.cat([scores, pad], dim=-1)
        return scores

    @torch.inference_mode()
    def propose(self, num_tokens: int) -> Proposal:
        """Up to `num_tokens` drafts per row; asked for none, the draft only catches up (`look_back`)."""
        if num_tokens <= 0:
            return self.look_back()
        tokens: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for i, row in enumerate(self.rows):
            drafted: list[int] = []
            row_probs: list[torch.Tensor] = []
            if not self.finished[i]:
                drafted, row_probs, _ = self._extend(i, row.tokens, num_tokens)
            row.drafted = drafted
            tokens.append(drafted)
            probs.append(self._stacked(row_probs))
        return Proposal(tokens, probs, self._hindsight())

    @torch.inference_mode()
    def look_back(self) -> Proposal:
        """No drafts: each row's cache catches up on the tokens it lacks but the last (the next forward's
        input), and reports how many of them it would have drafted (`Proposal.hindsight`): a cheap probe of
        whether drafting would pay again, for the price of a prefill.

        A look-back on just the context the session opened on (a draft service prefilling the prompt while the
        target does: `RemoteDrafter.prefill`) takes all of it, the last token too, so that the target's tokens come
        in later forwards of their own, as they do in a session opened after them. With a dynamically quantized
        draft (`default-int8`: each forward's activations share one scale) how the tokens are grouped into forwards
        changes what the draft predicts: with the prompt's last token in the forward of the answer's first tokens,
        SmolLM2's int8 draft was sure of wrong tokens (chat, a pinned remote target: 2 of 6 drafts kept where a
        session opened after the first token kept 106 of 111)."""
        for i, row in enumerate(self.rows):
            row.drafted = []
            opening = row.cached == 0 and len(row.tokens) == row.checked_from
            end = len(row.tokens) if opening else len(row.tokens) - 1
            if not self.finished[i] and end > row.cached:
                self._next_scores(row, row.tokens[row.cached : end])
        return Proposal([[] for _ in self.rows], [None] * len(self.rows), self._hindsight())

    def _hindsight(self) -> list[Hindsight]:
        """Each row's hindsight since the last proposal, then reset."""
        out = [row.hindsight for row in self.rows]
        for row in self.rows:
            row.hindsight = Hindsight()
        return out

    def _stacked(self, row_probs: list[torch.Tensor]) -> torch.Tensor | None:
        return torch.stack(row_probs).cpu() if row_probs and self.return_probs else None

    def _uncached(self, row: _RowCache, base: list[int]) -> list[int]:
        """The tokens of `base` the row's cache lacks: at least the last one (its logits are needed)."""
        if row.cached >= len(base):
            self._crop(row, len(base) - 1)
        return base[row.cached :]

    @staticmethod
    def _crop(row: _RowCache, keep: int) -> None:
        if row.cached > keep:
            row.cache.crop(keep - row.cached)  # transformers 5 crops by a negative count
            row.cached = keep

    def _processed(self, i: int, base: list[int]) -> torch.Tensor:
        """Row `i`'s processed draft scores of the token after `base` (the cache holds a prefix of it)."""
        row = self.rows[i]
        scores = self._fit_vocab(self._next_scores(row, self._uncached(row, base)))
        context = torch.tensor([base], dtype=torch.long, device=self.device)
        return self.processors[i](context, scores)  # [1, vocab]

    def _extend(
        self,
        i: int,
        base: list[int],
        num_tokens: int,
        should_stop: Any = None,
        states: list[torch.Tensor] | None = None,
    ) -> tuple[list[int], list[torch.Tensor], bool]:
        """Draft up to `num_tokens` tokens after `base` for row `i`, one forward each.

        Args:
            i (`int`): the row.
            base (`list[int]`): the tokens the draft continues (the row's cache holds a prefix of them).
            num_tokens (`int`): the most tokens to draft.
            should_stop (`Callable[[], bool]`, *optional*): asked before every forward; `True` ends the
                drafting there (drafting ahead gives way to real work).
            states (`list[torch.Tensor]`, *optional*): receives the generator's state after each token.

        Returns:
            `tuple`: the drafted tokens, their probabilities (when sampling or returning them), and
            whether the draft ended by itself (an EOS or the confidence threshold) rather than by the count.
        """
        drafted: list[int] = []
        row_probs: list[torch.Tensor] = []
        for _ in range(num_tokens):
            if should_stop is not None and should_stop():
                return drafted, row_probs, False
            scores = self._processed(i, base + drafted)
            if self.do_sample:
                q = scores.softmax(-1)
                token = int(torch.multinomial(q, 1, generator=self.generator))
                row_probs.append(q[0])
            else:
                token = int(greedy_tokens(scores))
                if self.return_probs:
                    row_probs.append(scores.softmax(-1)[0])
            if states is not None and self.generator is not None:
                states.append(self.generator.get_state())
            drafted.append(token)
            if token in self.eos or self._unsure(token, scores):
                return drafted, row_probs, True
        return drafted, row_probs, False

    def _unsure(self, token: int, scores: torch.Tensor) -> bool:
        """Whether the draft's confidence in the token it just drafted is below the threshold."""
        return bool(self.confidence(torch.tensor([token], device=scores.device), scores)[0])

    def feedback(self, num_accepted: list[int], appended: list[list[int]], finished: list[bool]) -> None:
        for i, (n, extra) in enumerate(zip(num_accepted, appended, strict=True)):
            self._feedback_row(i, n, extra, finished[i])

    def _feedback_row(self, i: int, num_accepted: int, appended: list[int], finished: bool) -> None:
        row = self.rows[i]
        kept = len(row.tokens) + num_accepted
        row.tokens += row.drafted[:num_accepted] + list(appended)
        if row.drafted:
            # The token after the kept drafts answers the block: not a fair check of the draft. Any after it
            # (feedback of several rounds at once: a remote drafter's time off) are.
            row.checked_from = kept + 1
        # The cache holds the old tokens plus drafted tokens; keep the accepted ones.
        self._crop(row, kept)
        row.drafted = []
        self.finished[i] = self.finished[i] or finished

    def close(self) -> None:
        self.rows = []


def open_model_drafter(
    model: Any,
    rows: list[list[int]],
    config: Any,
    vocab_size: int,
    return_probs: bool,
    overlap: bool = False,
    forward: DraftForward | None = None,
    run_forward: ForwardRunner | None = None,
) -> ModelDrafter:
    """A `ModelDrafter` with its own random stream when the request samples.

    Shared by the draft service (one per stream) and the target's co-located draft (`--draft-model`).

    Args:
        model (`PreTrainedModel`): the draft model.
        rows (`list[list[int]]`): each row's tokens so far.
        config (`GenerationConfig`): the request's effective config (`do_sample`, `seed`, processors).
        vocab_size (`int`): the target's vocabulary size.
        return_probs (`bool`): return the draft's probabilities (the target samples, or mixes an ensemble).
        overlap (`bool`, defaults to `False`): an `OverlappingModelDrafter`, which can draft the next block
            ahead while the target verifies (the draft service's `DraftStart.overlap`).
        forward (`DraftForward`, *optional*), run_forward (`ForwardRunner`, *optional*): as for `ModelDrafter`.
    """
    generator = None
    if config.do_sample:
        # The session's own generator: seeding torch's global one (`torch.seed()`) would change the
        # random stream of everything else in the process, other sessions included.
        generator = torch.Generator(device=next(model.parameters()).device)
        if config.seed is not None:
            generator.manual_seed(config.seed)
        else:
            generator.seed()
    if overlap:
        # Imported here: draft_ahead builds on this module.
        from specwire.generation.speculation.draft_ahead import OverlappingModelDrafter

        return OverlappingModelDrafter(model, rows, config, vocab_size, return_probs, generator, forward, run_forward)
    return ModelDrafter(model, rows, config, vocab_size, return_probs, generator, forward, run_forward)
