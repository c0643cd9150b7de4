"""Parity of specwire's decoding loop with transformers' `generate()`.

The same model weights, prompts and config go through `specwire.generation.loops.generate.generate` (model
loaded with `specwire.models.load_model`) and through `AutoModelForCausalLM.generate` (the same folder
loaded by transformers); token ids must be equal and scores/logits equal to float tolerance.

The tiny random Llama rarely emits its real EOS id, so most cases use EOS ids picked from tokens the
model does produce (`frequent`), which makes rows and beam hypotheses end at different lengths.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specwire.generation.argument_errors import UnsupportedModeError
from specwire.generation.config import GenerationConfig, merge
from specwire.generation.loops.generate import generate, iter_generate
from specwire.generation.outputs import StepEvent, compute_transition_scores

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PROMPTS = ["The quick brown", "def add(a, b):\n    return", "Hello"]
OUTPUT_FLAGS = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}


# ---------------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny Llama through our loader."""
    from specwire.models import load_model

    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    """The same folder loaded by transformers: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def batch(tiny):
    """Three left-padded prompts."""
    return tiny.tokenizer(PROMPTS, return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def single(tiny):
    """One prompt, no padding."""
    return tiny.tokenizer(PROMPTS[:1], return_tensors="pt")


@pytest.fixture(scope="module")
def frequent(ref, batch):
    """Tokens the tiny model emits most under greedy decoding (used as EOS ids, bad words...)."""
    with torch.no_grad():
        out = ref.generate(**batch, max_new_tokens=30, do_sample=False)
    counts = Counter(out[:, batch.input_ids.shape[1] :].flatten().tolist())
    return [token for token, _ in counts.most_common(8)]


@pytest.fixture(scope="module")
def greedy_first(ref, batch):
    """The first greedy token of each prompt."""
    with torch.no_grad():
        out = ref.generate(**batch, max_new_tokens=1, do_sample=False)
    return out[:, -1].tolist()


def _reference_kwargs(kwargs: dict) -> dict:
    """transformers wants a (SynthID)WatermarkingConfig object where our config holds a dict."""
    out = dict(kwargs)
    if isinstance(out.get("watermarking_config"), dict):
        from transformers.generation import SynthIDTextWatermarkingConfig, WatermarkingConfig

        wm = out["watermarking_config"]
        cls = SynthIDTextWatermarkingConfig if "ngram_len" in wm else WatermarkingConfig
        out["watermarking_config"] = cls(**wm)
    return out


def run_pair(lm, reference, inputs, *, seed=None, tokenizer=None, negative=None, flags=True, **kwargs):
    """(ours, theirs) for the same prompts and generation kwargs."""
    extra = OUTPUT_FLAGS if flags else {}
    request = GenerationConfig.from_dict({**kwargs, **extra, **({"seed": seed} if seed is not None else {})})
    config = merge(request, lm.generation_config)
    attention_mask = getattr(inputs, "attention_mask", None) if not isinstance(inputs, torch.Tensor) else None
    input_ids = inputs if isinstance(inputs, torch.Tensor) else inputs.input_ids
    neg_ids, neg_mask = negative if negative is not None else (None, None)
    ours = generate(
        lm.model,
        input_ids,
        attention_mask,
        config=config,
        tokenizer=tokenizer,
        negative_prompt_ids=neg_ids,
        negative_prompt_attention_mask=neg_mask,
    )
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        theirs = reference.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            tokenizer=tokenizer,
            negative_prompt_ids=neg_ids,
            negative_prompt_attention_mask=neg_mask,
            **_reference_kwargs(kwargs),
            **extra,
        )
    return ours, theirs


def assert_parity(ours, theirs, *, atol=1e-5):
    """Same tokens; same scores, logits, beam indices and sequence scores where transformers returns them."""
    if isinstance(theirs, torch.Tensor):
        assert torch.equal(ours.sequences, theirs), f"\nours   {ours.sequences}\ntheirs {theirs}"
        assert ours.scores is None and ours.logits is None
        return
    assert torch.equal(ours.sequences, theirs.sequences), f"\nours   {ours.sequences}\ntheirs {theirs.sequences}"
    for name in ("scores", "logits"):
        mine, other = getattr(ours, name), getattr(theirs, name)
        if other is None:
            assert mine is None, name
            continue
        assert len(mine) == len(other), f"{name}: {len(mine)} steps vs {len(other)}"
        for step, (a, b) in enumerate(zip(mine, other, strict=True)):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{name}[{step}] {a.shape}/{a.dtype} {b.shape}/{b.dtype}"
            assert torch.allclose(a, b, atol=atol, rtol=1e-5), f"{name}[{step}] differs"
    their_beam_indices = getattr(theirs, "beam_indices", None)
    if their_beam_indices is not None:
        assert torch.equal(ours.beam_indices, their_beam_indices)
        assert ours.beam_indices.dtype == their_beam_indices.dtype
    their_sequence_scores = getattr(theirs, "sequences_scores", None)
    if their_sequence_scores is not None:
        assert torch.allclose(ours.sequences_scores, their_sequence_scores, atol=atol)
    else:
        assert ours.sequences_scores is None


# ---------------------------------------------------------------------------------------------------
# Greedy


def test_greedy_default_twenty_new_tokens(tiny, ref, single):
    ours, theirs = run_pair(tiny, ref, single)
    assert_parity(ours, theirs)
    assert ours.sequences.shape[1] == single.input_ids.shape[1] + 20
    assert len(ours.scores) == 20 and ours.logits[0].dtype == torch.float32
    assert ours.finish_reasons == ["length"]


def test_greedy_batched_left_padding_with_eos(tiny, ref, batch, frequent):
    ours, theirs = run_pair(tiny, ref, batch, max_new_tokens=20, eos_token_id=frequent[:2])
    assert_parity(ours, theirs)
    assert "eos" in ours.finish_reasons and "length" in ours.finish_reasons
    # Rows that ended early are padded with pad_token_id (0 here) after their EOS.
    row = ours.finish_reasons.index("eos")
    generated = ours.generated_tokens[row].tolist()
    end = next(i for i, t in enumerate(generated) if t in frequent[:2])
    assert all(t == 0 for t in generated[end + 1 :]) and end + 1 < len(generated)


def test_greedy_attention_mask_inferred_from_padding(tiny, ref, batch):
    # No mask given: pad id 0 occurs in the prompt and is not an EOS id, so the mask is inferred.
    ours, theirs = run_pair(tiny, ref, batch.input_ids, max_new_tokens=8)
    assert_parity(ours, theirs)
    with_mask, _ = run_pair(tiny, ref, batch, max_new_tokens=8)
    assert torch.equal(ours.sequences, with_mask.sequences)


def test_plain_sequences_without_return_dict(tiny, ref, batch):
    ours, theirs = run_pair(tiny, ref, batch, flags=False, max_new_tokens=6)
    assert_parity(ours, theirs)


def test_default_length_capped_at_max_position_embeddings(tiny, ref):
    # 250 prompt tokens + the default 20 would pass the context of 256: transformers caps at 256.
    input_ids = torch.randint(3, 300, (1, 250), generator=torch.Generator().manual_seed(0))
    ours, theirs = run_pair(tiny, ref, input_ids, flags=False)
    assert_parity(ours, theirs)
    assert ours.sequences.shape[1] == 256


def test_input_longer_than_max_length_raises(tiny, ref, batch):
    config = merge(GenerationConfig(max_length=4), tiny.generation_config)
    with pytest.raises(ValueError, match="max_length"):
        generate(tiny.model, batch.input_ids, batch.attention_mask, config=config)
    with pytest.raises(ValueError):
        ref.generate(**batch, max_length=4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"use_cache": False},
        {"use_cache": False, "num_beams": 3},
        {"prefill_chunk_size": 4},
        {"prefill_chunk_size": 4, "num_beams": 2},
    ],
    ids=["no_cache", "no_cache_beams", "chunked_prefill", "chunked_prefill_beams"],
)
def test_cache_options(tiny, ref, batch, frequent, kwargs):
    ours, theirs = run_pair(tiny, ref, batch, max_new_tokens=8, eos_token_id=frequent[2], **kwargs)
    assert_parity(ours, theirs)


def test_verify_step_matches_decode_steps(tiny, batch):
    """`RowBatch.verify` over k tokens gives the logits of k `decode` steps; `rollback` forgets them."""
    from specwire.generation.rows import RowBatch

    candidates = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]])

    def fresh():
        rows = RowBatch(tiny.model, attention_mask=batch.attention_mask, prompt_length=batch.input_ids.shape[1], rows=3)
        return rows, rows.prefill(batch.input_ids)

    stepwise, _ = fresh()
    sequential = torch.stack([stepwise.decode(candidates[:, i]) for i in range(3)], dim=1)  # [rows, 3, V]
    at_once, _ = fresh()
    verified = at_once.verify(candidates)  # [rows, 3, V]
    assert torch.allclose(verified, sequential, atol=1e-5)
    # Reject the last two tokens, then continue with other ones: same as if they had never been seen.
    at_once.rollback(2)
    replaced = at_once.verify(torch.tensor([[40], [41], [42]]))[:, -1]
    expected, _ = fresh()
    expected.decode(candidates[:, 0])
    assert torch.allclose(replaced, expected.decode(torch.tensor([40, 41, 42])), atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Beam search and beam-sample

BEAM_CASES = [
    # num_beams, length_penalty, early_stopping, num_return_sequences, eos ids (indices into `frequent`)
    (2, 1.0, False, 1, [4]),
    (3, 1.0, False, 3, [2]),
    (4, 0.0, "never", 2, [3]),
    (4, 2.0, "never", 1, [2]),
    (4, -0.5, True, 2, [2, 4]),
    (3, 1.0, True, 1, [3]),
    (4, 1.0, True, 4, [2]),
    (4, 1.0, False, 4, [2]),
    (5, 1.5, False, 4, [4, 0]),
]


@pytest.mark.parametrize(("num_beams", "length_penalty", "early_stopping", "nrs", "eos"), BEAM_CASES)
def test_beam_search(tiny, ref, batch, frequent, num_beams, length_penalty, early_stopping, nrs, eos):
    ours, theirs = run_pair(
        tiny,
        ref,
        batch,
        max_new_tokens=14,
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        num_return_sequences=nrs,
        eos_token_id=[frequent[i] for i in eos],
    )
    assert_parity(ours, theirs)
    assert ours.sequences.shape[0] == batch.input_ids.shape[0] * nrs
    assert len(ours.finish_reasons) == ours.sequences.shape[0]
    # Transition scores rebuild the sequence scores (transformers' documented identity).
    transition = compute_transition_scores(ours.sequences, ours.scores, ours.beam_indices)
    assert torch.allclose(
        transition, ref.compute_transition_scores(theirs.sequences, theirs.scores, theirs.beam_indices)
    )
    lengths = (ours.beam_indices != -1).sum(-1)
    assert torch.allclose(transition.sum(-1) / lengths**length_penalty, ours.sequences_scores, atol=1e-4)


def test_beam_search_finish_reasons(tiny, ref, batch, frequent):
    ours, theirs = run_pair(
        tiny, ref, batch, max_new_tokens=14, num_beams=3, num_return_sequences=3, eos_token_id=frequent[2]
    )
    assert_parity(ours, theirs)
    assert set(ours.finish_reasons) == {"eos", "length"}
    for row, reason in enumerate(ours.finish_reasons):
        used = int((ours.beam_indices[row] != -1).sum())
        last = int(ours.sequences[row, batch.input_ids.shape[1] + used - 1])
        assert reason == ("eos" if last == frequent[2] else "length")


def test_beam_search_fill_value_quirk(tiny, ref, batch, frequent):
    # pad_token_id 0 is falsy in transformers' `pad or eos[0]`: unused positions hold eos[0], not 0.
    ours, theirs = run_pair(
        tiny,
        ref,
        batch,
        max_new_tokens=14,
        num_beams=3,
        num_return_sequences=3,
        eos_token_id=[frequent[3], 7],
    )
    assert_parity(ours, theirs)
    tail = ours.sequences[:, batch.input_ids.shape[1] :][ours.beam_indices == -1]
    assert tail.numel() > 0 and bool((tail == frequent[3]).all())


@pytest.mark.parametrize(
    ("seed", "kwargs"),
    [
        (0, {"num_beams": 3, "num_return_sequences": 2}),
        (1, {"num_beams": 4, "top_k": 20, "temperature": 0.8}),
    ],
)
def test_beam_sample_seeded(tiny, ref, batch, frequent, seed, kwargs):
    ours, theirs = run_pair(
        tiny, ref, batch, seed=seed, do_sample=True, max_new_tokens=12, eos_token_id=frequent[:2], **kwargs
    )
    assert_parity(ours, theirs)


# ---------------------------------------------------------------------------------------------------
# Sampling


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_sampling_seeded_single_request(tiny, ref, single, seed):
    ours, theirs = run_pair(tiny, ref, single, seed=seed, do_sample=True, max_new_tokens=20)
    assert_parity(ours, theirs)


def test_sampling_seeded_batch_and_return_sequences(tiny, ref, batch, frequent):
    ours, theirs = run_pair(
        tiny,
        ref,
        batch,
        seed=3,
        do_sample=True,
        top_k=0,
        num_return_sequences=3,
        max_new_tokens=15,
        eos_token_id=frequent[:1],
    )
    assert_parity(ours, theirs)
    assert ours.sequences.shape[0] == 9


def test_sampling_uses_the_request_generator_not_the_global_rng(tiny, single):
    config = merge(GenerationConfig(do_sample=True, max_new_tokens=12, top_k=0, seed=5), tiny.generation_config)
    torch.manual_seed(123)
    first = generate(tiny.model, single.input_ids, config=config).sequences
    torch.manual_seed(456)
    second = generate(tiny.model, single.input_ids, config=config).sequences
    assert torch.equal(first, second)
    other = merge(GenerationConfig(seed=6), config)
    assert not torch.equal(first, generate(tiny.model, single.input_ids, config=other).sequences)


@pytest.mark.parametrize("normalize_logits", [False, True])
def test_compute_transition_scores_greedy_and_sampling(tiny, ref, batch, normalize_logits):
    for kwargs in ({"max_new_tokens": 8}, {"max_new_tokens": 8, "do_sample": True, "top_k": 5}):
        ours, theirs = run_pair(tiny, ref, batch, seed=2, **kwargs)
        assert_parity(ours, theirs)
        mine = compute_transition_scores(ours.sequences, ours.scores, normalize_logits=normalize_logits)
        other = ref.compute_transition_scores(theirs.sequences, theirs.scores, normalize_logits=normalize_logits)
        assert torch.allclose(mine, other)


# ---------------------------------------------------------------------------------------------------
# Streaming and cancellation


def test_step_events_stream_the_generated_tokens(tiny, batch, frequent):
    config = merge(GenerationConfig(max_new_tokens=12, eos_token_id=frequent[:2]), tiny.generation_config)
    steps = iter_generate(tiny.model, batch.input_ids, batch.attention_mask, config=config)
    streamed = [[] for _ in PROMPTS]
    reasons: list[str | None] = [None] * len(PROMPTS)
    while True:
        try:
            event = next(steps)
        except StopIteration as stop:
            result = stop.value
            break
        assert isinstance(event, StepEvent)
        for row, tokens in enumerate(event.tokens):
            streamed[row].extend(tokens)
            if event.finish_reasons[row] is not None:
                assert reasons[row] is None
                reasons[row] = event.finish_reasons[row]
    assert reasons == result.finish_reasons
    for row, tokens in enumerate(streamed):
        assert tokens == result.generated_tokens[row, : len(tokens)].tolist()
        if reasons[row] == "eos":
            assert tokens[-1] in frequent[:2]


def test_beam_events_end_with_the_returned_hypotheses(tiny, batch):
    config = merge(GenerationConfig(max_new_tokens=6, num_beams=3, num_return_sequences=2), tiny.generation_config)
    events = []
    steps = iter_generate(tiny.model, batch.input_ids, batch.attention_mask, config=config)
    while True:
        try:
            events.append(next(steps))
        except StopIteration as stop:
            result = stop.value
            break
    assert all(not any(e.tokens) for e in events[:-1]) and events[-1].final
    assert events[-1].tokens == result.generated_tokens.tolist()


def test_cancellation_stops_forward_passes(tiny, batch):
    calls = []
    handle = tiny.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        config = merge(GenerationConfig(max_new_tokens=50), tiny.generation_config)
        steps = iter_generate(tiny.model, batch.input_ids, batch.attention_mask, config=config)
        assert calls == []  # validation and setup only: the model has not run yet
        for _ in range(3):
            next(steps)
        steps.close()
        assert len(calls) == 3  # prefill + 2 decode steps, nothing after the last consumed event
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------------------
# Refused modes


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_beams": 2, "low_memory": True}, "low_memory"),
    ],
)
def test_removed_modes_are_refused_with_the_field(tiny, batch, kwargs, field):
    config = merge(GenerationConfig(max_new_tokens=4, **kwargs), tiny.generation_config)
    with pytest.raises(UnsupportedModeError) as caught:
        iter_generate(tiny.model, batch.input_ids, batch.attention_mask, config=config)
    assert caught.value.field == field
    assert isinstance(caught.value, ValueError)


# ---------------------------------------------------------------------------------------------------
# Every logits processor and stopping criterion, generate-level


def _processor_cases():
    """(id, kwargs(frequent, first_tokens, prompt_len), seed or None)."""
    return [
        ("repetition_penalty", lambda f, g, n: {"repetition_penalty": 1.8}, None),
        ("repetition_penalty_beams", lambda f, g, n: {"repetition_penalty": 1.3, "num_beams": 3}, None),
        ("encoder_repetition_penalty", lambda f, g, n: {"encoder_repetition_penalty": 1.5}, None),
        ("no_repeat_ngram_size", lambda f, g, n: {"no_repeat_ngram_size": 2}, None),
        ("no_repeat_ngram_size_beams", lambda f, g, n: {"no_repeat_ngram_size": 3, "num_beams": 3}, None),
        ("encoder_no_repeat_ngram_size", lambda f, g, n: {"encoder_no_repeat_ngram_size": 1}, None),
        ("bad_words_ids", lambda f, g, n: {"bad_words_ids": [[f[0]], [f[1], f[2]]]}, None),
        ("sequence_bias", lambda f, g, n: {"sequence_bias": [[[f[0]], -8.0], [[f[1], f[3]], 6.0]]}, None),
        ("min_length", lambda f, g, n: {"min_length": n + 8, "eos_token_id": f[:2]}, None),
        ("min_new_tokens", lambda f, g, n: {"min_new_tokens": 8, "eos_token_id": f[:2]}, None),
        (
            "min_new_tokens_beams",
            lambda f, g, n: {"min_new_tokens": 5, "eos_token_id": f[:2], "num_beams": 3},
            None,
        ),
        ("forced_eos_token_id", lambda f, g, n: {"forced_eos_token_id": 2}, None),
        (
            "remove_invalid_values",
            lambda f, g, n: {"remove_invalid_values": True, "suppress_tokens": [f[0]]},
            None,
        ),
        (
            "exponential_decay_length_penalty",
            lambda f, g, n: {"exponential_decay_length_penalty": (3, 1.6), "eos_token_id": f[3]},
            None,
        ),
        ("suppress_tokens", lambda f, g, n: {"suppress_tokens": [f[0], f[1]]}, None),
        ("begin_suppress_tokens", lambda f, g, n: {"begin_suppress_tokens": sorted(set(g))}, None),
        ("temperature", lambda f, g, n: {"do_sample": True, "temperature": 0.7}, 11),
        ("top_k", lambda f, g, n: {"do_sample": True, "top_k": 5}, 12),
        ("top_p", lambda f, g, n: {"do_sample": True, "top_p": 0.7}, 13),
        ("min_p", lambda f, g, n: {"do_sample": True, "top_k": 0, "min_p": 0.1}, 14),
        ("top_h", lambda f, g, n: {"do_sample": True, "top_h": 0.6}, 15),
        ("typical_p", lambda f, g, n: {"do_sample": True, "typical_p": 0.8}, 16),
        ("epsilon_cutoff", lambda f, g, n: {"do_sample": True, "top_k": 0, "epsilon_cutoff": 0.01}, 17),
        ("eta_cutoff", lambda f, g, n: {"do_sample": True, "top_k": 0, "eta_cutoff": 0.01}, 18),
        (
            "all_warpers",
            lambda f, g, n: {"do_sample": True, "temperature": 1.3, "top_k": 30, "top_p": 0.9},
            19,
        ),
        (
            "watermarking",
            lambda f, g, n: {
                "watermarking_config": {"greenlist_ratio": 0.25, "bias": 2.0, "seeding_scheme": "lefthash"}
            },
            None,
        ),
        (
            "watermarking_sampled",
            lambda f, g, n: {
                "do_sample": True,
                "watermarking_config": {"greenlist_ratio": 0.5, "bias": 4.0, "seeding_scheme": "selfhash"},
            },
            20,
        ),
        (
            "synthid_greedy",
            lambda f, g, n: {"watermarking_config": {"ngram_len": 3, "keys": [654, 400, 836, 123]}},
            None,
        ),
        (
            "synthid_sampled",
            lambda f, g, n: {"do_sample": True, "watermarking_config": {"ngram_len": 5, "keys": [5, 9, 3, 21, 4]}},
            22,
        ),
        (
            "synthid_sampled_options",
            lambda f, g, n: {
                "do_sample": True,
                "top_k": 20,
                "watermarking_config": {
                    "ngram_len": 2,
                    "keys": [7, 11],
                    "sampling_table_size": 1024,
                    "sampling_table_seed": 3,
                    "context_history_size": 4,
                    "skip_first_ngram_calls": True,
                },
            },
            23,
        ),
        (
            "synthid_beams",
            lambda f, g, n: {"num_beams": 3, "watermarking_config": {"ngram_len": 3, "keys": [1, 2, 3]}},
            None,
        ),
        (
            "synthid_beam_sample",
            lambda f, g, n: {
                "num_beams": 2,
                "do_sample": True,
                "num_return_sequences": 2,
                "watermarking_config": {"ngram_len": 3, "keys": [1, 2, 3]},
            },
            24,
        ),
        ("guidance_scale", lambda f, g, n: {"guidance_scale": 1.5}, None),
        (
            "renormalize_logits",
            lambda f, g, n: {"do_sample": True, "top_k": 10, "renormalize_logits": True},
            21,
        ),
        ("max_length", lambda f, g, n: {"max_length": n + 7}, None),
        ("max_new_tokens", lambda f, g, n: {"max_new_tokens": 5}, None),
        ("max_new_tokens_wins", lambda f, g, n: {"max_new_tokens": 5, "max_length": n + 9}, None),
        ("default_20", lambda f, g, n: {"max_new_tokens": None}, None),
        ("eos_list", lambda f, g, n: {"eos_token_id": f[:3]}, None),
        ("eos_list_beams", lambda f, g, n: {"eos_token_id": f[:3], "num_beams": 2}, None),
    ]


@pytest.mark.parametrize(
    ("kwargs_of", "seed"), [(c[1], c[2]) for c in _processor_cases()], ids=[c[0] for c in _processor_cases()]
)
def test_processor_and_criterion_table(tiny, ref, batch, frequent, greedy_first, kwargs_of, seed):
    kwargs = {"max_new_tokens": 12, **kwargs_of(frequent, greedy_first, batch.input_ids.shape[1])}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    ours, theirs = run_pair(tiny, ref, batch, seed=seed, **kwargs)
    assert_parity(ours, theirs)


def test_forced_bos_token_after_a_one_token_prompt(tiny, ref):
    # ForcedBOS acts when the sequence holds exactly one token; begin_suppress_tokens then starts one later.
    bos_only = torch.tensor([[1], [1]])
    ours, theirs = run_pair(tiny, ref, bos_only, forced_bos_token_id=5, begin_suppress_tokens=[7], max_new_tokens=6)
    assert_parity(ours, theirs)
    assert ours.sequences[:, 1].tolist() == [5, 5]


def test_guidance_scale_with_negative_prompt(tiny, ref, single):
    negative = tiny.tokenizer(["Paris is"], return_tensors="pt")
    ours, theirs = run_pair(
        tiny,
        ref,
        single,
        negative=(negative.input_ids, negative.attention_mask),
        guidance_scale=2.0,
        max_new_tokens=10,
    )
    assert_parity(ours, theirs)
    plain, _ = run_pair(tiny, ref, single, guidance_scale=2.0, max_new_tokens=10)
    assert not all(torch.allclose(a, b) for a, b in zip(ours.scores, plain.scores, strict=True))


@pytest.mark.parametrize("num_beams", [1, 3])
def test_stop_strings(tiny, ref, batch, num_beams):
    tokenizer = tiny.tokenizer
    with torch.no_grad():
        plain = ref.generate(**batch, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(plain[0, batch.input_ids.shape[1] :], skip_special_tokens=True)
    stop = text[4:7]
    assert len(stop.strip()) > 0
    ours, theirs = run_pair(
        tiny, ref, batch, tokenizer=tokenizer, stop_strings=[stop], max_new_tokens=12, num_beams=num_beams
    )
    assert_parity(ours, theirs)
    if num_beams == 1:
        assert ours.finish_reasons[0] == "stop_string"
        assert stop in tokenizer.decode(ours.generated_tokens[0])


def test_stop_strings_need_a_tokenizer(tiny, batch):
    config = merge(GenerationConfig(stop_strings=["x"], max_new_tokens=3), tiny.generation_config)
    with pytest.raises(ValueError, match="tokenizer"):
        iter_generate(tiny.model, batch.input_ids, batch.attention_mask, config=config)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_max_time(tiny, ref, batch, num_beams):
    # A budget far below one forward pass: both stop after the first step. Timing is not exact, so this
    # compares the finish behaviour, not the exact length.
    ours, theirs = run_pair(tiny, ref, batch, max_time=1e-4, max_new_tokens=60, num_beams=num_beams)
    generated_ours = ours.sequences.shape[1] - batch.input_ids.shape[1]
    generated_theirs = theirs.sequences.shape[1] - batch.input_ids.shape[1]
    assert generated_ours < 60 and generated_theirs < 60
    assert set(ours.finish_reasons) == {"time"}


# ---------------------------------------------------------------------------------------------------
# The embedded SmolLM2 (loaded once per session; the reference is the same transformers model object)


def _smollm_prompt(smollm):
    return smollm.tokenizer(["The capital of France is"], return_tensors="pt")


@pytest.mark.smollm
def test_smollm_greedy(smollm):
    ours, theirs = run_pair(smollm, smollm.model, _smollm_prompt(smollm), max_new_tokens=12)
    assert_parity(ours, theirs, atol=1e-4)


@pytest.mark.smollm
def test_smollm_beam_search(smollm):
    ours, theirs = run_pair(
        smollm, smollm.model, _smollm_prompt(smollm), max_new_tokens=8, num_beams=4, num_return_sequences=2
    )
    assert_parity(ours, theirs, atol=1e-4)


@pytest.mark.smollm
def test_smollm_seeded_sampling(smollm):
    ours, theirs = run_pair(
        smollm,
        smollm.model,
        _smollm_prompt(smollm),
        seed=42,
        do_sample=True,
        temperature=0.8,
        max_new_tokens=12,
    )
    assert_parity(ours, theirs, atol=1e-4)


@pytest.mark.smollm
def test_smollm_chat_template(smollm):
    messages = [{"role": "user", "content": "What is 2 + 2? Answer with a number."}]
    encoded = smollm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ours, theirs = run_pair(smollm, smollm.model, encoded, max_new_tokens=16)
    assert_parity(ours, theirs, atol=1e-4)
    answer = smollm.tokenizer.decode(ours.generated_tokens[0], skip_special_tokens=True)
    assert answer.strip(), "the instruct model should answer"
