"""`use_mtp` (multi-token prediction): the target's own MTP layers draft from its last hidden states, in the
target's process. Greedy output equals plain greedy and transformers' `generate(use_mtp=True)` (ids exact,
scores within 1e-4) through both schedulers, with the `speculation` stats filled; every round drafts the tokens
transformers' `MTPCandidateGenerator` drafts (one MTP layer from the checkpoint, and two layers, whose cache
transformers corrects after a rejection); `assistant_ensemble_weight` mixes the MTP draft as transformers does;
speculative sampling with the MTP draft keeps the target's distribution and a seeded request repeats itself; a
model without MTP layers (or without their weights) is INVALID_ARGUMENT naming `config.use_mtp`."""

from __future__ import annotations

import grpc
import pytest
import torch
import transformers
from transformers.generation import candidate_generator
from transformers.modeling_layers import MtpModel

from specwire.client import SpecwireRpcError, TargetClient
from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.config import GenerationConfig
from specwire.generation.loops.generate import drain
from specwire.generation.loops.speculative import iter_speculative
from specwire.generation.speculation.mtp import open_mtp_drafter
from specwire.generation.speculation.stats import SpeculationStats
from specwire.models import load_model
from specwire.models.mtp_layers import mtp_model_for
from specwire.target_service.__main__ import build_server as build_target_server
from tests.distributions import two_token_distribution
from tests.servers import threaded_server
from tests.tiny_models import build_mtp_layers, build_tiny_llama, build_tiny_mtp_model

# The tiny model repeats a token after the first prompt (its MTP drafts are accepted), alternates two tokens after
# the second (rejected), and mixes both after the third.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6], [50, 60, 70, 80, 90], [3, 17, 42, 99, 120, 7, 8]]
GREEDY = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_mtp_model(tmp_path_factory.mktemp("tiny-mtp"))


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(str(model_dir), progress=False)


@pytest.fixture(scope="module")
def reference(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module", params=["batched", "sequential"])
def target(request, loaded):
    with threaded_server(lambda: build_target_server(loaded, scheduler=request.param)) as server:
        with TargetClient(server.address) as client:
            yield client


def _close(ours, theirs):
    assert len(ours) == len(theirs)
    for mine, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4)


def _transformers_drafts(model, prompt, monkeypatch, **kwargs) -> tuple[list[list[int]], list[int]]:
    """transformers' `generate(use_mtp=True)`: the drafts of every round (the first, empty, left out) and the ids."""
    drafts: list[list[int]] = []
    original = candidate_generator.MTPCandidateGenerator.get_candidates

    def recorded(self, input_ids, **kw):
        candidates, logits = original(self, input_ids, **kw)
        drafts.append(candidates[0, input_ids.shape[1] :].tolist())
        return candidates, logits

    with monkeypatch.context() as patch:
        patch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", recorded)
        ids = model.generate(torch.tensor([prompt]), use_mtp=True, **kwargs)
    assert drafts[0] == []  # transformers' first round drafts nothing
    return drafts[1:], ids[0].tolist()


def _our_drafts(model, mtp, prompt, config, attention_mask=None) -> tuple[list[list[int]], list[int], SpeculationStats]:
    """specwire's speculative loop with the MTP drafter over `mtp`: the drafts of every round and the ids."""
    drafts: list[list[int]] = []

    def open_drafter(tokens, cfg):
        drafter = open_mtp_drafter(mtp, tokens, cfg, model.config.vocab_size, bool(cfg.do_sample))
        propose = drafter.propose

        def recorded(num_tokens):
            proposal = propose(num_tokens)
            drafts.append(proposal.tokens[0])
            return proposal

        drafter.propose = recorded
        return drafter

    steps = iter_speculative(
        model,
        torch.tensor([prompt]),
        None if attention_mask is None else torch.tensor([attention_mask]),
        config=config,
        open_drafter=open_drafter,
        stats=(stats := SpeculationStats()),
        draft_length=len(mtp.layers),
    )
    return drafts, drain(steps).sequences[0].tolist(), stats


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_plain_greedy_and_transformers(target, reference, prompt):
    ours = target.generate([prompt], use_mtp=True, **GREEDY)
    plain = target.generate([prompt], **GREEDY)
    want = reference.generate(torch.tensor([prompt]), use_mtp=True, **GREEDY)
    assert ours.sequences.tolist() == want.sequences.tolist() == plain.sequences.tolist()
    _close(ours.scores, want.scores)
    stats = ours.speculation
    assert stats.proposer == "mtp" and stats.rounds > 0 and stats.drafted_tokens > 0, stats
    assert not ours.warnings


def test_drafts_are_accepted_and_rejected_as_the_target_decides(target):
    repeats = target.generate([PROMPTS[0]], use_mtp=True, **GREEDY).speculation
    alternates = target.generate([PROMPTS[1]], use_mtp=True, **GREEDY).speculation
    # One MTP layer: one draft a round; a repeated token is drafted right, an alternation not. The last round
    # drafts the token at max_length (transformers' MTP drafts uncapped), which the cut there counts as the
    # target's token, as transformers recounts its matches after that cut.
    assert repeats.accepted_tokens == repeats.drafted_tokens - 1 == repeats.rounds - 1 > 0, repeats
    assert alternates.accepted_tokens == 0 and alternates.drafted_tokens > 0, alternates


@pytest.mark.parametrize("weight", [0.3, 0.7])
def test_the_ensemble_weight_mixes_the_mtp_draft_as_transformers_does(target, reference, weight):
    kwargs = dict(use_mtp=True, assistant_ensemble_weight=weight, max_new_tokens=12, do_sample=False)
    changed = 0
    for prompt in PROMPTS:
        ours = target.generate([prompt], **kwargs)
        assert ours.sequences.tolist() == reference.generate(torch.tensor([prompt]), **kwargs).tolist()
        assert ours.speculation.proposer == "mtp" and not ours.warnings
        changed += ours.sequences.tolist() != target.generate([prompt], max_new_tokens=12).sequences.tolist()
    assert changed  # lossy by design: the weight changes the output of the alternating prompt


def test_seeded_sampling_repeats_itself(target):
    kwargs = dict(use_mtp=True, do_sample=True, top_k=8, seed=5, max_new_tokens=12)
    first = target.generate(PROMPTS, **kwargs)
    assert first.sequences.tolist() == target.generate(PROMPTS, **kwargs).sequences.tolist()
    assert first.speculation.proposer == "mtp" and first.speculation.drafted_tokens > 0


def test_a_batch_with_padding_equals_plain_greedy(target):
    ours = target.generate(PROMPTS, use_mtp=True, **GREEDY)
    plain = target.generate(PROMPTS, **GREEDY)
    assert ours.sequences.tolist() == plain.sequences.tolist()
    _close(ours.scores, plain.scores)
    assert ours.speculation.proposer == "mtp" and ours.speculation.accepted_tokens > 0


def test_a_chunked_prefill_and_padding_that_is_not_left_padding_draft_the_same(target):
    chunked = target.generate([PROMPTS[2]], use_mtp=True, prefill_chunk_size=3, **GREEDY)
    whole = target.generate([PROMPTS[2]], use_mtp=True, **GREEDY)
    assert chunked.sequences.tolist() == whole.sequences.tolist()
    assert chunked.speculation.accepted_tokens == whole.speculation.accepted_tokens > 0
    # Right padding (the sequential lane runs it): outputs as plain decoding's.
    padded = target.generate([PROMPTS[2] + [0, 0]], attention_mask=[[1] * 7 + [0, 0]], use_mtp=True, **GREEDY)
    plain = target.generate([PROMPTS[2] + [0, 0]], attention_mask=[[1] * 7 + [0, 0]], **GREEDY)
    assert padded.sequences.tolist() == plain.sequences.tolist()


@pytest.mark.parametrize("mask", [[1] * 7 + [0, 0], [0, 0] + [1] * 7, [1, 1, 1, 0, 0, 1, 1, 1, 1]])
def test_padding_leaves_the_drafts_as_without_it(reference, mask, monkeypatch):
    """The drafter takes the prompt's hidden states where the mask says: the drafts are those of the prompt
    alone, wherever its padding is (two attentive MTP layers: their drafts depend on every position fed)."""
    prompt, config = PROMPTS[2], GenerationConfig(max_new_tokens=12, do_sample=False, use_mtp=True)
    tokens = iter(prompt)
    padded = [next(tokens) if m else 0 for m in mask]
    monkeypatch.setattr(reference.config, "num_nextn_predict_layers", 2)
    mtp = _two_layer_mtp(reference)
    alone, ids, _ = _our_drafts(reference, mtp, prompt, config)
    ours, padded_ids, _ = _our_drafts(reference, mtp, padded, config, attention_mask=mask)
    assert ours == alone and padded_ids[len(mask) :] == ids[len(prompt) :]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_round_drafts_what_transformers_drafts(reference, loaded, prompt, monkeypatch):
    theirs, want = _transformers_drafts(reference, prompt, monkeypatch, max_new_tokens=12, do_sample=False)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, use_mtp=True)
    ours, ids, stats = _our_drafts(reference, mtp_model_for(loaded.model), prompt, config)
    assert ids == want
    # specwire asks for no more drafts than fit under max_length: its last rounds may ask for fewer.
    assert len(ours) >= len(theirs) - 1 and ours == [t[: len(o)] for o, t in zip(ours, theirs, strict=False)]
    assert stats.drafted_tokens == sum(len(o) for o in ours)


def _two_layer_mtp(model) -> MtpModel:
    """Two MTP layers over `model` (the checkpoint format of glm4_moe holds one), whose attention weighs enough
    that their drafts depend on what their caches hold (without transformers' correction after a rejection, the
    drafts of the third prompt differ)."""
    return build_mtp_layers(model, 2, seed=7, attention=20.0, mlp=0.3)


def test_two_mtp_layers_draft_and_correct_their_cache_as_transformers_does(reference, monkeypatch):
    monkeypatch.setattr(reference.config, "num_nextn_predict_layers", 2)  # `num_mtp_layers` in glm4_moe's config
    mtp = _two_layer_mtp(reference)  # its config (and each row's MtpCache) sized for two layers
    monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(lambda cls, main_model, **kwargs: mtp))
    corrected = 0
    for prompt in PROMPTS:
        theirs, want = _transformers_drafts(reference, prompt, monkeypatch, max_new_tokens=14, do_sample=False)
        config = GenerationConfig(max_new_tokens=14, do_sample=False, use_mtp=True)
        ours, ids, stats = _our_drafts(reference, mtp, prompt, config)
        assert ids == want
        assert len(ours) >= len(theirs) - 1 and ours == [t[: len(o)] for o, t in zip(ours, theirs, strict=False)]
        # Rounds that kept fewer than L - 1 = 1 drafts: the next round corrects the caches first.
        corrected += sum(1 for r in stats.round_log[:-1] if r.drafted and not r.accepted)
    assert corrected > 0


def test_speculative_sampling_keeps_the_targets_distribution(loaded):
    model, rows, top_k, prompt = loaded.model, 1500, 4, PROMPTS[2]
    config = GenerationConfig(do_sample=True, top_k=top_k, max_new_tokens=3, use_mtp=True, seed=11)
    mtp = mtp_model_for(model)
    steps = iter_speculative(
        model,
        torch.tensor([prompt] * rows),
        config=config,
        open_drafter=lambda tokens, cfg: open_mtp_drafter(mtp, tokens, cfg, loaded.vocab_size, True),
        stats=(stats := SpeculationStats()),
        draft_length=1,
        generator=torch.Generator().manual_seed(3),
    )
    # The first token comes from the prompt's forward, the second from the first MTP round.
    pairs = [tuple(row) for row in drain(steps).sequences[:, len(prompt) : len(prompt) + 2].tolist()]
    assert stats.drafted_tokens > 0 and 0 < stats.accepted_tokens < stats.drafted_tokens, stats
    want = two_token_distribution(model, prompt, top_k)
    got = {pair: pairs.count(pair) / rows for pair in set(pairs)}
    tv = 0.5 * sum(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want))
    assert tv < 0.08, tv
    assert not set(got) - set(want)


def test_proposers_that_contradict_it_are_invalid_argument(target):
    with pytest.raises(SpecwireRpcError) as info:
        target.generate([PROMPTS[0]], use_mtp=True, proposer="prompt_lookup", max_new_tokens=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "config.use_mtp" in str(info.value)
    with pytest.raises(SpecwireRpcError) as info:
        target.generate([PROMPTS[0]], proposer="mtp", max_new_tokens=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "use_mtp=True" in str(info.value)
    plain = target.generate([PROMPTS[0]], use_mtp=True, proposer="none", max_new_tokens=3)
    assert [w for w in plain.warnings if w.field == "config.use_mtp"] and plain.speculation.proposer == "none"


def test_a_model_without_mtp_layers_is_invalid_argument(tmp_path):
    llama = load_model(str(build_tiny_llama(tmp_path / "llama")), progress=False)
    with threaded_server(lambda: build_target_server(llama, scheduler="sequential")) as server:
        with TargetClient(server.address) as client:
            with pytest.raises(SpecwireRpcError) as info:
                client.generate([PROMPTS[0]], use_mtp=True, max_new_tokens=3)
            # transformers ignores use_mtp with beam search (a warning), whatever the model: so does specwire.
            beams = client.generate([PROMPTS[0]], use_mtp=True, num_beams=2, max_new_tokens=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = str(info.value)
    assert "config.use_mtp" in message and "no multi-token prediction layers" in message and "unset use_mtp" in message
    assert [w for w in beams.warnings if w.field == "config.use_mtp"] and beams.speculation.fallback_reason


def test_a_checkpoint_without_the_mtp_weights_is_invalid_argument(tmp_path, reference):
    reference.save_pretrained(tmp_path)  # a plain save drops the MTP layers (transformers skips them on load)
    stripped = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.raises(InvalidGenerationArgument) as info:
        mtp_model_for(stripped)
    assert info.value.violations[0].field == "config.use_mtp" and "could not be loaded" in str(info.value)
    with pytest.raises(InvalidGenerationArgument):  # remembered: no second load
        mtp_model_for(stripped)
