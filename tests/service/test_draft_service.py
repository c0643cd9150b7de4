"""DraftService on a real grpc.aio server: prompt lookup and draft-model sessions over one
bidirectional stream per request, rollback on feedback, and its error codes."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
import torch
import transformers

from specwire.common.v1 import common_pb2
from specwire.draft.v1 import draft_service_pb2 as pb
from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
from specwire.draft_service.__main__ import build_server
from specwire.wire.generation_config import dict_to_proto
from specwire.wire.tensors import tensor_from_proto
from tests.servers import threaded_server, wait_for


@pytest.fixture(scope="module")
def server(tiny_draft):
    with threaded_server(lambda: build_server(tiny_draft)) as running:
        yield running


class Stream:
    """A lockstep DraftService stream driven from a test: send one message, read one answer."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.Queue = queue.Queue()
        self.responses = pb_grpc.DraftServiceStub(self.channel).Draft(iter(self.requests.get, None), timeout=60)

    def send(self, message: pb.DraftRequest) -> pb.DraftResponse:
        self.requests.put(message)
        return next(self.responses)

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def start(rows, method, config=None, num_tokens=4, vocab_size=378, return_probs=False) -> pb.DraftRequest:
    return pb.DraftRequest(
        start=pb.DraftStart(
            rows=[common_pb2.TokenSequence(ids=r) for r in rows],
            method=method,
            config=dict_to_proto(config or {"eos_token_id": 2}),
            num_tokens=num_tokens,
            vocab_size=vocab_size,
            return_probs=return_probs,
        )
    )


def feedback(accepted, appended, num_tokens=4, finished=None) -> pb.DraftRequest:
    finished = finished or [False] * len(accepted)
    return pb.DraftRequest(
        feedback=pb.DraftFeedback(
            num_tokens=num_tokens,
            rows=[
                pb.RowFeedback(num_accepted=n, appended_ids=a, finished=f)
                for n, a, f in zip(accepted, appended, finished, strict=False)
            ],
        )
    )


def test_prompt_lookup_session_follows_accepted_tokens(server):
    stream = Stream(server.address)
    rows = [[10, 11, 12, 13, 14, 10, 11], [7, 8, 9], [11, 12, 13, 19, 12, 13, 14, 19, 12, 13]]
    first = stream.send(start(rows, pb.DRAFT_METHOD_PROMPT_LOOKUP, num_tokens=3))
    # Row 0 ends with (10, 11), first seen at position 0: propose what followed it.
    assert list(first.rows[0].token_ids) == [12, 13, 14]
    assert list(first.rows[1].token_ids) == []
    # Row 2 ends (19, 12, 13): (12, 13) occurs twice, the second one is preceded by 19 too: it wins.
    assert list(first.rows[2].token_ids) == [14, 19, 12]
    # The target accepted 2 of row 0's tokens and appended 99; row 1 got 9 appended.
    second = stream.send(feedback([2, 0, 0], [[99], [9], [5]], num_tokens=3))
    # Row 0 is now ... 10 11 12 13 99: no earlier (13, 99); row 1 ends (9, 9): no earlier (9, 9), and
    # the default rule does not fall back to a one-token match.
    assert [list(r.token_ids) for r in second.rows] == [[], [], []]
    stream.close()


def test_prompt_lookup_transformers_rule(tiny_draft):
    with threaded_server(lambda: build_server(tiny_draft, prompt_lookup_rule="transformers")) as server:
        stream = Stream(server.address)
        rows = [[10, 11, 12, 13, 14, 10, 11], [7, 8, 9], [11, 12, 13, 19, 12, 13, 14, 19, 12, 13]]
        first = stream.send(start(rows, pb.DRAFT_METHOD_PROMPT_LOOKUP, num_tokens=3))
        # transformers' rule takes the first occurrence of the bigram (12, 13), not the longest match.
        assert [list(r.token_ids) for r in first.rows] == [[12, 13, 14], [], [19, 12, 13]]
        second = stream.send(feedback([2, 0, 0], [[99], [9], [5]], num_tokens=3))
        # Row 1 ends (9, 9): no earlier bigram, so it falls back to the unigram (9,) -> [9].
        assert [list(r.token_ids) for r in second.rows] == [[], [9], []]
        stream.close()


def test_model_session_matches_greedy_of_the_draft_model(server, tiny_draft_dir):
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_draft_dir).eval()
    prompt = [5, 6, 7, 8, 9]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    stream = Stream(server.address)
    config = {"eos_token_id": 2, "assistant_confidence_threshold": 0.0}
    first = stream.send(start([prompt], pb.DRAFT_METHOD_MODEL, config, num_tokens=4))
    drafted = list(first.rows[0].token_ids)
    assert drafted == expected[: len(drafted)] and drafted
    # Accept two tokens, then a correction different from the third: the draft must continue from it,
    # with its cache rolled back (a full re-encode of the new prefix must agree).
    correction = (drafted[2] + 1) % 378 if len(drafted) > 2 else 42
    second = stream.send(feedback([2], [[correction]], num_tokens=3))
    new_prefix = prompt + drafted[:2] + [correction]
    want = reference.generate(torch.tensor([new_prefix]), max_new_tokens=3, do_sample=False)[0, len(new_prefix) :]
    assert list(second.rows[0].token_ids) == want.tolist()[: len(second.rows[0].token_ids)]
    stream.close()


def test_model_session_returns_probabilities_when_sampling(server):
    stream = Stream(server.address)
    config = {
        "eos_token_id": 2,
        "do_sample": True,
        "top_k": 20,
        "seed": 3,
        "assistant_confidence_threshold": 0.0,
    }
    reply = stream.send(start([[5, 6, 7]], pb.DRAFT_METHOD_MODEL, config, num_tokens=3, return_probs=True))
    tokens = list(reply.rows[0].token_ids)
    probs = tensor_from_proto(reply.rows[0].probs)
    assert probs.shape == (len(tokens), 378)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(tokens)))
    assert ((probs > 0).sum(-1) <= 20).all()  # the request's top_k reached the draft
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens))
    stream.close()


def test_sampling_sessions_leave_the_global_rng_alone(server):
    """A sampling draft session draws from a generator of its own, seeded or not: torch's global RNG
    (every other user of randomness in the process) is neither reseeded nor advanced."""
    before = torch.get_rng_state()
    for seed in (None, 3):
        config = {"eos_token_id": 2, "do_sample": True, "assistant_confidence_threshold": 0.0}
        if seed is not None:
            config["seed"] = seed
        stream = Stream(server.address)
        first = stream.send(start([[5, 6, 7]], pb.DRAFT_METHOD_MODEL, config, num_tokens=3))
        assert len(first.rows) == 1
        stream.send(feedback([0], [[9]], num_tokens=3))
        stream.close()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    "messages, code",
    [
        ([feedback([0], [[1]])], grpc.StatusCode.FAILED_PRECONDITION),
        ([start([[1, 2]], pb.DRAFT_METHOD_UNSPECIFIED)], grpc.StatusCode.INVALID_ARGUMENT),
        ([start([[1, 999]], pb.DRAFT_METHOD_PROMPT_LOOKUP)], grpc.StatusCode.INVALID_ARGUMENT),
        ([start([[]], pb.DRAFT_METHOD_PROMPT_LOOKUP)], grpc.StatusCode.INVALID_ARGUMENT),
        ([start([[1, 2]], pb.DRAFT_METHOD_PROMPT_LOOKUP, num_tokens=1000)], grpc.StatusCode.INVALID_ARGUMENT),
        (
            [start([[1, 2]], pb.DRAFT_METHOD_PROMPT_LOOKUP), feedback([5], [[1]])],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            [start([[1, 2]], pb.DRAFT_METHOD_PROMPT_LOOKUP), feedback([0, 0], [[1], [1]])],
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            [start([[1, 2]], pb.DRAFT_METHOD_PROMPT_LOOKUP), start([[1, 2]], pb.DRAFT_METHOD_PROMPT_LOOKUP)],
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
    ],
)
def test_bad_streams_get_the_right_status(server, messages, code):
    stream = Stream(server.address)
    with pytest.raises(grpc.RpcError) as info:
        for message in messages:
            stream.send(message)
    assert info.value.code() == code
    stream.close()


def test_prompt_lookup_only_server_refuses_model_drafting():
    with threaded_server(lambda: build_server(None)) as running:
        stream = Stream(running.address)
        with pytest.raises(grpc.RpcError) as info:
            stream.send(start([[1, 2]], pb.DRAFT_METHOD_MODEL))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        stream.close()


def test_sessions_are_independent_under_concurrency(server):
    results = {}

    def run(i):
        stream = Stream(server.address)
        rows = [[i, i + 1, i + 2, i, i + 1]]
        results[i] = list(stream.send(start(rows, pb.DRAFT_METHOD_PROMPT_LOOKUP, num_tokens=2)).rows[0].token_ids)
        stream.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10, 30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: [i + 2, i] for i in range(10, 30)}


def servicer_of(running):
    return running.server.bindings[0].servicer


def test_sessions_are_counted_and_capped_with_a_retry_hint(tiny_draft):
    with threaded_server(lambda: build_server(tiny_draft, max_sessions=2)) as running:
        servicer = servicer_of(running)
        first, second, third = (Stream(running.address) for _ in range(3))
        first.send(start([[1, 2, 1]], pb.DRAFT_METHOD_MODEL))
        second.send(start([[1, 2, 1]], pb.DRAFT_METHOD_PROMPT_LOOKUP))
        assert servicer.open_sessions == 2
        with pytest.raises(grpc.RpcError) as info:
            third.send(start([[1, 2, 1]], pb.DRAFT_METHOD_PROMPT_LOOKUP))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sessions 2" in info.value.details()
        assert float(dict(info.value.trailing_metadata())["retry-after-s"]) > 0
        third.close()
        # A stream that ends (half-closed by the client) frees its place at once.
        first.close()
        wait_for(lambda: servicer.open_sessions == 1)
        fourth = Stream(running.address)
        assert fourth.send(start([[1, 2, 1]], pb.DRAFT_METHOD_PROMPT_LOOKUP)).rows
        assert servicer.open_sessions == 2
        for stream in (second, fourth):
            stream.close()
        wait_for(lambda: servicer.open_sessions == 0)


def test_idle_sessions_are_ended_with_a_clear_status(tiny_draft):
    with threaded_server(lambda: build_server(tiny_draft, session_idle_timeout_s=0.3)) as running:
        servicer = servicer_of(running)
        stream = Stream(running.address)
        stream.send(start([[5, 6, 7]], pb.DRAFT_METHOD_MODEL, {"eos_token_id": 2}))
        assert servicer.open_sessions == 1
        # Nothing sent: the service ends the stream on its own and frees the session.
        with pytest.raises(grpc.RpcError) as info:
            next(stream.responses)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--session-idle-timeout" in info.value.details()
        wait_for(lambda: servicer.open_sessions == 0)
        stream.close()
        # A stream that keeps talking is not idle, however long it lives.
        busy = Stream(running.address)
        busy.send(start([[5, 6, 7]], pb.DRAFT_METHOD_PROMPT_LOOKUP))
        for _ in range(4):
            time.sleep(0.1)  # the target's verify step between two rounds
            busy.send(feedback([0], [[8]]))
        busy.close()


def test_cancelled_and_broken_streams_release_their_sessions(tiny_draft):
    with threaded_server(lambda: build_server(tiny_draft)) as running:
        servicer = servicer_of(running)
        streams = [Stream(running.address) for _ in range(4)]
        for stream in streams:
            stream.send(start([[5, 6, 7, 8]], pb.DRAFT_METHOD_MODEL, num_tokens=8))
        assert servicer.open_sessions == 4
        streams[0].responses.cancel()  # the target cancels (its request was cancelled)
        streams[1].channel.close()  # the target's connection goes away
        with pytest.raises(grpc.RpcError):  # the target sends a bad feedback: the stream fails
            streams[2].send(feedback([99], [[1]]))
        streams[3].close()  # the target half-closes (its request finished)
        wait_for(lambda: servicer.open_sessions == 0)
        for stream in streams:
            stream.close()


@pytest.mark.parametrize(
    "argv, message",
    [(["--max-sessions", "0"], "--max-sessions"), (["--session-idle-timeout", "-1"], "--session-idle-timeout")],
)
def test_session_flags_reject_bad_values(capsys, argv, message):
    from specwire.draft_service.__main__ import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
