"""`BatchedChains` gives every row bitwise the scores of its own request's processor list."""

from __future__ import annotations

import types

import pytest
import torch

from specwire.generation.processors import build_logits_processors
from specwire.generation.processors.batched import BatchedChains, RowChain

VOCAB = 257

CONFIGS = [
    dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9),
    dict(do_sample=True, temperature=1.3, top_p=0.5, min_p=0.05),
    dict(do_sample=True, top_k=3),
    dict(do_sample=True, temperature=0.123456789, repetition_penalty=1.3, top_p=0.999),
    dict(do_sample=False, repetition_penalty=0.8),
    dict(do_sample=True, min_p=0.2, temperature=2.0),
    dict(do_sample=True, top_p=0.1, top_k=17, repetition_penalty=1.1),
]


def _processors(fields: dict, *, num_beams: int = 1, pad_lengths=None):
    return build_logits_processors(
        types.SimpleNamespace(**fields),
        input_len=6,
        vocab_size=VOCAB,
        eos_token_ids=[2, 3],
        num_beams=num_beams,
        prompt_ids=torch.zeros((1, 6), dtype=torch.long),
        prompt_pad_lengths=pad_lengths,
    )


def _scores(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, VOCAB, generator=generator) * 4
    scores[:, :40] = scores[:, 40:80]  # ties everywhere
    scores[:, 7] = -float("inf")
    # Row 0: four equal tokens, the rest impossible: ascending masses 0.25, 0.5, 0.75, 1 hit top-p's
    # threshold exactly (`<=`, not `<`).
    scores[0] = -float("inf")
    scores[0, 10:14] = 0.0
    return scores


def _items(seed: int):
    """A mixed batch: every config, beam-sample rows (min_tokens_to_keep 3), padded rows, ragged lengths."""
    generator = torch.Generator().manual_seed(seed)
    items, own = [], []
    cases = [(fields, 1, None, 1 + i % 3) for i, fields in enumerate(CONFIGS)]
    cases.append((dict(do_sample=True, top_k=2, top_p=0.3, min_p=0.5), 2, None, 2))  # beam-sample keeps 3
    cases.append((dict(do_sample=False, repetition_penalty=1.5), 1, torch.tensor([2, 0]), 2))  # left padding
    for i, (fields, beams, pads, rows) in enumerate(cases):
        processors = _processors(fields, num_beams=beams, pad_lengths=pads)
        ids = torch.randint(0, VOCAB, (rows, 6 + 3 * i), generator=generator)
        scores = _scores(rows, seed * 100 + i)
        chain = RowChain.of(processors)
        assert chain is not None, fields
        items.append((chain, ids, scores))
        own.append(processors(ids, scores))
    return items, own


@pytest.mark.parametrize("threads", [1, 2])
def test_batched_rows_equal_their_own_processors_bitwise(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = BatchedChains()
        for seed in range(5):
            items, own = _items(seed)
            for got, want in zip(batched.apply(items), own, strict=True):
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)


def test_a_row_does_not_depend_on_its_neighbours():
    items, own = _items(0)
    batched = BatchedChains()
    for i in range(len(items)):
        alone = batched.apply([items[i]])[0]
        assert torch.equal(alone, own[i])
        reversed_batch = batched.apply(items[::-1])
        assert torch.equal(reversed_batch[len(items) - 1 - i], own[i])


def test_outputs_own_their_memory():
    items, _ = _items(1)
    outputs = BatchedChains().apply(items)
    assert all(out.untyped_storage().nbytes() == out.numel() * out.element_size() for out in outputs)


def test_parameters_are_gathered_once_per_batch_composition():
    items, _ = _items(2)
    batched = BatchedChains()
    batched.apply(items)
    first = batched._params
    batched.apply([(chain, ids, scores.clone()) for chain, ids, scores in items])
    assert batched._params is first  # same requests, same rows: reused
    batched.apply(items[1:])
    assert batched._params is not first


def test_unused_stages_are_skipped():
    batched = BatchedChains()
    chain = RowChain.of(_processors(dict(do_sample=True, temperature=0.5)))
    scores = _scores(2, 0)
    batched.apply([(chain, torch.zeros((2, 3), dtype=torch.long), scores)])
    assert set(batched._params) == {"temperature"}


@pytest.mark.parametrize(
    "fields",
    [
        dict(do_sample=False),  # nothing to do
        dict(do_sample=True, typical_p=0.5),
        dict(do_sample=True, top_k=5, epsilon_cutoff=0.01),
        dict(do_sample=False, no_repeat_ngram_size=2),
        dict(do_sample=False, min_new_tokens=3),
        dict(do_sample=True, top_p=0.9, renormalize_logits=True),
    ],
)
def test_other_processors_are_not_batchable(fields):
    assert RowChain.of(_processors(fields)) is None


def test_processors_out_of_order_are_not_batchable():
    temperature, top_k = _processors(dict(do_sample=True, temperature=0.5, top_k=4))
    assert RowChain.of([top_k, temperature]) is None
    assert RowChain.of([temperature, temperature]) is None
    assert RowChain.of([temperature, top_k]) is not None


def test_a_new_request_never_gets_an_old_requests_parameters():
    """Chains of ended requests are freed and their memory reused: the cache must not mistake them."""
    batched = BatchedChains()
    ids, scores = torch.zeros((2, 4), dtype=torch.long), _scores(2, 3)
    lists = [_processors(dict(do_sample=True, temperature=0.5 + step / 10, top_k=5 + step)) for step in range(30)]
    addresses = set()
    for processors in lists:
        chain = RowChain.of(processors)
        addresses.add(id(chain))
        got = batched.apply([(chain, ids, scores)])[0]
        del chain  # the request ends
        assert torch.equal(got, processors(ids, scores))
    assert len(addresses) < len(lists)  # the interpreter did reuse a freed chain's address
