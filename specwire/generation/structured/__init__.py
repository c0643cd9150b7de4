"""Structured output: a request's JSON schema, regex, Lark grammar or choice list, as a logits mask.

- `spec`: `StructuredOutput`, the request's spec (which kind, its text) and its checks.
- `grammars`: the one module that imports the grammar library (llguidance): a tokenizer's grammar
  vocabulary (built once per tokenizer) and the compiled grammars (a bounded cache per distinct spec).
- `processor`: `StructuredOutputLogitsProcessor`, one matcher state per row prefix, masking each row's
  scores where transformers runs a user `logits_processor`.
"""

from .grammars import CompiledGrammar, compile_structured_output
from .processor import StructuredOutputLogitsProcessor
from .spec import STRUCTURED_KINDS, StructuredOutput

__all__ = [
    "STRUCTURED_KINDS",
    "CompiledGrammar",
    "StructuredOutput",
    "StructuredOutputLogitsProcessor",
    "compile_structured_output",
]
