"""Draft/verify overlap on real servers: the draft service drafts the next block ahead while the
target verifies. Greedy outputs equal plain greedy (batch > 1, an EOS inside a block, the length limit
inside a block drafted ahead), seeded sampling gives the same tokens with overlap on and off, hits and
misses are counted in the `speculation` stats, a stream cancelled while a block is drafted ahead frees
its session, and a draft model with another vocabulary than the target's is refused."""

from __future__ import annotations

import functools
import threading
import time
from contextlib import ExitStack

import grpc
import pytest
import torch

from specwire.client import TargetClient
from specwire.draft.v1 import draft_service_pb2 as pb
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.models import load_model
from specwire.models.tokenizer_digest import tokenizer_digest
from specwire.target_service.__main__ import build_parser
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy, draft_overlap_choice
from tests.servers import threaded_server, wait_for
from tests.service.test_draft_service import Stream, feedback, servicer_of, start
from tests.tiny_models import build_tokenizer

BATCH = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6],
    [20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21],
    [40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41],
]
DRAFT = dict(proposer="draft_model", assistant_confidence_threshold=0.0)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def stack(loaded, tiny_model_dir, tiny_draft_dir):
    """Draft services with the target's own weights (every greedy draft accepted: many hits) and with
    other weights (rejections: misses), each with a target asking for overlap and one that does not."""
    with ExitStack() as stack:
        targets = {}
        for name, folder in (("same", tiny_model_dir), ("other", tiny_draft_dir)):
            draft = load_model(str(folder), progress=False)
            drafts = stack.enter_context(threaded_server(functools.partial(build_draft_server, draft)))
            for overlap in (True, False):
                policy = DraftPolicy(drafts.address, round_timeout_s=30.0, draft_overlap=overlap)
                stack.callback(policy.close)
                server = stack.enter_context(
                    threaded_server(functools.partial(build_target_server, loaded, drafting=policy))
                )
                targets[name, overlap] = (server.address, policy, drafts)
        yield targets


def _generate(address: str, rows, **kwargs):
    with TargetClient(address) as client:
        return client.generate(rows, **kwargs)


def _eventually(generate, counted, attempts: int = 5):
    """Whether a round counts as a hit or a miss depends on timing: the draft service must finish a
    block ahead before the target's feedback arrives, which a loaded machine may prevent in one run.
    Outputs never depend on it; so counters are asserted over a few runs, and a broken overlap fails
    every one of them."""
    for _ in range(attempts):
        out = generate()
        if counted(out.speculation):
            return out
    pytest.fail(f"no run of {attempts} counted as expected: {out.speculation}")


@pytest.mark.parametrize("draft", ["same", "other"])
@pytest.mark.parametrize("draft_length", [1, 4])
@pytest.mark.parametrize("max_new_tokens", [7, 13, 24])  # the limit falls inside blocks drafted ahead
def test_greedy_equals_plain_greedy_with_overlap(stack, draft, draft_length, max_new_tokens):
    address, policy, drafts = stack[draft, True]
    plain = _generate(address, BATCH, max_new_tokens=max_new_tokens, proposer="none")
    spec = _generate(address, BATCH, max_new_tokens=max_new_tokens, num_assistant_tokens=draft_length, **DRAFT)
    assert torch.equal(spec.sequences, plain.sequences)
    assert spec.finish_reasons == plain.finish_reasons
    s = spec.speculation
    assert s.fallback_reason == "" and s.rounds > 0
    if draft == "same" and max_new_tokens > 7:
        # the target's own weights: whole blocks accepted, bonus guessed
        kwargs = dict(max_new_tokens=max_new_tokens, num_assistant_tokens=draft_length, **DRAFT)
        _eventually(lambda: _generate(address, BATCH, **kwargs), lambda c: c.draft_ahead_hits > 0)
    assert s.draft_ahead_hits + s.draft_ahead_misses <= len(BATCH) * s.rounds
    wait_for(lambda: policy.open_streams == 0 and servicer_of(drafts).open_sessions == 0)


def test_eos_inside_a_block_drafted_ahead(stack, loaded):
    address, _, _ = stack["same", True]
    plain = _generate(address, BATCH, max_new_tokens=30, proposer="none")
    width = plain.sequences.shape[1] - max(len(r) for r in BATCH)
    # Pretend the 7th generated token of row 0 is an EOS: with blocks of 3, it lies in the third block,
    # which was drafted ahead.
    eos = plain.sequences[0, -width + 6].item()
    kwargs = dict(max_new_tokens=30, eos_token_id=[2, eos])
    plain_eos = _generate(address, BATCH, proposer="none", **kwargs)
    spec_eos = _eventually(
        lambda: _generate(address, BATCH, num_assistant_tokens=3, **DRAFT, **kwargs), lambda c: c.draft_ahead_hits > 0
    )
    assert torch.equal(spec_eos.sequences, plain_eos.sequences)
    assert spec_eos.finish_reasons == plain_eos.finish_reasons and "eos" in spec_eos.finish_reasons


def test_hits_and_misses_are_counted_and_overlap_off_has_none(stack):
    """Sampling with the target's own weights as the draft: whole blocks are accepted, and the bonus token
    drawn from the target is sometimes the draft's greedy guess (hits) and sometimes not (misses); the
    other draft model gets its blocks rejected (misses only). Without overlap nothing is drafted ahead,
    and the output is the same."""
    kwargs = dict(max_new_tokens=40, min_new_tokens=40, num_assistant_tokens=2, do_sample=True, seed=3, **DRAFT)
    on = _eventually(
        lambda: _generate(stack["same", True][0], BATCH[:1], **kwargs),
        lambda c: c.draft_ahead_hits > 0 and c.draft_ahead_misses > 0,
    )
    off = _generate(stack["same", False][0], BATCH[:1], **kwargs)
    assert torch.equal(on.sequences, off.sequences)
    assert off.speculation.draft_ahead_hits == off.speculation.draft_ahead_misses == 0
    assert on.speculation.rounds == off.speculation.rounds
    assert on.speculation.accepted_tokens == off.speculation.accepted_tokens
    rejected = _eventually(
        lambda: _generate(stack["other", True][0], BATCH, max_new_tokens=12, num_assistant_tokens=2, **DRAFT),
        lambda c: c.draft_ahead_misses > 0,
    )
    assert rejected.speculation.draft_ahead_hits == 0


@pytest.mark.parametrize("draft", ["same", "other"])
def test_seeded_sampling_is_the_same_with_overlap_on_and_off(stack, draft):
    """The blocks drafted ahead are the tokens serial drafting draws (the draft's generator is rewound
    or advanced as serial drafting leaves it), so a seed gives the same output either way."""
    kwargs = dict(max_new_tokens=24, do_sample=True, seed=5, top_k=20, num_assistant_tokens=3, **DRAFT)
    on = _eventually(
        lambda: _generate(stack[draft, True][0], BATCH[:1], **kwargs),
        lambda c: c.draft_ahead_hits + c.draft_ahead_misses > 0,
    )
    again = _generate(stack[draft, True][0], BATCH[:1], **kwargs)
    off = _generate(stack[draft, False][0], BATCH[:1], **kwargs)
    assert torch.equal(on.sequences, again.sequences)
    assert torch.equal(on.sequences, off.sequences)


def test_cancel_while_drafting_ahead_frees_the_session(tiny_model_dir):
    """A stream cancelled (or half-closed) while its next block is drafted ahead: the drafting ahead stops
    at its next forward, the session closes, and the process keeps no thread."""
    draft = load_model(str(tiny_model_dir), progress=False)
    forwards = threading.Semaphore(0)
    ahead = threading.Event()  # set once the block asked for is answered: the forwards drafting ahead are slow
    original = draft.model.forward

    @functools.wraps(original)
    def slow_forward(*args, **kwargs):
        forwards.release()
        if ahead.is_set():
            time.sleep(0.1)  # a block of 40 drafted ahead takes 4 s: the stream ends mid-way
        return original(*args, **kwargs)

    draft.model.forward = slow_forward
    with threaded_server(lambda: build_draft_server(draft)) as running:
        servicer = servicer_of(running)
        config = {"eos_token_id": 2, "assistant_confidence_threshold": 0.0}
        warm = Stream(running.address)  # the model thread and the client's threads start once
        warm.send(start([[5, 6, 7]], pb.DRAFT_METHOD_MODEL, config, num_tokens=1))
        warm.close()
        wait_for(lambda: servicer.open_sessions == 0)
        threads = threading.active_count()
        for ending in ("cancel", "half-close", "channel"):
            stream = Stream(running.address)
            start_message = start([[5, 6, 7, 8]], pb.DRAFT_METHOD_MODEL, config, num_tokens=40)
            start_message.start.overlap = True
            ahead.clear()
            stream.send(start_message)
            ahead.set()
            while forwards.acquire(blocking=False):
                pass
            assert forwards.acquire(timeout=10)  # drafting ahead has begun
            if ending == "cancel":
                stream.responses.cancel()
            elif ending == "half-close":
                stream.close()
            else:
                stream.channel.close()
            wait_for(lambda: servicer.open_sessions == 0)
            stream.close()
            # The model thread is free again (the drafting ahead stopped): a new session answers at once.
            probe = Stream(running.address)
            began = time.monotonic()
            probe.send(start([[5, 6, 7]], pb.DRAFT_METHOD_MODEL, config, num_tokens=1))
            assert time.monotonic() - began < 2.0
            probe.close()
        wait_for(lambda: servicer.open_sessions == 0 and threading.active_count() <= threads)


def test_drafting_ahead_gives_way_to_another_sessions_answer(tiny_model_dir):
    """One session drafting a long block ahead does not hold the model thread from another session's real
    work: that waits at most one draft forward."""
    draft = load_model(str(tiny_model_dir), progress=False)
    forwards = threading.Semaphore(0)
    original = draft.model.forward

    @functools.wraps(original)
    def slow_forward(*args, **kwargs):
        forwards.release()
        time.sleep(0.1)  # 40 tokens drafted ahead: 4 s
        return original(*args, **kwargs)

    draft.model.forward = slow_forward
    config = {"eos_token_id": 2, "assistant_confidence_threshold": 0.0}
    with threaded_server(lambda: build_draft_server(draft)) as running:
        busy, other = Stream(running.address), Stream(running.address)
        message = start([[5, 6, 7, 8]], pb.DRAFT_METHOD_MODEL, config, num_tokens=40)
        message.start.overlap = True
        busy.send(message)
        while forwards.acquire(blocking=False):
            pass
        assert forwards.acquire(timeout=10)  # drafting ahead has begun
        began = time.monotonic()
        other.send(start([[9, 10, 11]], pb.DRAFT_METHOD_MODEL, config, num_tokens=2))
        assert time.monotonic() - began < 2.0
        for stream in (busy, other):
            stream.close()
        wait_for(lambda: servicer_of(running).open_sessions == 0)


def test_a_block_drafted_ahead_is_cut_or_extended_to_the_length_asked(tiny_model_dir):
    draft = load_model(str(tiny_model_dir), progress=False)
    config = {"eos_token_id": 2, "assistant_confidence_threshold": 0.0}
    with threaded_server(lambda: build_draft_server(draft)) as running:
        serial, ahead = Stream(running.address), Stream(running.address)
        first = start([[5, 6, 7, 8]], pb.DRAFT_METHOD_MODEL, config, num_tokens=3)
        answers = [serial.send(first)]
        first.start.overlap = True
        answers.append(ahead.send(first))
        assert answers[0].rows[0].token_ids == answers[1].rows[0].token_ids
        prefix = [5, 6, 7, 8]
        outcomes = []
        for length in (5, 2, 6, 1, 3):
            block = list(answers[0].rows[0].token_ids)
            with torch.inference_mode():
                guess = int(draft.model(torch.tensor([prefix + block])).logits[0, -1].argmax())
            prefix += block + [guess]
            time.sleep(0.2)  # the target verifies: the block is drafted ahead meanwhile
            answers = [stream.send(feedback([len(block)], [[guess]], num_tokens=length)) for stream in (serial, ahead)]
            assert list(answers[1].rows[0].token_ids) == list(answers[0].rows[0].token_ids)
            assert len(answers[1].rows[0].token_ids) == length
            outcomes.append(answers[1].rows[0].ahead)
        assert set(outcomes) == {pb.DRAFT_AHEAD_HIT}
        assert {a.ahead for a in answers[0].rows} == {pb.DRAFT_AHEAD_UNSPECIFIED}
        serial.close()
        ahead.close()


def test_overlap_with_prompt_lookup_is_refused(tiny_model_dir):
    with threaded_server(lambda: build_draft_server(None)) as running:
        stream = Stream(running.address)
        message = start([[1, 2]], pb.DRAFT_METHOD_PROMPT_LOOKUP)
        message.start.overlap = True
        with pytest.raises(grpc.RpcError) as info:
            stream.send(message)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "start.overlap" in info.value.details()
        stream.close()


def test_a_draft_model_with_another_vocabulary_is_refused(stack, loaded):
    """The target sends its tokenizer's digest: a draft service whose model has another vocabulary refuses
    the stream (naming both sizes), and the request decodes without drafts, saying why."""
    _, _, drafts = stack["other", True]  # same tokenizer as the target: accepted (the tests above)
    stream = Stream(drafts.address)
    message = start([[5, 6, 7]], pb.DRAFT_METHOD_MODEL)
    other = build_tokenizer(vocab_size=300)
    message.start.tokenizer_size, message.start.tokenizer_digest = len(other.get_vocab()), tokenizer_digest(other)
    with pytest.raises(grpc.RpcError) as info:
        stream.send(message)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another vocabulary" in info.value.details()
    assert f"{len(other.get_vocab())}" in info.value.details() and "378" in info.value.details()
    stream.close()
    # Through a target whose tokenizer differs from the draft's: it falls back and says why.
    with ExitStack() as stack_:
        impostor = load_model(str(_folder_with_tokenizer(loaded, other)), progress=False)
        policy = DraftPolicy(drafts.address, round_timeout_s=30.0)
        stack_.callback(policy.close)
        server = stack_.enter_context(threaded_server(lambda: build_target_server(impostor, drafting=policy)))
        # 8 tokens: a request starts with time off (`SpeculationController.look_back`), its first look-back opens
        # the stream.
        output = _generate(server.address, [[5, 6, 7]], max_new_tokens=8, **DRAFT)
    assert "another vocabulary" in output.speculation.fallback_reason


def _folder_with_tokenizer(loaded, tokenizer):
    import tempfile

    folder = tempfile.mkdtemp(prefix="specwire-impostor-")
    loaded.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_draft_overlap_flag():
    parse = build_parser().parse_args
    assert parse([]).draft_overlap == "auto"
    assert parse(["--no-draft-overlap"]).draft_overlap == "off"
    assert parse(["--draft-overlap", "on"]).draft_overlap == "on"
    with pytest.raises(SystemExit):
        parse(["--draft-overlap", "yes"])


@pytest.mark.parametrize(
    "mode, address, device, overlap",
    [
        # auto: a draft service on this machine shares a CPU target's cores (drafting ahead slows verification).
        ("auto", "127.0.0.1:50053", "cpu", False),
        ("auto", "localhost:50053", "cpu", False),
        ("auto", "[::1]:50053", "cpu", False),
        ("auto", "unix:/tmp/draft.sock", "cpu", False),
        ("auto", "ipv4:127.0.0.1:1,127.0.0.2:2", "cpu", False),
        # ... and not where it computes apart: another host, or a target on an accelerator.
        ("auto", "draft.specwire.svc:50053", "cpu", True),
        ("auto", "dns:///draft:50053", "cpu", True),
        ("auto", "ipv4:127.0.0.1:1,10.0.0.2:2", "cpu", True),
        ("auto", "127.0.0.1:50053", "cuda:0", True),
        # on and off are what they say (pinned cores: on).
        ("on", "127.0.0.1:50053", "cpu", True),
        ("off", "draft:50053", "cuda", False),
    ],
)
def test_draft_overlap_choice(mode, address, device, overlap):
    chosen, why = draft_overlap_choice(mode, address, device)
    assert chosen is overlap
    assert why.startswith("auto:") if mode == "auto" else why == f"--draft-overlap {mode}"
    if mode == "auto" and not overlap:
        assert address in why and "--draft-overlap on" in why


def test_only_an_overlapped_remote_draft_opens_its_session_before_the_targets_prefill():
    """Prefilling the prompt on the draft service while the target does pays only where the draft service computes
    beside the target: the same choice as overlap (`draft_overlap_choice`)."""
    assert DraftPolicy("127.0.0.1:1", draft_overlap=True).prefills_apart("draft_model")
    assert not DraftPolicy("127.0.0.1:1", draft_overlap=False).prefills_apart("draft_model")
    assert not DraftPolicy("127.0.0.1:1", draft_overlap=True).prefills_apart("prompt_lookup")


def test_requests_drafting_with_one_draft_service_count_each_other(stack, monkeypatch):
    """A remote draft's controller reads how many other requests draft with the same draft service now
    (`draft_load`, what its look-backs make wait): concurrent requests see each other, none counts itself."""
    address, policy, _ = stack["other", False]
    seen: list[float] = []
    make = policy.controller

    def recording(*args, **kwargs):
        controller = make(*args, **kwargs)
        if controller is not None and controller.draft_load is not None:
            draft_load = controller.draft_load
            controller.draft_load = lambda: seen.append(draft_load()) or seen[-1]
        return controller

    monkeypatch.setattr(policy, "controller", recording)
    together = threading.Barrier(3)

    def one(row):
        together.wait()
        _generate(address, [row], max_new_tokens=40, min_new_tokens=40, proposer="draft_model")

    threads = [threading.Thread(target=one, args=(row,)) for row in BATCH]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen and 1 <= max(seen) <= 2, seen
    _generate(address, BATCH[:1], max_new_tokens=40, min_new_tokens=40, proposer="draft_model")
    assert seen[-1] == 0  # alone again: the finished requests are not counted
