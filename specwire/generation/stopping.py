"""Stopping criteria (pure torch), matching transformers 5.23's `stopping_criteria.py`, plus finish reasons.

A criterion maps `(input_ids [rows, cur_len], scores)` to a `BoolTensor [rows]` (True = this row is
done). `StoppingCriteriaList` ORs them and, unlike transformers, can say *why* each row stopped:
`finish_reasons` gives a `FinishReason` per row, the first criterion in list order that fires.
`scores` is the latest step's scores `[rows, vocab]` or a sequence of per-step score tensors (only
`ConfidenceCriteria` reads it).
"""

from __future__ import annotations

import json
import logging
import numbers
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, AnyStr, cast

import torch

from specwire.vocabulary import FinishReason

from .argument_errors import InvalidGenerationArgument
from .processors.base import token_id_list

logger = logging.getLogger(__name__)


class MaxLengthCriteria:
    r"""Stops every row once it holds `max_length` tokens (prompt included).

    Args:
        max_length (`int`):
            Maximum total length.
        max_position_embeddings (`int`, *optional*):
            The model's context size; going past it logs one warning.
    """

    finish_reason = FinishReason.LENGTH
    # Declared here: typeshed does not register `int`/`float` as `numbers.Integral`/`Real`, so mypy reads
    # everything after the isinstance checks in `__init__` as unreachable.
    max_length: int
    max_position_embeddings: int | None
    _warned: bool

    def __init__(self, max_length: int, max_position_embeddings: int | None = None):
        if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) or max_length < 0:
            raise ValueError(f"`max_length` has to be a non-negative integer, but is {max_length!r}.")
        self.max_length = int(max_length)
        self.max_position_embeddings = max_position_embeddings
        self._warned = False

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        done = self.fires_on(input_ids.shape[1])
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    def fires_on(self, cur_len: int, last_token: int | None = None) -> bool:
        """Whether a row of `cur_len` tokens is done (every row is: they all have the same length)."""
        done = cur_len >= self.max_length
        if (
            not done
            and not self._warned
            and self.max_position_embeddings is not None
            and cur_len > self.max_position_embeddings
        ):
            self._warned = True
            logger.warning(
                "Generation passed the model's maximum length (%d tokens); the model may degrade or fail.",
                self.max_position_embeddings,
            )
        return done


class MaxTimeCriteria:
    r"""Stops every row once more than `max_time` seconds have passed since construction.

    Args:
        max_time (`float`):
            Time budget in seconds.
        initial_timestamp (`float`, *optional*):
            Start time (`time.time()` seconds); defaults to now.
    """

    finish_reason = FinishReason.TIME
    # Declared here for mypy (see MaxLengthCriteria).
    max_time: float
    initial_timestamp: float

    def __init__(self, max_time: float, initial_timestamp: float | None = None):
        if isinstance(max_time, bool) or not isinstance(max_time, numbers.Real):
            raise ValueError(f"`max_time` has to be a number of seconds (e.g. 2.5), but is {max_time!r}.")
        self.max_time = float(max_time)
        self.initial_timestamp = time.time() if initial_timestamp is None else initial_timestamp

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        done = time.time() - self.initial_timestamp > self.max_time
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class EosTokenCriteria:
    r"""Stops a row when one of its last `new_token_length` tokens is an EOS id.

    Args:
        eos_token_id (`int`, `list[int]` or `torch.Tensor`):
            The end-of-sequence id(s).
    """

    finish_reason = FinishReason.EOS

    def __init__(self, eos_token_id: int | list[int] | torch.Tensor):
        self.eos_token_id = torch.tensor(token_id_list(eos_token_id, "eos_token_id"), dtype=torch.long)
        self.ids = frozenset(self.eos_token_id.tolist())

    def __call__(
        self, input_ids: torch.Tensor, scores: Any = None, new_token_length: int = 1, **kwargs: Any
    ) -> torch.Tensor:
        """Check the last `new_token_length` tokens of each row (> 1 after an accepted speculative block)."""
        eos = self.eos_token_id.to(input_ids.device)
        return torch.isin(input_ids[:, -new_token_length:], eos).any(dim=-1)

    def fires_on(self, cur_len: int, last_token: int) -> bool:
        """Whether a row ending in `last_token` is done (`new_token_length` 1)."""
        return last_token in self.ids


class ConfidenceCriteria:
    r"""Stops drafting when the draft model's probability of its own last token falls below a threshold.

    transformers checks row 0 only and returns a Python bool; this version checks every row.

    Args:
        assistant_confidence_threshold (`float`):
            Probability threshold in `[0, 1]`.
    """

    # Low confidence ends a draft block, not the request, so it never names a finish reason.
    finish_reason = FinishReason.NONE

    # Declared here for mypy (see MaxLengthCriteria).
    assistant_confidence_threshold: float

    def __init__(self, assistant_confidence_threshold: float):
        value = assistant_confidence_threshold
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 1:
            raise ValueError(f"`assistant_confidence_threshold` has to be a probability in [0, 1], but is {value!r}.")
        self.assistant_confidence_threshold = float(value)

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        if scores is None:
            raise ValueError("ConfidenceCriteria needs the scores of the step that produced the last token.")
        last = scores if isinstance(scores, torch.Tensor) else scores[-1]  # [rows, vocab]
        probs = last.softmax(-1)
        p = probs.gather(-1, input_ids[:, -1:].to(probs.device)).squeeze(-1)  # [rows]
        return (p < self.assistant_confidence_threshold).to(input_ids.device)


# ---------------------------------------------------------------------------------------------------
# Stop strings


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, used by ByteLevel tokenizers to spell raw bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_LEVEL_DECODER = {char: byte for byte, char in _bytes_to_unicode().items()}
_HEX = set("0123456789abcdefABCDEF")


def _decoder_has_type(node: Any, kind: str) -> bool:
    if isinstance(node, dict):
        return node.get("type") == kind or any(_decoder_has_type(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_decoder_has_type(v, kind) for v in node)
    return False


def _matching_mode(tokenizer: Any) -> str | None:
    """`"byte_level"` / `"byte_fallback"` (compare UTF-8 bytes) or `None` (strings), as transformers 5.x."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return None
    if decoder.__class__.__name__ == "ByteLevel":
        return "byte_level"
    state = getattr(decoder, "__getstate__", lambda: None)()
    if isinstance(state, str):
        state = state.encode()
    config = None
    if isinstance(state, bytes):
        try:
            config = json.loads(state)
        except json.JSONDecodeError:
            config = None
    if config is not None:
        # ByteFallback is checked first: a Sequence decoder holding both is a byte-fallback tokenizer.
        if _decoder_has_type(config, "ByteFallback"):
            return "byte_fallback"
        if _decoder_has_type(config, "ByteLevel"):
            return "byte_level"
    return None


def _raw_token_bytes(token: str, mode: str | None) -> bytes | None:
    """The bytes a token spells directly in byte mode, or None when it must be decoded as text."""
    if mode == "byte_level":
        if all(ch in _BYTE_LEVEL_DECODER for ch in token):
            return bytes(_BYTE_LEVEL_DECODER[ch] for ch in token)
        return None
    if mode == "byte_fallback":
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">") and all(c in _HEX for c in token[3:5]):
            return bytes([int(token[3:5], 16)])
    return None


# Stop strings whose reachability was checked, per tokenizer: a bounded LRU, so that a stream of
# requests with ever new stop strings can't grow it without limit.
REACHABLE_CACHE_SIZE = 4096


@dataclass
class _CleanVocab:
    """Per-tokenizer cache: matching mode and each id's clean string (bytes in byte mode; None = no token).

    `reachable` holds the stop strings (in matching form) known to be endable by some token, most
    recently used last, at most `REACHABLE_CACHE_SIZE` of them. `by_first` indexes the clean tokens by
    their first character (byte), built on first use.
    """

    mode: str | None
    size: int
    clean: list[str | bytes | None]
    reachable: OrderedDict[str | bytes, bool] = field(default_factory=OrderedDict)
    by_first: dict[str | bytes, list[str | bytes]] | None = None
    joined: str | bytes | None = None
    # Criteria may be built on several threads (the scheduler's and a lane's): the LRU is locked.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def tokens_starting_with(self, first: str | bytes) -> list[str | bytes]:
        if self.by_first is None:
            index: dict[str | bytes, list[str | bytes]] = {}
            for text in self.clean:
                if text:
                    index.setdefault(text[:1], []).append(text)
            self.by_first = index
        return self.by_first.get(first, [])

    def some_token_contains(self, target: AnyStr) -> bool:
        """Whether `target` occurs inside one token: one C-level search over all tokens, NUL-separated."""
        sep = b"\x00" if isinstance(target, bytes) else "\x00"
        if sep in target:  # could match across the separator: look token by token
            return any(target in t for t in self.clean if t)
        if self.joined is None or type(self.joined) is not type(target):
            self.joined = sep.join(t for t in self.clean if t and type(t) is type(target))
        return target in self.joined

    def known_reachable(self, target: str | bytes) -> bool:
        """Whether `target` is in the LRU (a hit makes it the most recently used)."""
        with self.lock:
            if target not in self.reachable:
                return False
            self.reachable.move_to_end(target)
            return True

    def remember_reachable(self, target: str | bytes) -> None:
        with self.lock:
            self.reachable[target] = True
            self.reachable.move_to_end(target)
            while len(self.reachable) > REACHABLE_CACHE_SIZE:
                self.reachable.popitem(last=False)


_CLEAN_VOCABS: weakref.WeakKeyDictionary[Any, _CleanVocab] = weakref.WeakKeyDictionary()
_STATIC_PREFIX = "abcdef"


def _after_prefix(decoded: str, prefix_text: str) -> str | None:
    """The text a token adds after the static prefix, or None when the prefix can't be found in `decoded`.

    transformers cuts at the first `"abcdef"` in the decoded string; tokenizers whose decoder does not give
    the prefix back verbatim (no decoder: tokens joined with spaces; prefix characters outside the
    vocabulary: unknown tokens) make its `str.index` raise "substring not found". There the token's text
    is what follows the decoded prefix itself.
    """
    at = decoded.find(_STATIC_PREFIX)
    if at >= 0:
        return decoded[at + len(_STATIC_PREFIX) :]
    if decoded.startswith(prefix_text):
        return decoded[len(prefix_text) :]
    return None


def _build_clean_vocab(tokenizer: Any) -> _CleanVocab:
    mode = _matching_mode(tokenizer)
    vocab = tokenizer.get_vocab()
    # A token's text can depend on what precedes it (SentencePiece's leading space), so each token is
    # decoded after a fixed prefix and the prefix's text is cut off; that is transformers' "clean" string.
    prefix_ids = tokenizer(_STATIC_PREFIX, add_special_tokens=False)["input_ids"]
    prefix_tokens = tokenizer.convert_ids_to_tokens(prefix_ids)
    prefix_text = tokenizer.convert_tokens_to_string(prefix_tokens)
    clean: list[str | bytes | None] = [None] * (max(vocab.values()) + 1 if vocab else 0)
    for token, idx in vocab.items():
        text: str | bytes | None = _raw_token_bytes(token, mode)
        if text is None:
            decoded = _after_prefix(tokenizer.convert_tokens_to_string(prefix_tokens + [token]), prefix_text)
            if decoded is None:  # the decoder rewrote the prefix: the token's text on its own
                decoded = tokenizer.convert_tokens_to_string([token])
            text = decoded.encode("utf-8") if mode is not None else decoded
        clean[idx] = text
    return _CleanVocab(mode=mode, size=len(vocab), clean=clean)


def _clean_vocab(tokenizer: Any) -> _CleanVocab:
    """Cached clean vocabulary of `tokenizer` (rebuilt if tokens were added since)."""
    try:
        cached = _CLEAN_VOCABS.get(tokenizer)
    except TypeError:  # not weak-referenceable: no caching
        return _build_clean_vocab(tokenizer)
    if cached is None or cached.size != len(tokenizer.get_vocab()):
        cached = _build_clean_vocab(tokenizer)
        _CLEAN_VOCABS[tokenizer] = cached
    return cached


def _end_overlaps(last: AnyStr, stop: AnyStr) -> set[int]:
    """How many characters of `stop` (counted from its end) the final token can cover.

    The final token may start inside `stop` (its first k characters equal the last k of `stop`,
    the rest overhanging past the end), or contain all of `stop` anywhere (counts as `len(stop)`).
    """
    n = len(stop)
    covers = {k for k in range(1, min(len(last), n - 1) + 1) if last[:k] == stop[n - k :]}
    if stop in last:
        covers.add(n)
    return covers


def _fits_before(token: str | bytes, stop: str | bytes, covered: int) -> bool:
    """Whether `token` can precede the `covered` last characters of `stop` (it may overhang off the start)."""
    end = len(stop) - covered
    if len(token) <= end:
        return stop[end - len(token) : end] == token
    return token[len(token) - end :] == stop[:end]


class StopStringCriteria:
    r"""Stops a row when a stop string appears in its text and overlaps the final token.

    A stop string may start in earlier tokens and may end inside (or exactly at the end of) the last
    token; a stop string that ended before the last token does not fire again. Tokens are compared
    through their "clean" strings (each decoded after a fixed prefix); for byte-level BPE and
    byte-fallback tokenizers the comparison is over UTF-8 bytes, so a stop string whose character is
    split across tokens still matches (transformers 5.x behaviour). Only the last `max(len(stop))`
    tokens are examined, as in transformers.

    Args:
        tokenizer (`PreTrainedTokenizerBase`):
            The model's tokenizer; its clean vocabulary is computed once and cached.
        stop_strings (`str` or `list[str]`):
            The stop string(s). An empty stop string matches at every step.
    """

    finish_reason = FinishReason.STOP_STRING

    def __init__(self, tokenizer: Any, stop_strings: str | Sequence[str]):
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        if (
            not isinstance(stop_strings, Sequence)
            or not stop_strings
            or not all(isinstance(s, str) for s in stop_strings)
        ):
            raise InvalidGenerationArgument.for_field(
                "stop_strings",
                stop_strings,
                f"`stop_strings` has to be a string or a non-empty list of strings, but is {stop_strings!r}.",
            )
        self.stop_strings: tuple[str, ...] = tuple(stop_strings)
        self._vocab = _clean_vocab(tokenizer)
        mode = self._vocab.mode
        self._targets: tuple[str | bytes, ...] = tuple(
            s.encode("utf-8") if mode is not None else s for s in self.stop_strings
        )
        self._always = any(len(t) == 0 for t in self._targets)
        self._window = max(len(t) for t in self._targets)
        self._check_reachable()

    def _can_end(self, target: str | bytes) -> bool:
        """Whether some token can be the final token of a match of `target` (see `_end_overlaps`)."""
        vocab = self._vocab
        n = len(target)
        # A token covering the last k characters starts with target[n - k]: look only at those tokens,
        # shortest tails first (the likeliest to be covered).
        for start in range(n - 1, 0, -1):
            tail = target[start:]
            if any(t[: len(tail)] == tail for t in vocab.tokens_starting_with(target[start : start + 1])):
                return True
        # The vocabulary's mode makes every target and token the same one of str/bytes.
        return vocab.some_token_contains(cast(Any, target))

    def _check_reachable(self) -> None:
        vocab = self._vocab
        if self._always and any(vocab.clean):
            return
        # Any one endable stop string can fire, as in transformers (the set is refused only when none can).
        for target in self._targets:
            if vocab.known_reachable(target):
                return
        for target in self._targets:
            if self._can_end(target):
                vocab.remember_reachable(target)
                return
        raise InvalidGenerationArgument.for_field(
            "stop_strings",
            list(self.stop_strings),
            "no token of the vocabulary can end any of these stop strings; they probably contain characters "
            "the tokenizer can't produce. Check them or drop them.",
        )

    def _row_matches(self, ids: list[int]) -> bool:
        clean = self._vocab.clean
        size = len(clean)
        tokens = [clean[i] if 0 <= i < size else None for i in reversed(ids)]  # last token first
        last = tokens[0] if tokens else None
        if last is None:
            return False
        for target in self._targets:
            n = len(target)
            for covered in _end_overlaps(cast(Any, last), target):  # same type (the vocabulary's mode)
                for token in tokens[1:]:
                    if covered >= n or token is None or not _fits_before(token, target, covered):
                        break
                    covered += len(token)
                if covered >= n:
                    return True
        return False

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        rows = input_ids.shape[0]
        if self._always:
            return torch.ones((rows,), dtype=torch.bool, device=input_ids.device)
        window = input_ids[:, -self._window :].tolist()
        done = [self._row_matches(row) for row in window]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


# ---------------------------------------------------------------------------------------------------
# The list and the factory


class StoppingCriteriaList(list[Any]):
    """Criteria applied together: a row is done when any criterion says so."""

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        """OR of every criterion.

        Args:
            input_ids (`torch.LongTensor` of shape `(rows, cur_len)`):
                The tokens so far.
            scores (`torch.FloatTensor` of shape `(rows, vocab)` or a sequence of them, *optional*):
                The latest step's scores (only some criteria read them).
            kwargs:
                Passed to every criterion (e.g. `new_token_length` for the EOS criterion).

        Returns:
            `torch.BoolTensor` of shape `(rows,)`.
        """
        done = torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)
        for criterion in self:
            done = done | criterion(input_ids, scores, **kwargs)
        return done

    def finish_reasons(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        """Why each row is done: the `FinishReason` of the first criterion (in list order) that fires.

        Criteria without a reason (`FinishReason.NONE`, e.g. `ConfidenceCriteria`, or custom ones without a
        `finish_reason` attribute) never claim a row.

        Args:
            input_ids (`torch.LongTensor` of shape `(rows, cur_len)`):
                The tokens so far.
            scores (`torch.FloatTensor` or a sequence of them, *optional*):
                The latest step's scores.
            kwargs:
                Passed to every criterion.

        Returns:
            `torch.LongTensor` of shape `(rows,)`: `FinishReason` codes, `NONE` (0) for running rows.
        """
        reasons = torch.zeros((input_ids.shape[0],), dtype=torch.long, device=input_ids.device)
        for criterion in self:
            reason = int(getattr(criterion, "finish_reason", FinishReason.NONE))
            if reason == FinishReason.NONE:
                continue
            fired = criterion(input_ids, scores, **kwargs)
            reasons = torch.where((reasons == FinishReason.NONE) & fired, reason, reasons)
        return reasons

    @property
    def decides_by_last_token(self) -> bool:
        """Whether every criterion that names a finish reason is a length limit or EOS ids (a request's usual
        list): `finish_reason_by_last_token` then gives `finish_reasons`' code of a row from its length and last
        token, in Python, without the small tensor ops a decoding step would pay for them."""
        return all(
            type(criterion) in _DECIDED_BY_LAST_TOKEN
            for criterion in self
            if getattr(criterion, "finish_reason", FinishReason.NONE) != FinishReason.NONE
        )

    def finish_reason_by_last_token(self, cur_len: int, last_token: int) -> int:
        """`finish_reasons`' code of a row of `cur_len` tokens ending in `last_token`, for a list that
        `decides_by_last_token`: the first criterion in list order that fires, `NONE` (0) for a running row."""
        for criterion in self:
            reason = int(getattr(criterion, "finish_reason", FinishReason.NONE))
            if reason != FinishReason.NONE and criterion.fires_on(cur_len, last_token):
                return reason
        return int(FinishReason.NONE)

    @property
    def max_length(self) -> int | None:
        """The `max_length` of the first `MaxLengthCriteria`, or None."""
        for criterion in self:
            if isinstance(criterion, MaxLengthCriteria):
                return criterion.max_length
        return None


# The criteria `StoppingCriteriaList.finish_reason_by_last_token` decides for (exactly these types: a subclass may
# change what `__call__` does).
_DECIDED_BY_LAST_TOKEN = (MaxLengthCriteria, EosTokenCriteria)


def build_stopping_criteria(
    config: Any,
    *,
    max_length: int | None,
    eos_token_ids: int | Sequence[int] | torch.Tensor | None,
    tokenizer: Any = None,
    max_position_embeddings: int | None = None,
    is_assistant: bool = False,
    user_criteria: Sequence[Any] = (),
) -> StoppingCriteriaList:
    r"""Build a request's stopping criteria in transformers' order: MaxLength, MaxTime, StopString, EOS.

    Args:
        config (`GenerationConfig`):
            Our config (defaults applied); reads `max_time`, `stop_strings` and, for drafts,
            `assistant_confidence_threshold`.
        max_length (`int` or `None`):
            Resolved maximum total length (prompt + new tokens); `None` adds no length criterion.
        eos_token_ids (`int`, `Sequence[int]`, `torch.Tensor` or `None`):
            The end-of-sequence id(s); `None` or empty adds no EOS criterion.
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            Required when `stop_strings` is set.
        max_position_embeddings (`int`, *optional*):
            The model's context size, for the length criterion's warning.
        is_assistant (`bool`, *optional*, defaults to `False`):
            Building for a draft model: appends `ConfidenceCriteria` when
            `assistant_confidence_threshold > 0` (transformers' `is_assistant` rule).
        user_criteria (`Sequence[StoppingCriteria]`, *optional*):
            A user's `stopping_criteria` list (server plugins), appended last as transformers merges it.

    Returns:
        `StoppingCriteriaList`.

    Raises:
        ValueError: stop strings without a tokenizer, or a bad value.
    """
    criteria = StoppingCriteriaList()
    if max_length is not None:
        criteria.append(MaxLengthCriteria(max_length, max_position_embeddings=max_position_embeddings))
    max_time = getattr(config, "max_time", None)
    if max_time is not None:
        criteria.append(MaxTimeCriteria(max_time))
    stop_strings = getattr(config, "stop_strings", None)
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError(
                "`stop_strings` is set but no tokenizer was given; stop strings are matched on decoded tokens, so pass "
                "the model's tokenizer (or drop `stop_strings`)."
            )
        criteria.append(StopStringCriteria(tokenizer, stop_strings))
    if eos_token_ids is not None:
        eos = token_id_list(eos_token_ids, "eos_token_id")
        if eos:
            criteria.append(EosTokenCriteria(eos))
    threshold = getattr(config, "assistant_confidence_threshold", None)
    if is_assistant and threshold is not None and threshold > 0:
        criteria.append(ConfidenceCriteria(threshold))
    criteria.extend(user_criteria)
    return criteria
