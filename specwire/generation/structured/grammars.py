"""The grammar library behind structured output (llguidance), behind a small interface.

Nothing else in specwire imports llguidance: swapping the library means rewriting this module. Two
caches keep requests cheap: a tokenizer's grammar vocabulary (~0.25 s to build for SmolLM2's 49,152
tokens) is built once per tokenizer, vocabulary width and EOS ids; a compiled grammar (an llguidance
matcher in its start state; compiling is well under a millisecond, its lexer and parser tables fill
in lazily as masks are computed) is kept per distinct spec in a bounded LRU, and every request starts
from a copy of it.

Why llguidance: see `bench/structured_libraries.py` (sub-millisecond compiles for schemas where
xgrammar and outlines-core take ~200 ms, a per-token mask of a few microseconds, all four spec kinds,
no dependencies).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import llguidance
import llguidance.hf

from specwire.generation.argument_errors import InvalidGenerationArgument

from .spec import StructuredOutput

if TYPE_CHECKING:  # a TypedDict of the stubs only
    from llguidance._lib import JsonCompileOptions

__all__ = ["CACHE_SIZE", "JSON_DEFAULTS", "CompiledGrammar", "compile_structured_output"]

# llguidance's JSON options that a schema's own "x-guidance" object may override.
JSON_DEFAULTS: Final[JsonCompileOptions] = {"whitespace_flexible": False}
# Distinct specs kept compiled per tokenizer vocabulary; a matcher in its start state is small.
CACHE_SIZE = 256


class CompiledGrammar:
    """
    A spec compiled for one tokenizer: the start state every request copies.

    Args:
        spec (`StructuredOutput`): what was compiled.
        matcher (`llguidance.LLMatcher`): the matcher in its start state (never advanced itself).
        vocab_size (`int`): the width of the masks (the model's logits).
    """

    def __init__(self, spec: StructuredOutput, matcher: Any, vocab_size: int):
        self.spec = spec
        self._start = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32

    def start(self) -> Any:
        """A fresh matcher in the start state (a copy: matchers are advanced in place)."""
        return self._start.deep_copy()


def _grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a spec."""
    M = llguidance.LLMatcher
    if spec.kind == "json_schema":
        try:
            # Compact JSON (no whitespace between tokens) unless the schema's "x-guidance" says otherwise:
            # with flexible whitespace a weak model can pad with newlines until max_length.
            return str(M.grammar_from_json_schema(str(spec.value), defaults=JSON_DEFAULTS))
        except ValueError as error:
            raise InvalidGenerationArgument.for_field(
                spec.field, spec.value, f"{error}; send a JSON Schema object"
            ) from None
    if spec.kind == "regex":
        return str(M.grammar_from_regex(str(spec.value)))
    if spec.kind == "grammar":
        return str(M.grammar_from_lark(str(spec.value)))
    # Choices: a Lark alternation of string literals (JSON string syntax escapes any text).
    alternatives = " | ".join(json.dumps(choice) for choice in spec.value)
    return str(M.grammar_from_lark(f"start: {alternatives}\n"))


class _Entry:
    """One grammar vocabulary and its compiled grammars (LRU-bounded)."""

    def __init__(self, vocabulary: Any):
        self.vocabulary = vocabulary
        self.compiled: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()


class _Vocabularies:
    """Grammar vocabularies per tokenizer object (weakly held) and per (vocabulary width, EOS ids)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], _Entry]]
        self._entries = weakref.WeakKeyDictionary()

    def entry(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> _Entry:
        key = (vocab_size, tuple(eos_token_ids))
        with self._lock:
            known = self._entries.setdefault(tokenizer, {})
            if key not in known:
                try:
                    vocabulary = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(key[1]))
                except ValueError as error:  # a slow (Python) tokenizer
                    raise InvalidGenerationArgument.for_field(
                        "structured_output", type(tokenizer).__name__, f"this model's tokenizer cannot be used: {error}"
                    ) from None
                known[key] = _Entry(vocabulary)
            return known[key]

    def compiled(self, entry: _Entry, spec: StructuredOutput, vocab_size: int) -> CompiledGrammar:
        with self._lock:
            found = entry.compiled.get(spec)
            if found is not None:
                entry.compiled.move_to_end(spec)
                return found
        # Compiled outside the lock (llguidance drops the GIL); two threads may compile one spec twice.
        matcher = llguidance.LLMatcher(entry.vocabulary, _grammar_text(spec), log_level=0)
        if matcher.is_error():
            value = list(spec.value) if isinstance(spec.value, tuple) else spec.value
            raise InvalidGenerationArgument.for_field(spec.field, value, _fix(spec, matcher.get_error()))
        compiled = CompiledGrammar(spec, matcher, vocab_size)
        with self._lock:
            entry.compiled[spec] = compiled
            while len(entry.compiled) > CACHE_SIZE:
                entry.compiled.popitem(last=False)
        return compiled


def _fix(spec: StructuredOutput, error: str) -> str:
    what = {"json_schema": "JSON Schema", "regex": "regex", "grammar": "Lark grammar", "choice": "choices"}[spec.kind]
    return f"the {what} does not compile: {error.strip()}; fix the {what}"


_VOCABULARIES = _Vocabularies()


def compile_structured_output(
    spec: StructuredOutput, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] | None
) -> CompiledGrammar:
    """
    Compiles (or finds compiled) a spec for a model's tokenizer.

    Args:
        spec (`StructuredOutput`): the request's spec.
        tokenizer (`PreTrainedTokenizerFast`): the model's tokenizer (a fast one).
        vocab_size (`int`): the width of the model's logits (tokens past the tokenizer's are never allowed).
        eos_token_ids (`Sequence[int]`, *optional*): the request's EOS ids: the only tokens allowed once
            the grammar is complete.

    Returns:
        `CompiledGrammar`

    Raises:
        `InvalidGenerationArgument`: a malformed spec, one the library refuses (its message included), no
            tokenizer, or no EOS id (a complete output could never end).
    """
    spec.check()
    if tokenizer is None:
        raise InvalidGenerationArgument.for_field(
            "structured_output", spec.kind, "structured output needs the model's tokenizer to be passed"
        )
    if not eos_token_ids:
        raise InvalidGenerationArgument.for_field(
            "eos_token_id",
            None,
            "structured output ends a row with an EOS token once its grammar is complete; set eos_token_id",
        )
    entry = _VOCABULARIES.entry(tokenizer, vocab_size, eos_token_ids)
    return _VOCABULARIES.compiled(entry, spec, vocab_size)
