"""`allowed_token_sequences` (the serializable `prefix_allowed_tokens_fn`) against transformers'
`generate(prefix_allowed_tokens_fn=...)` with the same function: same tokens and scores for greedy,
sampling and beam search, and speculation gives plain decoding's tokens."""

from __future__ import annotations

import pytest
import torch

from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.config import GenerationConfig, merge
from specwire.generation.loops.generate import drain, generate
from specwire.generation.loops.speculative import iter_speculative
from specwire.generation.processors.prefix import AllowedSequences
from specwire.generation.speculation.drafters import PromptLookupDrafter
from specwire.generation.speculation.stats import SpeculationStats

from .test_decoding_parity import OUTPUT_FLAGS, assert_parity

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PROMPTS = ["The quick brown", "def add(a, b):\n    return", "Hello"]
SEQUENCES = [[50, 60, 70, 80], [50, 61], [50, 60, 71, 81, 91], [90, 91, 92], [90], [100]]


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


def run_pair(tiny, ref, batch, seed=None, **kwargs):
    config = merge(
        GenerationConfig.from_dict({**kwargs, **OUTPUT_FLAGS, **({"seed": seed} if seed is not None else {})}),
        tiny.generation_config,
    )
    ours = generate(tiny.model, batch.input_ids, batch.attention_mask, config=config, allowed_token_sequences=SEQUENCES)
    fn = AllowedSequences(SEQUENCES, batch.input_ids.shape[1], [tiny.tokenizer.eos_token_id])
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        theirs = ref.generate(**batch, prefix_allowed_tokens_fn=fn, **kwargs, **OUTPUT_FLAGS)
    return ours, theirs


def generated(result, input_len):
    return [[t for t in row[input_len:].tolist() if t not in (0, 2)] for row in result.sequences]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"do_sample": False},
        {"do_sample": True, "seed": 4, "num_return_sequences": 2},
        {"num_beams": 3, "num_return_sequences": 2},
        {"num_beams": 2, "do_sample": True, "seed": 6},
    ],
    ids=["greedy", "sampling", "beams", "beam_sample"],
)
def test_parity_with_prefix_allowed_tokens_fn(tiny, ref, batch, kwargs):
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    ours, theirs = run_pair(tiny, ref, batch, seed=seed, max_new_tokens=8, **kwargs)
    assert_parity(ours, theirs)
    for row in generated(ours, batch.input_ids.shape[1]):
        assert row in SEQUENCES, row


def test_a_sequence_that_is_a_prefix_of_another_may_end_there():
    trie = AllowedSequences([[90, 91], [90]], input_len=1, eos_token_ids=[2])
    assert trie.next_tokens([]) == [90]
    assert trie.next_tokens([90]) == [2, 91]
    assert trie.next_tokens([90, 91]) == [2]
    assert trie.next_tokens([7]) == [2]


def test_speculation_equals_plain_decoding(tiny, batch):
    config = merge(GenerationConfig.from_dict({"max_new_tokens": 8, "do_sample": False}), tiny.generation_config)
    plain = generate(
        tiny.model, batch.input_ids, batch.attention_mask, config=config, allowed_token_sequences=SEQUENCES
    )
    stats = SpeculationStats()
    fast = drain(
        iter_speculative(
            tiny.model,
            batch.input_ids,
            batch.attention_mask,
            config=config,
            open_drafter=lambda rows, resolved: PromptLookupDrafter(rows, resolved, tiny.vocab_size),
            stats=stats,
            allowed_token_sequences=SEQUENCES,
            draft_length=3,
        )
    )
    assert not stats.fallback_reason
    assert torch.equal(fast.sequences, plain.sequences)


@pytest.mark.parametrize("sequences", [[], [[]], [[5, 99999]]])
def test_bad_sequences_are_refused(tiny, batch, sequences):
    config = merge(GenerationConfig.from_dict({"max_new_tokens": 2}), tiny.generation_config)
    with pytest.raises(InvalidGenerationArgument, match="allowed_token_sequences"):
        generate(tiny.model, batch.input_ids, batch.attention_mask, config=config, allowed_token_sequences=sequences)
