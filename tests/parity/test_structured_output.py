"""Structured output in the decoding loops: the mask is exactly a user `logits_processor` in transformers.

The reference is transformers' `generate()` with a plain processor that replays each row's generated
tokens through a fresh llguidance matcher at every step and masks with `compute_logit_bias` (another
path of the library than ours); specwire's `structured_output` must give the same tokens and scores
for greedy, sampling, beam search and beam-sample, and its outputs must match the spec. Speculative
decoding with a structured spec must give the tokens of plain constrained decoding.
"""

from __future__ import annotations

import json

import pytest
import torch

from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.config import GenerationConfig, merge
from specwire.generation.loops.generate import drain, generate
from specwire.generation.loops.speculative import iter_speculative
from specwire.generation.speculation.drafters import PromptLookupDrafter, Proposal
from specwire.generation.speculation.stats import SpeculationStats
from specwire.generation.structured import StructuredOutput, compile_structured_output

from .test_decoding_parity import OUTPUT_FLAGS, assert_parity

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PROMPTS = ["The quick brown", "def add(a, b):\n    return", "Hello"]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", r"[ab]{2,4}-[0-9]{2}"),
    "grammar": StructuredOutput("grammar", 'start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[0-9]/\n'),
    "choice": StructuredOutput("choice", ("yes", "no", "maybe so")),
}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from specwire.models import load_model

    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def batch(tiny):
    return tiny.tokenizer(PROMPTS, return_tensors="pt", padding=True)


class ReplayMask:
    """The reference: each step, every row's generated tokens replayed through a fresh matcher."""

    def __init__(self, compiled, input_len):
        self.compiled, self.input_len = compiled, input_len

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for r in range(input_ids.shape[0]):
            matcher = self.compiled.start()
            if not all(matcher.consume_token(t) for t in input_ids[r, self.input_len :].tolist()):
                continue  # a prefix the grammar rejects: a finished row's padding, never used
            bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
            out[r, : bias.numel()][bias[: scores.shape[-1]] == 0] = float("-inf")
            out[r, bias.numel() :] = float("-inf")
        return out


def _config(tiny, **kwargs):
    return merge(GenerationConfig.from_dict({**kwargs, **OUTPUT_FLAGS}), tiny.generation_config)


def run_pair(tiny, ref, batch, spec, seed=None, **kwargs):
    config = _config(tiny, **kwargs, **({"seed": seed} if seed is not None else {}))
    ours = generate(
        tiny.model,
        batch.input_ids,
        batch.attention_mask,
        config=config,
        tokenizer=tiny.tokenizer,
        structured_output=spec,
    )
    compiled = compile_structured_output(spec, tiny.tokenizer, tiny.vocab_size, [tiny.tokenizer.eos_token_id])
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        theirs = ref.generate(
            **batch, logits_processor=[ReplayMask(compiled, batch.input_ids.shape[1])], **kwargs, **OUTPUT_FLAGS
        )
    return ours, theirs


def texts(tiny, result, input_len):
    return [tiny.tokenizer.decode(row[input_len:], skip_special_tokens=True) for row in result.sequences]


def check_output(spec, text):
    import re

    if spec.kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
        assert isinstance(value["n"], int) and 0 <= value["n"] <= 99
    elif spec.kind == "regex":
        assert re.fullmatch(spec.value, text), text
    elif spec.kind == "grammar":
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", text), text
    else:
        assert text in spec.value


@pytest.mark.parametrize("kind", SPECS)
def test_greedy_output_matches_the_spec_and_transformers(tiny, ref, batch, kind):
    spec = SPECS[kind]
    ours, theirs = run_pair(tiny, ref, batch, spec, max_new_tokens=40, do_sample=False)
    assert_parity(ours, theirs)
    for text, reason in zip(texts(tiny, ours, batch.input_ids.shape[1]), ours.finish_reasons, strict=True):
        assert reason == "eos", (reason, text)  # the grammar completed and forced the EOS
        check_output(spec, text)


@pytest.mark.parametrize("kind", ["json_schema", "grammar"])
def test_sampling_matches_transformers(tiny, ref, batch, kind):
    ours, theirs = run_pair(
        tiny, ref, batch, SPECS[kind], seed=7, max_new_tokens=40, do_sample=True, top_k=20, num_return_sequences=2
    )
    assert_parity(ours, theirs)
    for text, reason in zip(texts(tiny, ours, batch.input_ids.shape[1]), ours.finish_reasons, strict=True):
        if reason == "eos":
            check_output(SPECS[kind], text)


@pytest.mark.parametrize("kwargs", [{}, {"do_sample": True, "seed": 3}])
@pytest.mark.parametrize("kind", ["regex", "choice"])
def test_beam_search_each_beam_its_own_matcher(tiny, ref, batch, kind, kwargs):
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    ours, theirs = run_pair(
        tiny, ref, batch, SPECS[kind], seed=seed, max_new_tokens=20, num_beams=3, num_return_sequences=2, **kwargs
    )
    assert_parity(ours, theirs)
    for text in texts(tiny, ours, batch.input_ids.shape[1]):
        check_output(SPECS[kind], text)


@pytest.mark.parametrize(
    "spec, words",
    [
        (StructuredOutput("json_schema", '{"type": "nonsense"}'), "nonsense"),
        (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
        (StructuredOutput("regex", "(ab"), "unclosed group"),
        (StructuredOutput("grammar", "start: foo"), "unknown name"),
        (StructuredOutput("choice", ()), "at least one choice"),
    ],
)
def test_invalid_specs_are_refused_before_any_forward(tiny, batch, spec, words):
    calls = []
    hook = tiny.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(InvalidGenerationArgument) as caught:
            generate(
                tiny.model,
                batch.input_ids,
                batch.attention_mask,
                config=_config(tiny, max_new_tokens=4),
                tokenizer=tiny.tokenizer,
                structured_output=spec,
            )
    finally:
        hook.remove()
    assert words in str(caught.value) and f"structured_output.{spec.kind}" in str(caught.value)
    assert not calls


def test_compiled_grammars_are_cached_per_spec(tiny):
    eos = [tiny.tokenizer.eos_token_id]
    first = compile_structured_output(SPECS["regex"], tiny.tokenizer, tiny.vocab_size, eos)
    again = compile_structured_output(
        StructuredOutput("regex", SPECS["regex"].value), tiny.tokenizer, tiny.vocab_size, eos
    )
    other = compile_structured_output(StructuredOutput("regex", "[ab]+"), tiny.tokenizer, tiny.vocab_size, eos)
    assert first is again and other is not first


class ScriptedDrafter:
    """Proposes the given tokens every round (forbidden ones included) and records what it was told."""

    def __init__(self, rows, tokens):
        self.rows, self.tokens, self.proposed = len(rows), tokens, 0

    def propose(self, num_tokens):
        self.proposed += 1
        return Proposal([self.tokens[:num_tokens] for _ in range(self.rows)], [None] * self.rows)

    def feedback(self, num_accepted, appended, finished):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("kind", ["json_schema", "grammar", "regex"])
@pytest.mark.parametrize("drafter", ["prompt_lookup", "scripted"])
def test_speculation_equals_plain_constrained_decoding(tiny, batch, kind, drafter):
    spec = SPECS[kind]
    config = _config(tiny, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=5)
    plain = generate(
        tiny.model,
        batch.input_ids,
        batch.attention_mask,
        config=config,
        tokenizer=tiny.tokenizer,
        structured_output=spec,
    )
    # The prompt holds a valid output, so prompt lookup drafts what the grammar allows, then stops.
    prompt_text = texts(tiny, plain, batch.input_ids.shape[1])[0]
    tokens = tiny.tokenizer([p + " " + prompt_text + prompt_text for p in PROMPTS], return_tensors="pt", padding=True)
    plain = generate(
        tiny.model,
        tokens.input_ids,
        tokens.attention_mask,
        config=config,
        tokenizer=tiny.tokenizer,
        structured_output=spec,
    )
    vocab = tiny.vocab_size
    # The two tokens the grammar allows after the first one (the first round's), then a special token
    # it never allows.
    expected = plain.sequences[0, tokens.input_ids.shape[1] :].tolist()
    garbage = expected[1:3] + [tiny.tokenizer.bos_token_id] * 3

    def open_drafter(rows, resolved):
        if drafter == "prompt_lookup":
            return PromptLookupDrafter(rows, resolved, vocab)
        return ScriptedDrafter(rows, garbage)

    stats = SpeculationStats()
    speculative = drain(
        iter_speculative(
            tiny.model,
            tokens.input_ids,
            tokens.attention_mask,
            config=config,
            open_drafter=open_drafter,
            stats=stats,
            tokenizer=tiny.tokenizer,
            structured_output=spec,
            draft_length=5,
        )
    )
    assert not stats.fallback_reason
    if drafter == "prompt_lookup":
        assert stats.accepted_tokens > 0  # it did speculate
    else:  # forbidden drafts end the draft before the verify forward: at most the 2 allowed tokens per row
        assert stats.drafted_tokens > 0
        assert all(record.drafted <= 2 * record.rows for record in stats.round_log), stats.round_log
    assert torch.equal(speculative.sequences, plain.sequences)
    assert speculative.finish_reasons == plain.finish_reasons
    for a, b in zip(speculative.scores, plain.scores, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.fixture(scope="module")
def draft_model(tiny_draft_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_draft_dir).eval()


@pytest.mark.parametrize("kind", ["json_schema", "grammar"])
def test_draft_model_speculation_equals_plain_constrained_decoding(tiny, batch, draft_model, kind):
    from specwire.generation.speculation.drafters import ModelDrafter

    spec = SPECS[kind]
    config = _config(tiny, max_new_tokens=40, do_sample=False)
    plain = generate(
        tiny.model,
        batch.input_ids,
        batch.attention_mask,
        config=config,
        tokenizer=tiny.tokenizer,
        structured_output=spec,
    )
    stats = SpeculationStats()
    speculative = drain(
        iter_speculative(
            tiny.model,
            batch.input_ids,
            batch.attention_mask,
            config=config,
            open_drafter=lambda rows, resolved: ModelDrafter(draft_model, rows, resolved, tiny.vocab_size),
            stats=stats,
            tokenizer=tiny.tokenizer,
            structured_output=spec,
            draft_length=4,
        )
    )
    assert not stats.fallback_reason
    if kind == "json_schema":  # the random draft rarely proposes what the arithmetic grammar allows
        assert stats.drafted_tokens > 0
    assert torch.equal(speculative.sequences, plain.sequences)
    assert speculative.finish_reasons == plain.finish_reasons


def test_sampled_drafts_with_probabilities_keep_forbidden_tokens_for_rejection_sampling(tiny, batch, draft_model):
    """The unconstrained draft model proposes forbidden tokens with their probabilities: they reach
    rejection sampling uncut (p = 0 there, so they are rejected and the residual is drawn; cutting them
    would skew the distribution), and every output still matches the spec."""
    from specwire.generation.speculation.drafters import ModelDrafter

    spec = SPECS["json_schema"]
    config = _config(tiny, max_new_tokens=40, do_sample=True, seed=5)
    proposed = []

    class Recording(ModelDrafter):
        def propose(self, num_tokens):
            proposal = super().propose(num_tokens)
            proposed.append(sum(len(tokens) for tokens in proposal.tokens))
            return proposal

    stats = SpeculationStats()
    result = drain(
        iter_speculative(
            tiny.model,
            batch.input_ids,
            batch.attention_mask,
            config=config,
            open_drafter=lambda rows, resolved: Recording(
                draft_model,
                rows,
                resolved,
                tiny.vocab_size,
                return_probs=True,
                generator=torch.Generator().manual_seed(1),
            ),
            stats=stats,
            tokenizer=tiny.tokenizer,
            structured_output=spec,
            draft_length=4,
        )
    )
    assert not stats.fallback_reason
    # Every proposed token was verified (none cut), and the forbidden ones were rejected.
    assert stats.drafted_tokens == sum(proposed) > stats.accepted_tokens
    for text, reason in zip(texts(tiny, result, batch.input_ids.shape[1]), result.finish_reasons, strict=True):
        if reason == "eos":
            check_output(spec, text)
