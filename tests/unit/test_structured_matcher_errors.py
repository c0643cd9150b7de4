"""A structured-output matcher that refuses a token its own mask allowed ends the request loudly
(`StructuredOutputFailed`, INTERNAL, naming llguidance and the spec), through the real processor and the
real decoding loop on the tiny Llama; a token the mask forbade stays an ordinary rejection (that row's
scores are never used, so it is left unmasked).

The contradiction is a library bug and cannot be produced with a correct llguidance: the test wraps a
real llguidance matcher so that it refuses one token its mask allows, everything else delegated."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from specwire.generation.config import GenerationConfig
from specwire.generation.loops.generate import drain, generate_from_plan
from specwire.generation.planning import prepare_generation
from specwire.generation.structured import (
    CompiledGrammar,
    StructuredOutput,
    StructuredOutputLogitsProcessor,
    compile_structured_output,
)
from specwire.generation.structured.processor import StructuredOutputFailed

SPEC = StructuredOutput("choice", ("yes", "no"))


class _Contradicting:
    """A real llguidance matcher that refuses `token` although its mask allows it."""

    def __init__(self, matcher, token: int):
        self.matcher, self.token = matcher, token

    def consume_token(self, token: int) -> bool:
        return False if token == self.token else self.matcher.consume_token(token)

    def deep_copy(self):
        return _Contradicting(self.matcher.deep_copy(), self.token)

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def _contradicting(grammar: CompiledGrammar, token: int) -> CompiledGrammar:
    return CompiledGrammar(grammar.spec, _Contradicting(grammar.start(), token), grammar.vocab_size)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _plan(model, tokenizer, prompt):
    special = model.generation_config
    config = GenerationConfig(
        max_new_tokens=6, do_sample=False, eos_token_id=special.eos_token_id, pad_token_id=special.pad_token_id
    )
    return prepare_generation(model, prompt, config=config, structured_output=SPEC, tokenizer=tokenizer)


def test_a_refused_allowed_token_ends_the_request_and_a_forbidden_one_is_an_ordinary_rejection(tiny_model, tokenizer):
    prompt = torch.tensor([[5, 6, 7, 8]])
    plan = _plan(tiny_model, tokenizer, prompt)
    out = drain(generate_from_plan(tiny_model, plan, tokenizer=tokenizer))
    first = int(out.sequences[0, prompt.shape[1]])  # the token the mask allowed and greedy chose
    assert tokenizer.decode(out.sequences[0, prompt.shape[1] :], skip_special_tokens=True) in ("yes", "no")

    # Through the real loop: the step after `first` asks the matcher about it, and the request ends.
    plan = _plan(tiny_model, tokenizer, prompt)
    plan.structured = _contradicting(plan.structured, first)
    with pytest.raises(StructuredOutputFailed) as info:
        drain(generate_from_plan(tiny_model, plan, tokenizer=tokenizer))
    message = str(info.value)
    assert info.value.code == "INTERNAL"
    assert "llguidance" in message and f"token {first}" in message and "structured_output.choice" in message

    # A token the mask forbids (the grammar allows only "yes"/"no" prefixes): rejected, row left unmasked.
    grammar = compile_structured_output(SPEC, tokenizer, plan.structured.vocab_size, plan.eos_token_ids)
    allowed = StructuredOutputLogitsProcessor(grammar, prompt.shape[1])(prompt, torch.zeros(1, grammar.vocab_size))
    forbidden = int(torch.isinf(allowed[0]).nonzero()[0, 0])
    processor = StructuredOutputLogitsProcessor(_contradicting(grammar, first), prompt.shape[1])
    scores = torch.randn(1, grammar.vocab_size)
    masked = processor(torch.cat([prompt, torch.tensor([[forbidden]])], dim=1), scores)
    assert torch.equal(masked, scores)
