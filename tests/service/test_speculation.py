"""Lossless speculative decoding through the real services: a target service verifying drafts from a
real draft service (prompt lookup and a draft model) gives the same tokens as plain decoding and as
transformers.generate(), for draft lengths 1-10, batch sizes 1 and 3; it falls back to plain decoding
when the draft service is unreachable, too slow, or killed mid-generation."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
import transformers

from specwire.client import TargetClient
from specwire.draft.v1 import draft_service_pb2 as draft_pb
from specwire.draft.v1 import draft_service_pb2_grpc as pb_grpc
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.models import load_model
from specwire.serving import GrpcServer, ServiceBinding
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy
from specwire.wire.tensors import tensor_to_proto
from tests.servers import free_port, subprocess_server, threaded_server

# Repetitive prompts so prompt lookup finds matches; row 2 left padded in the batch of 3.
BATCH = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6],
    [20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21],
    [40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41],
]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def draft_server(tiny_model_dir):
    # The target's own weights as the draft model: every greedy draft is accepted, so the rounds
    # really exercise multi-token blocks; a second draft server with other weights checks rejections.
    draft = load_model(str(tiny_model_dir), progress=False)
    with threaded_server(lambda: build_draft_server(draft)) as server:
        yield server


@pytest.fixture(scope="module")
def other_draft_server(tiny_draft_dir):
    draft = load_model(str(tiny_draft_dir), progress=False)
    with threaded_server(lambda: build_draft_server(draft)) as server:
        yield server


@pytest.fixture(scope="module")
def target(loaded, draft_server):
    policy = DraftPolicy(draft_server.address, round_timeout_s=30.0)
    with threaded_server(lambda: build_target_server(loaded, drafting=policy)) as server:
        with TargetClient(server.address) as client:
            yield client


def _reference_rows(reference, rows, **kwargs):
    """transformers on each row alone (assisted decoding and prompt lookup are batch-1 only there)."""
    return [reference.generate(torch.tensor([r]), do_sample=False, **kwargs)[0].tolist() for r in rows]


def _generated(output, rows):
    width = output.sequences.shape[1] - max(len(r) for r in rows)
    return [seq[-width:] for seq in output.sequences.tolist()], width


@pytest.mark.parametrize("draft_length", range(1, 11))
def test_prompt_lookup_equals_plain_and_transformers(target, reference, draft_length):
    plain = target.generate(BATCH[0], max_new_tokens=24)
    spec = target.generate(BATCH[0], max_new_tokens=24, prompt_lookup_num_tokens=draft_length)
    assert torch.equal(spec.sequences, plain.sequences)
    want = reference.generate(
        torch.tensor([BATCH[0]]), max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=draft_length
    )
    assert spec.sequences[0].tolist() == want[0].tolist()
    s = spec.speculation
    assert s.proposer == "prompt_lookup" and s.fallback_reason == ""
    assert s.accepted_tokens <= s.drafted_tokens
    assert sum(s.accepted_by_position) == s.accepted_tokens
    assert all(a >= b for a, b in zip(s.accepted_by_position, s.accepted_by_position[1:], strict=False))


@pytest.mark.parametrize("draft_length", range(1, 11))
def test_draft_model_batch_of_three_equals_plain(target, reference, draft_length):
    plain = target.generate(BATCH, max_new_tokens=20)
    spec = target.generate(
        BATCH,
        max_new_tokens=20,
        proposer="draft_model",
        num_assistant_tokens=draft_length,
        assistant_confidence_threshold=0.0,
    )
    assert torch.equal(spec.sequences, plain.sequences)
    s = spec.speculation
    assert s.proposer == "draft_model" and s.fallback_reason == ""
    assert s.rounds > 0 and s.accepted_tokens > 0 and s.accepted_tokens <= s.drafted_tokens
    assert sum(s.accepted_by_position) == s.accepted_tokens
    # Each row also equals transformers' assisted generation with the same draft (batch 1 there).
    generated, width = _generated(spec, BATCH)
    for row, tokens in zip(BATCH, generated, strict=True):
        want = reference.generate(torch.tensor([row]), max_new_tokens=20, do_sample=False, assistant_model=reference)
        assert tokens[:width] == want[0, len(row) :].tolist()[:width] or tokens == want[0, len(row) :].tolist()


def test_scores_and_logits_are_those_of_plain_decoding(target):
    kwargs = dict(max_new_tokens=16, output_scores=True, output_logits=True, return_dict_in_generate=True)
    plain = target.generate(BATCH, **kwargs)
    spec = target.generate(BATCH, proposer="draft_model", num_assistant_tokens=4, **kwargs)
    assert torch.equal(spec.sequences, plain.sequences)
    assert len(spec.scores) == len(plain.scores) and len(spec.logits) == len(plain.logits)
    for ours, theirs in zip(spec.scores, plain.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(spec.logits, plain.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_eos_and_stop_strings_cut_inside_an_accepted_block(target, loaded):
    plain = target.generate(BATCH, max_new_tokens=30)
    generated, _ = _generated(plain, BATCH)
    # Pretend the 4th generated token of row 0 is an EOS: rows must stop there, mid-block.
    eos = generated[0][3]
    kwargs = dict(max_new_tokens=30, eos_token_id=[2, eos])
    plain_eos = target.generate(BATCH, **kwargs)
    spec_eos = target.generate(BATCH, proposer="draft_model", num_assistant_tokens=8, **kwargs)
    assert torch.equal(spec_eos.sequences, plain_eos.sequences)
    assert spec_eos.finish_reasons == plain_eos.finish_reasons and "eos" in spec_eos.finish_reasons
    # A stop string made of the text of generated tokens 5-6 of row 1.
    stop = loaded.tokenizer.decode(generated[1][5:7])
    if stop.strip():
        kwargs = dict(max_new_tokens=30, stop_strings=[stop])
        plain_stop = target.generate(BATCH, **kwargs)
        spec_stop = target.generate(BATCH, proposer="draft_model", num_assistant_tokens=8, **kwargs)
        assert torch.equal(spec_stop.sequences, plain_stop.sequences)
        assert spec_stop.finish_reasons == plain_stop.finish_reasons


def test_rejections_with_a_different_draft_model_keep_the_output(loaded, other_draft_server):
    policy = DraftPolicy(other_draft_server.address, round_timeout_s=30.0)
    with threaded_server(lambda: build_target_server(loaded, drafting=policy)) as server:
        with TargetClient(server.address) as client:
            plain = client.generate(BATCH, max_new_tokens=20)
            spec = client.generate(BATCH, max_new_tokens=20, proposer="draft_model", num_assistant_tokens=3)
    assert torch.equal(spec.sequences, plain.sequences)
    assert spec.speculation.drafted_tokens > spec.speculation.accepted_tokens


def test_seeded_speculative_sampling_is_reproducible_with_return_sequences(target):
    kwargs = dict(
        max_new_tokens=16,
        do_sample=True,
        top_k=30,
        seed=11,
        num_return_sequences=2,
        proposer="draft_model",
        num_assistant_tokens=4,
    )
    first = target.generate(BATCH[:2], **kwargs)
    second = target.generate(BATCH[:2], **kwargs)
    assert first.sequences.shape[0] == 4
    assert torch.equal(first.sequences, second.sequences)
    assert first.speculation.rounds > 0 and first.speculation.fallback_reason == ""


def test_beam_search_falls_back_and_says_so(target):
    plain = target.generate(BATCH[:1], num_beams=3, max_new_tokens=8)
    spec = target.generate(BATCH[:1], num_beams=3, max_new_tokens=8, prompt_lookup_num_tokens=4)
    assert torch.equal(spec.sequences, plain.sequences)
    assert "beam" in spec.speculation.fallback_reason and spec.speculation.rounds == 0


def test_synthid_watermark_falls_back_and_says_so(target):
    synthid = {"ngram_len": 3, "keys": [3, 1, 4]}
    plain = target.generate(BATCH[:2], max_new_tokens=8, watermarking_config=synthid)
    for proposer in ({"prompt_lookup_num_tokens": 4}, {"proposer": "draft_model"}):
        spec = target.generate(BATCH[:2], max_new_tokens=8, watermarking_config=synthid, **proposer)
        assert torch.equal(spec.sequences, plain.sequences)
        assert "SynthID" in spec.speculation.fallback_reason and spec.speculation.rounds == 0


def test_unreachable_or_slow_draft_service_falls_back(loaded, draft_server):
    for policy, reason in [
        (DraftPolicy(f"127.0.0.1:{free_port()}", round_timeout_s=5.0), "draft"),
        (DraftPolicy(draft_server.address, round_timeout_s=1e-6), "deadline"),
    ]:
        with threaded_server(lambda policy=policy: build_target_server(loaded, drafting=policy)) as server:
            with TargetClient(server.address) as client:
                plain = client.generate(BATCH, max_new_tokens=12)
                spec = client.generate(BATCH, max_new_tokens=12, proposer="draft_model")
        assert torch.equal(spec.sequences, plain.sequences)
        assert reason in spec.speculation.fallback_reason


def test_prompt_lookup_runs_in_the_target_even_with_a_draft_service(loaded):
    # Prompt lookup needs no model: the target looks up the request's own tokens, never a round trip per round.
    # With a draft service that is not there, it still drafts and never falls back.
    policy = DraftPolicy(f"127.0.0.1:{free_port()}", round_timeout_s=5.0)  # nothing listens there
    with threaded_server(lambda: build_target_server(loaded, drafting=policy)) as server:
        with TargetClient(server.address) as client:
            plain = client.generate(BATCH[:1], max_new_tokens=24)
            spec = client.generate(BATCH[:1], max_new_tokens=24, prompt_lookup_num_tokens=4)
    assert torch.equal(spec.sequences, plain.sequences)
    assert spec.speculation.fallback_reason == "" and spec.speculation.drafted_tokens > 0


def test_killing_the_draft_service_mid_generation_changes_nothing(tmp_path, loaded, tiny_model_dir):
    port = free_port()
    args = ["specwire.draft_service", "--port", str(port), "--model", str(tiny_model_dir)]
    policy = DraftPolicy(f"127.0.0.1:{port}", round_timeout_s=10.0)
    with threaded_server(lambda: build_target_server(loaded, drafting=policy)) as server:
        with TargetClient(server.address) as client:
            plain = [client.generate([row], max_new_tokens=60).sequences for row in BATCH]
            with subprocess_server(args, port) as draft:
                outputs, errors = {}, []
                started = threading.Barrier(len(BATCH) + 1)

                def run(i):
                    try:
                        with TargetClient(server.address) as own:
                            stream = own.stream(
                                [BATCH[i]],
                                max_new_tokens=60,
                                proposer="draft_model",
                                num_assistant_tokens=2,
                                assistant_confidence_threshold=0.0,
                            )
                            first = next(stream)
                            started.wait(30)
                            items = [first, *stream]
                            outputs[i] = items[-1]
                    except Exception as exc:  # noqa: BLE001 - reported below
                        errors.append(exc)

                threads = [threading.Thread(target=run, args=(i,)) for i in range(len(BATCH))]
                for t in threads:
                    t.start()
                started.wait(60)
                draft.send_signal(signal.SIGKILL)
                for t in threads:
                    t.join(120)
            assert not errors, errors
            for i in range(len(BATCH)):
                assert torch.equal(outputs[i].sequences, plain[i])
            assert any("draft" in outputs[i].speculation.fallback_reason for i in range(len(BATCH)))
            # Later requests keep working (plain decoding now, drafting again once a draft service is back).
            after = client.generate([BATCH[0]], max_new_tokens=10, proposer="draft_model")
            assert after.speculation.fallback_reason
            time.sleep(0.1)


class _BadDraftService(pb_grpc.DraftServiceServicer):
    """A draft service that answers every request for drafts with `answer` (a broken or hostile replica); the
    DraftStart the target sends before its prefill asks for none and gets none (`RemoteDrafter.prefill`)."""

    def __init__(self, answer: draft_pb.DraftResponse):
        self.answer = answer

    async def Draft(self, request_iterator, context):
        async for message in request_iterator:
            if message.HasField("start") and message.start.num_tokens == 0:
                yield draft_pb.DraftResponse(rows=[draft_pb.RowDraft() for _ in message.start.rows])
            else:
                yield self.answer


def _row(ids, probs=None):
    row = draft_pb.RowDraft(token_ids=ids)
    if probs is not None:
        row.probs.CopyFrom(tensor_to_proto(probs))
    return row


@pytest.mark.parametrize(
    "answer, problem",
    [
        (draft_pb.DraftResponse(rows=[_row([5, 10_000])]), "outside [0, "),
        (draft_pb.DraftResponse(rows=[_row([5, -1])]), "outside [0, "),
        (draft_pb.DraftResponse(rows=[_row([5] * 40)]), "asked 4"),
        (draft_pb.DraftResponse(rows=[_row([5]), _row([6])]), "2 rows for 1"),
        (draft_pb.DraftResponse(rows=[_row([5], torch.ones(3, 7))]), "probabilities of shape"),
    ],
    ids=["id-above-vocab", "negative-id", "too-many-tokens", "too-many-rows", "probs-shape"],
)
def test_malformed_draft_answers_fall_back_to_plain_decoding(loaded, answer, problem):
    servicer = _BadDraftService(answer)
    with threaded_server(
        lambda: GrpcServer(
            [ServiceBinding(pb_grpc.add_DraftServiceServicer_to_server, servicer, "specwire.draft.v1.DraftService")]
        )
    ) as bad:
        policy = DraftPolicy(bad.address, round_timeout_s=30.0)
        with threaded_server(lambda: build_target_server(loaded, drafting=policy)) as server:
            with TargetClient(server.address) as client:
                plain = client.generate(BATCH[:1], max_new_tokens=12)
                spec = client.generate(
                    BATCH[:1], max_new_tokens=12, proposer="draft_model", num_assistant_tokens=4, do_sample=False
                )
        policy.close()
    assert torch.equal(spec.sequences, plain.sequences)
    assert spec.speculation.fallback_reason.startswith("draft failed mid-request")
    assert problem in spec.speculation.fallback_reason


class _DraftsUnasked(pb_grpc.DraftServiceServicer):
    """Answers every message with a draft, the DraftStart that asks for none included."""

    async def Draft(self, request_iterator, context):
        async for _ in request_iterator:
            yield draft_pb.DraftResponse(rows=[_row([5])])


def test_drafts_answered_to_the_prefill_fall_back_to_plain_decoding(loaded):
    with threaded_server(
        lambda: GrpcServer(
            [
                ServiceBinding(
                    pb_grpc.add_DraftServiceServicer_to_server, _DraftsUnasked(), "specwire.draft.v1.DraftService"
                )
            ]
        )
    ) as bad:
        policy = DraftPolicy(bad.address, round_timeout_s=30.0)
        with threaded_server(lambda: build_target_server(loaded, drafting=policy)) as server:
            with TargetClient(server.address) as client:
                plain = client.generate(BATCH[:1], max_new_tokens=12)
                spec = client.generate(
                    BATCH[:1], max_new_tokens=12, proposer="draft_model", num_assistant_tokens=4, do_sample=False
                )
        policy.close()
    assert torch.equal(spec.sequences, plain.sequences)
    assert spec.speculation.fallback_reason.startswith("draft failed mid-request")
    assert "asked 0" in spec.speculation.fallback_reason
