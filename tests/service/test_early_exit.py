"""`assistant_early_exit` (self-speculation): the target's own first N decoder layers and its LM head draft,
sharing the target's weights. Greedy output equals plain greedy and transformers'
`generate(assistant_early_exit=N)` (ids exact, scores within 1e-4) through both schedulers, with the
`speculation` stats filled; speculative sampling with the early-exit draft keeps the target's distribution;
a layer count the model does not have is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest
import torch
import transformers

from specwire.client import SpecwireRpcError, TargetClient
from specwire.generation.config import GenerationConfig
from specwire.generation.loops.generate import drain
from specwire.generation.loops.speculative import iter_speculative
from specwire.generation.speculation.drafters import open_model_drafter
from specwire.generation.speculation.early_exit import early_exit_model
from specwire.generation.speculation.stats import SpeculationStats
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from tests.distributions import two_token_distribution
from tests.servers import threaded_server
from tests.tiny_models import build_tiny_llama

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6]
BATCH = [PROMPT, [20, 21, 22, 23, 20, 21, 22, 23]]
GREEDY = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-4-layers"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(str(model_dir), progress=False)


@pytest.fixture(scope="module", params=["batched", "sequential"])
def target(request, loaded):
    with threaded_server(lambda: build_target_server(loaded, scheduler=request.param)) as server:
        with TargetClient(server.address) as client:
            yield client


def _close(ours, theirs):
    assert len(ours) == len(theirs)
    for mine, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_greedy_equals_plain_greedy_and_transformers(target, model_dir, layers):
    ours = target.generate([PROMPT], assistant_early_exit=layers, num_assistant_tokens=4, **GREEDY)
    plain = target.generate([PROMPT], **GREEDY)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    want = reference.generate(torch.tensor([PROMPT]), assistant_early_exit=layers, num_assistant_tokens=4, **GREEDY)
    assert ours.sequences.tolist() == want.sequences.tolist() == plain.sequences.tolist()
    _close(ours.scores, want.scores)
    stats = ours.speculation
    assert stats.proposer == "early_exit" and stats.rounds > 0 and stats.drafted_tokens > 0, stats
    assert not ours.warnings


@pytest.mark.parametrize("weight", [0.3, 0.7])
def test_the_ensemble_weight_mixes_the_early_exit_draft_as_transformers_does(target, model_dir, weight):
    kwargs = dict(assistant_early_exit=1, assistant_ensemble_weight=weight, num_assistant_tokens=3, max_new_tokens=12)
    ours = target.generate([PROMPT], do_sample=False, **kwargs)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    want = reference.generate(torch.tensor([PROMPT]), do_sample=False, **kwargs)
    plain = reference.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12)
    assert ours.sequences.tolist() == want.tolist()
    assert want.tolist() != plain.tolist()  # lossy by design: the weight changes the output
    assert not ours.warnings


def test_a_batch_equals_plain_greedy(target):
    ours = target.generate(BATCH, assistant_early_exit=2, **GREEDY)
    assert ours.sequences.tolist() == target.generate(BATCH, **GREEDY).sequences.tolist()
    assert ours.speculation.proposer == "early_exit" and ours.speculation.accepted_tokens > 0


@pytest.mark.parametrize("layers", [0, 4, 9])
def test_a_layer_count_the_model_does_not_have_is_invalid_argument(target, layers):
    with pytest.raises(SpecwireRpcError) as info:
        target.generate([PROMPT], assistant_early_exit=layers, max_new_tokens=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config.assistant_early_exit" in str(info.value) and "1 to 3" in str(info.value)


def test_a_negative_layer_count_is_invalid_argument(target):
    with pytest.raises(SpecwireRpcError) as info:
        target.generate([PROMPT], assistant_early_exit=-1, max_new_tokens=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "assistant_early_exit" in str(info.value)


def test_proposers_that_contradict_it_are_invalid_argument(target):
    with pytest.raises(SpecwireRpcError) as info:
        target.generate([PROMPT], assistant_early_exit=2, proposer="prompt_lookup", max_new_tokens=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "assistant_early_exit" in str(info.value)
    with pytest.raises(SpecwireRpcError) as info:
        target.generate([PROMPT], proposer="early_exit", max_new_tokens=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "assistant_early_exit" in str(info.value)
    plain = target.generate([PROMPT], assistant_early_exit=2, proposer="none", max_new_tokens=3)
    assert [w for w in plain.warnings if w.field == "config.assistant_early_exit"]


def test_the_draft_shares_the_targets_weights_and_leaves_it_whole(loaded):
    model = loaded.model
    draft = early_exit_model(model, 2)
    ours = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert all(ours[name] == p.data_ptr() for name, p in draft.named_parameters())
    assert model.config.num_hidden_layers == 4 and model.model.config.num_hidden_layers == 4
    assert draft.config.num_hidden_layers == 2 and draft.model.config.num_hidden_layers == 2
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        full = model(input_ids=ids).logits
        early = draft(input_ids=ids).logits
        model.model.config.num_hidden_layers = 2  # transformers' own way: the first 2 layers of the model
        try:
            cut = model(input_ids=ids).logits
        finally:
            model.model.config.num_hidden_layers = 4
    torch.testing.assert_close(early, cut)
    assert not torch.allclose(early, full)


def test_speculative_sampling_keeps_the_targets_distribution(loaded):
    model, rows, top_k = loaded.model, 2000, 4
    config = GenerationConfig(do_sample=True, top_k=top_k, max_new_tokens=3, num_assistant_tokens=2, seed=11)
    draft = early_exit_model(model, 1)
    steps = iter_speculative(
        model,
        torch.tensor([PROMPT] * rows),
        config=config,
        open_drafter=lambda tokens, cfg: open_model_drafter(draft, tokens, cfg, loaded.vocab_size, True),
        stats=(stats := SpeculationStats()),
        generator=torch.Generator().manual_seed(3),
    )
    # The first token comes from the prompt's forward, the second from the first speculative round.
    pairs = [tuple(row) for row in drain(steps).sequences[:, len(PROMPT) : len(PROMPT) + 2].tolist()]
    assert stats.drafted_tokens > 0 and 0 < stats.accepted_tokens < stats.drafted_tokens
    want = two_token_distribution(model, PROMPT, top_k)
    got = {pair: pairs.count(pair) / rows for pair in set(pairs)}
    tv = 0.5 * sum(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want))
    assert tv < 0.08, tv
    # The draft's own distribution is far from the target's: accepting its tokens blindly would fail above.
    drafted = two_token_distribution(draft, PROMPT, top_k)
    gap = 0.5 * sum(abs(drafted.get(k, 0.0) - want.get(k, 0.0)) for k in set(drafted) | set(want))
    assert gap > 0.2, gap
    assert not set(got) - set(want)
