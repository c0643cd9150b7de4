"""`speculation_type="dflash"`: a DFlash assistant loaded next to the target (`--dflash-model`) drafts a block a
round from the target's hidden states at its `target_layer_ids`. Greedy output equals plain greedy and
transformers' `generate(assistant_model=..., speculation_type="dflash")` (ids exact, scores within 1e-4) through
both schedulers (the batched one routes these requests to its sequential lane), with the `speculation` stats filled;
every round drafts the tokens transformers' `DFlashTokenCandidateGenerator` drafts; `assistant_ensemble_weight`
mixes the DFlash draft as transformers does; speculative sampling keeps the target's distribution; a server without
an assistant, other values and contradicting proposers are INVALID_ARGUMENT naming `config.speculation_type`; an
assistant that does not fit the target is refused at start."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
import transformers
from transformers.generation import candidate_generator

from specwire.client import SpecwireRpcError, TargetClient
from specwire.generation.config import GenerationConfig
from specwire.generation.loops.generate import drain, iter_generate
from specwire.generation.loops.speculative import iter_speculative
from specwire.generation.speculation.dflash import dflash_hidden_layers, open_dflash_drafter
from specwire.generation.speculation.stats import SpeculationStats
from specwire.models import ModelLoadError, load_model
from specwire.models.dflash_assistant import load_dflash_assistant
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.__main__ import main as target_main
from specwire.target_service.drafting import DraftPolicy
from tests.distributions import two_token_distribution
from tests.servers import threaded_server
from tests.tiny_models import build_tiny_dflash_assistant, build_tiny_llama

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6], [50, 60, 70, 80, 90], [3, 17, 42, 99, 120, 7, 8]]
GREEDY = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
DFLASH = dict(speculation_type="dflash")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama4"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def assistant_dir(tmp_path_factory):
    return build_tiny_dflash_assistant(tmp_path_factory.mktemp("tiny-dflash"))


@pytest.fixture(scope="module")
def loaded(target_dir):
    return load_model(str(target_dir), progress=False)


@pytest.fixture(scope="module")
def assistant(assistant_dir, loaded):
    return load_dflash_assistant(str(assistant_dir), loaded, progress=False)


@pytest.fixture(scope="module")
def reference(target_dir, assistant_dir):
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    return target, transformers.AutoModel.from_pretrained(assistant_dir).eval()


@pytest.fixture(scope="module", params=["batched", "sequential"])
def target(request, loaded, assistant):
    drafting = DraftPolicy(dflash_model=assistant)
    with threaded_server(lambda: build_target_server(loaded, scheduler=request.param, drafting=drafting)) as server:
        with TargetClient(server.address) as client:
            yield client


def _close(ours, theirs):
    assert len(ours) == len(theirs)
    for mine, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4)


def _transformers_drafts(reference, prompt, monkeypatch, **kwargs) -> tuple[list[list[int]], list[int]]:
    """transformers' DFlash generation: the drafts of every round (the first, empty, left out) and the ids."""
    model, assistant = reference
    drafts: list[list[int]] = []
    original = candidate_generator.DFlashTokenCandidateGenerator.get_candidates

    def recorded(self, input_ids, **kw):
        candidates, logits = original(self, input_ids, **kw)
        drafts.append(candidates[0, input_ids.shape[1] :].tolist())
        return candidates, logits

    with monkeypatch.context() as patch:
        patch.setattr(candidate_generator.DFlashTokenCandidateGenerator, "get_candidates", recorded)
        ids = model.generate(torch.tensor([prompt]), assistant_model=assistant, **DFLASH, **kwargs)
    assert drafts[0] == []  # transformers' first round drafts nothing
    return drafts[1:], ids[0].tolist()


def _our_drafts(model, assistant, prompt, config, attention_mask=None):
    """specwire's speculative loop with the DFlash drafter: the drafts of every round, the ids and the stats."""
    drafts: list[list[int]] = []

    def open_drafter(tokens, cfg):
        probs = bool(cfg.do_sample) or cfg.assistant_ensemble_weight is not None  # as the target service asks
        drafter = open_dflash_drafter(assistant, model, tokens, cfg, model.config.vocab_size, probs)
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
        draft_length=assistant.config.block_size - 1,
        hidden_layers=dflash_hidden_layers(assistant),
    )
    return drafts, drain(steps).sequences[0].tolist(), stats


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_plain_greedy_and_transformers(target, reference, prompt):
    model, assistant = reference
    ours = target.generate([prompt], **DFLASH, **GREEDY)
    plain = target.generate([prompt], **GREEDY)
    want = model.generate(torch.tensor([prompt]), assistant_model=assistant, **DFLASH, **GREEDY)
    assert ours.sequences.tolist() == want.sequences.tolist() == plain.sequences.tolist()
    _close(ours.scores, want.scores)
    stats = ours.speculation
    assert stats.proposer == "dflash" and stats.rounds > 0 and stats.drafted_tokens > 0, stats
    # block_size 4: three drafts a round (fewer only where max_new_tokens leaves less room).
    assert stats.rounds < stats.drafted_tokens <= 3 * stats.rounds, stats
    assert not ours.warnings


@pytest.mark.parametrize("weight", [None, 0.3])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_round_drafts_what_transformers_drafts(reference, prompt, weight, monkeypatch):
    """Greedy drafts are all rejected by the tiny target; with an ensemble weight some are kept, so later rounds
    read contexts of several positions."""
    kwargs = dict(max_new_tokens=12, do_sample=False, assistant_ensemble_weight=weight)
    theirs, want = _transformers_drafts(reference, prompt, monkeypatch, **kwargs)
    model, assistant = reference
    ours, ids, stats = _our_drafts(model, assistant, prompt, GenerationConfig(**kwargs, **DFLASH))
    assert weight is None or stats.accepted_tokens > 0
    assert ids == want
    # specwire asks for no more drafts than fit under max_length: its last rounds may ask for fewer.
    assert len(ours) >= len(theirs) - 1 and ours == [t[: len(o)] for o, t in zip(ours, theirs, strict=False)]
    assert stats.drafted_tokens == sum(len(o) for o in ours) > 0


def test_a_context_past_the_assistants_sliding_window_drafts_what_transformers_drafts(reference, monkeypatch):
    """The tiny assistant's layer attends within a sliding window of 64: its `DFlashCache` is cropped past it."""
    prompt = torch.randint(4, 370, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=2, pad_token_id=0)
    theirs, want = _transformers_drafts(reference, prompt, monkeypatch, **kwargs)
    model, assistant = reference
    ours, ids, stats = _our_drafts(model, assistant, prompt, GenerationConfig(**kwargs, **DFLASH))
    assert ids == want and len(ids) == len(prompt) + 40
    assert len(ours) >= len(theirs) - 1 and ours == [t[: len(o)] for o, t in zip(ours, theirs, strict=False)]


def test_a_chunked_prefill_drafts_the_same(target, reference):
    chunked = target.generate([PROMPTS[2]], prefill_chunk_size=3, **DFLASH, **GREEDY)
    whole = target.generate([PROMPTS[2]], **DFLASH, **GREEDY)
    assert chunked.sequences.tolist() == whole.sequences.tolist()
    assert chunked.speculation.drafted_tokens == whole.speculation.drafted_tokens > 0
    model, assistant = reference  # the chunks' hidden states are joined: every round drafts the same
    chunks = GenerationConfig(max_new_tokens=12, do_sample=False, prefill_chunk_size=3, **DFLASH)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, **DFLASH)
    drafts = _our_drafts(model, assistant, PROMPTS[2], config)[0]
    assert _our_drafts(model, assistant, PROMPTS[2], chunks)[0] == drafts and len(set(map(tuple, drafts))) > 1


@pytest.mark.parametrize("mask", [[1] * 7 + [0, 0], [0, 0] + [1] * 7, [1, 1, 1, 0, 0, 1, 1, 1, 1]])
def test_padding_leaves_the_drafts_as_without_it(reference, mask):
    """The drafter takes the prompt's hidden states where the mask says, at the prompt's own positions: with left
    padding the drafts are those of the prompt alone; padding elsewhere changes the target's tokens (as in plain
    decoding), and the output stays plain decoding's."""
    model, assistant = reference
    prompt, config = PROMPTS[2], GenerationConfig(max_new_tokens=12, do_sample=False, **DFLASH)
    tokens = iter(prompt)
    padded = [next(tokens) if m else 0 for m in mask]
    alone, ids, _ = _our_drafts(model, assistant, prompt, config)
    ours, padded_ids, _ = _our_drafts(model, assistant, padded, config, attention_mask=mask)
    plain = drain(iter_generate(model, torch.tensor([padded]), torch.tensor([mask]), config=config)).sequences
    assert padded_ids == plain[0].tolist()  # lossless
    if mask[0] == 0:  # left padding: the same tokens, so the same drafts
        assert padded_ids[len(mask) :] == ids[len(prompt) :] and ours == alone
        assert len(set(map(tuple, alone))) > 1  # drafts that depend on the context


def test_a_batch_with_padding_equals_plain_greedy(target):
    ours = target.generate(PROMPTS, **DFLASH, **GREEDY)
    plain = target.generate(PROMPTS, **GREEDY)
    assert ours.sequences.tolist() == plain.sequences.tolist()
    _close(ours.scores, plain.scores)
    assert ours.speculation.proposer == "dflash" and ours.speculation.drafted_tokens > 0


@pytest.mark.parametrize("weight", [0.3, 0.7])
def test_the_ensemble_weight_mixes_the_dflash_draft_as_transformers_does(target, reference, weight):
    model, assistant = reference
    kwargs = dict(assistant_ensemble_weight=weight, max_new_tokens=12, do_sample=False, **DFLASH)
    accepted = 0
    for prompt in PROMPTS:
        ours = target.generate([prompt], **kwargs)
        want = model.generate(torch.tensor([prompt]), assistant_model=assistant, **kwargs)
        assert ours.sequences.tolist() == want.tolist()
        assert ours.speculation.proposer == "dflash" and not ours.warnings
        accepted += ours.speculation.accepted_tokens
    # The mixed acceptance keeps drafts the target alone would not: rounds with contexts of several positions.
    assert accepted > 0


def test_seeded_sampling_repeats_itself(target):
    kwargs = dict(do_sample=True, top_k=8, seed=5, max_new_tokens=12, **DFLASH)
    first = target.generate(PROMPTS, **kwargs)
    assert first.sequences.tolist() == target.generate(PROMPTS, **kwargs).sequences.tolist()
    assert first.speculation.proposer == "dflash" and first.speculation.drafted_tokens > 0


def test_speculative_sampling_keeps_the_targets_distribution(loaded, assistant):
    # top_k 8: the tiny assistant's draft shares part of the target's support (some drafts accepted, most not).
    model, rows, top_k, prompt = loaded.model, 3000, 8, PROMPTS[2]
    config = GenerationConfig(do_sample=True, top_k=top_k, max_new_tokens=3, seed=11, **DFLASH)
    steps = iter_speculative(
        model,
        torch.tensor([prompt] * rows),
        config=config,
        open_drafter=lambda tokens, cfg: open_dflash_drafter(assistant, model, tokens, cfg, loaded.vocab_size, True),
        stats=(stats := SpeculationStats()),
        draft_length=1,
        generator=torch.Generator().manual_seed(3),
        hidden_layers=dflash_hidden_layers(assistant),
    )
    # The first token comes from the prompt's forward, the second from the first DFlash round.
    pairs = [tuple(row) for row in drain(steps).sequences[:, len(prompt) : len(prompt) + 2].tolist()]
    assert stats.drafted_tokens > 0 and 0 < stats.accepted_tokens < stats.drafted_tokens, stats
    want = two_token_distribution(model, prompt, top_k)
    got = {pair: pairs.count(pair) / rows for pair in set(pairs)}
    tv = 0.5 * sum(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want))
    assert tv < 0.08, tv
    assert not set(got) - set(want)


def _refused(client, **kwargs) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        client.generate([PROMPTS[0]], max_new_tokens=3, **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert info.value.violations[0].field == "config.speculation_type", info.value
    return info.value


def test_values_and_proposers_that_contradict_it_are_invalid_argument(target):
    assert "only speculation type is 'dflash'" in str(_refused(target, speculation_type="eagle"))
    assert "prompt_lookup_num_tokens" in str(_refused(target, prompt_lookup_num_tokens=3, **DFLASH))
    assert "proposer prompt_lookup" in str(_refused(target, proposer="prompt_lookup", **DFLASH))
    assert "set speculation_type='dflash'" in str(_refused(target, proposer="dflash"))
    plain = target.generate([PROMPTS[0]], proposer="none", max_new_tokens=3, **DFLASH)
    assert [w for w in plain.warnings if w.field == "config.speculation_type"] and plain.speculation.proposer == "none"
    # transformers ignores an assistant with beam search (a log line): specwire decodes plainly and says so.
    beams = target.generate([PROMPTS[0]], num_beams=2, max_new_tokens=3, **DFLASH)
    assert [w for w in beams.warnings if w.field == "config.speculation_type"] and beams.speculation.fallback_reason


def test_a_server_without_an_assistant_refuses_it(loaded):
    with threaded_server(lambda: build_target_server(loaded, scheduler="sequential")) as server:
        with TargetClient(server.address) as client:
            message = str(_refused(client, **DFLASH))
    assert "--dflash-model" in message and "unset speculation_type" in message


def test_an_assistant_that_does_not_fit_the_target_is_refused_at_start(tmp_path, target_dir, assistant_dir):
    two_layers = load_model(str(build_tiny_llama(tmp_path / "llama2")), progress=False)
    with pytest.raises(ModelLoadError, match=r"target_layer_ids \[0, 2\] are not all layers of the target"):
        load_dflash_assistant(str(assistant_dir), two_layers, progress=False)
    wide = load_model(str(build_tiny_llama(tmp_path / "wide", num_hidden_layers=4, hidden_size=64)), progress=False)
    with pytest.raises(ModelLoadError, match="hidden size 32 differs from the target's"):
        load_dflash_assistant(str(assistant_dir), wide, progress=False)
    with pytest.raises(ModelLoadError, match="no DFlash assistant"):  # a causal LM is no DFlash assistant
        load_dflash_assistant(str(target_dir), wide, progress=False)
    two_dir = str(tmp_path / "llama2")
    with pytest.raises(SystemExit, match=r"--dflash-model .*target_layer_ids \[0, 2\] are not all layers"):
        target_main(["--model", two_dir, "--port", "0", "--dflash-model", str(assistant_dir)])
    with pytest.raises(SystemExit, match="--dflash-model cannot run with tensor parallelism"):  # before loading
        target_main(["--model", two_dir, "--tensor-parallel", "2", "--dflash-model", str(assistant_dir)])


@pytest.mark.parametrize("scheduler, thread", [("batched", "specwire-lane"), ("sequential", "specwire-model")])
def test_the_batched_scheduler_runs_it_in_its_sequential_lane(loaded, assistant, scheduler, thread):
    """The packed forward returns no hidden states: the batched scheduler routes DFlash requests to its lane,
    whose thread runs the assistant's forwards (the sequential scheduler: the model thread)."""
    names: list[str] = []
    original = assistant.forward

    def forward(*args, **kwargs):
        names.append(threading.current_thread().name)
        return original(*args, **kwargs)

    drafting = DraftPolicy(dflash_model=assistant)
    assistant.forward = forward
    try:
        with threaded_server(lambda: build_target_server(loaded, scheduler=scheduler, drafting=drafting)) as server:
            with TargetClient(server.address) as client:
                client.generate([PROMPTS[1]], max_new_tokens=8, **DFLASH)
    finally:
        del assistant.forward
    assert names and all(n.startswith(thread) for n in names), set(names)
