"""The batched scheduler of the target service on real servers over loopback: concurrent clients with
mixed configs get their sequential results, admission limits answer RESOURCE_EXHAUSTED with a retry
hint, cancellation and deadlines free a request's slots within one step, and a long request keeps
advancing while short ones come and go."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from specwire.client import SpecwireRpcError, TargetClient
from specwire.models import load_model
from specwire.target_service.__main__ import build_server
from specwire.target_service.scheduler.batch_scheduler import BatchScheduler
from specwire.target_service.scheduler.options import SchedulerOptions
from specwire.target_service.scheduler.startup_probe import close_logits
from tests.servers import threaded_server, wait_for

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26]]
REPETITIVE = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]

# (prompts, overrides): greedy, seeded sampling, beams, prompt lookup, and mixes of them.
MIXED = [
    (PROMPTS[:1], dict(max_new_tokens=24)),
    (PROMPTS[1:], dict(max_new_tokens=20, do_sample=True, seed=3, temperature=0.8, top_k=40, top_p=0.9)),
    (PROMPTS[:1], dict(max_new_tokens=12, num_beams=3, num_return_sequences=2, length_penalty=0.8)),
    ([REPETITIVE], dict(max_new_tokens=30, prompt_lookup_num_tokens=4)),
    (PROMPTS, dict(max_new_tokens=16, repetition_penalty=1.3)),  # ragged: left padded
    (PROMPTS[:1], dict(max_new_tokens=18, do_sample=True, seed=11, num_return_sequences=2)),
    ([REPETITIVE], dict(max_new_tokens=22, do_sample=True, seed=5, prompt_lookup_num_tokens=3)),
    (PROMPTS[1:], dict(max_new_tokens=10, num_beams=2, do_sample=True, seed=9)),
]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def sequential(loaded):
    with threaded_server(lambda: build_server(loaded, scheduler="sequential")) as server:
        yield server


@pytest.fixture(scope="module")
def batched(loaded):
    with threaded_server(lambda: build_server(loaded, scheduler="batched")) as server:
        yield server


def batcher_of(server):
    return server.server.bindings[0].servicer.engine.batcher


def expected(server, cases):
    with TargetClient(server.address) as client:
        return [client.generate(prompts, **kw).sequences for prompts, kw in cases]


def run_concurrently(address, cases):
    outputs, errors = [None] * len(cases), []
    start = threading.Barrier(len(cases))

    def worker(i):
        prompts, kw = cases[i]
        try:
            with TargetClient(address) as client:
                start.wait(30)
                outputs[i] = client.generate(prompts, **kw).sequences
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return outputs


def test_batched_scheduler_is_enabled_on_the_tiny_model(batched):
    batcher = batcher_of(batched)
    assert batcher is not None and batcher.enabled, batcher and batcher.unsupported
    # The Llama layout runs through the lean decoder (its logits checked bitwise at start-up).
    assert batcher.decoder is not None


def test_eight_concurrent_mixed_clients_get_their_sequential_results(sequential, batched):
    want = expected(sequential, MIXED)
    batcher = batcher_of(batched)
    before = batcher.stats()
    got = run_concurrently(batched.address, MIXED)
    for (_, kw), ours, theirs in zip(MIXED, got, want, strict=True):
        assert torch.equal(ours, theirs), (kw, ours, theirs)
    # They really shared forwards (not one request per forward), and logits processing: the
    # sampling, repetition-penalty and beam-sample requests' processors ran as one batch.
    after = batcher.stats()
    shared = after.shared_forwards - before.shared_forwards
    assert shared >= 5 and after.requests_peak >= 4, (shared, after.requests_peak)
    assert after.shared_process_batches - before.shared_process_batches >= 3
    # And the batched server alone, one request at a time, gives the same as well.
    alone = expected(batched, MIXED)
    for i, (a, b) in enumerate(zip(alone, want, strict=True)):
        assert torch.equal(a, b), (i, MIXED[i], a, b)
    # Every slot comes back (the last request's a moment after its answer was sent).
    wait_for(lambda: batcher.free_slots == batcher.cache.num_slots)


# Seeded sampling with every batchable processor, in different combinations, scores returned.
SAMPLING = [
    (PROMPTS[:1], dict(do_sample=True, seed=1, temperature=0.7, top_k=30, top_p=0.9)),
    (PROMPTS[1:], dict(do_sample=True, seed=2, temperature=1.4, min_p=0.05, top_k=0)),
    (PROMPTS, dict(do_sample=True, seed=3, repetition_penalty=1.4, top_p=0.8)),  # left padded
    (PROMPTS[:1], dict(do_sample=True, seed=4, num_beams=2, temperature=0.5)),  # beam-sample
]


def test_concurrent_sampling_shares_processing_and_keeps_every_rows_scores(sequential, batched):
    """Rows processed in one batch with other requests' get their own processors' scores and tokens."""
    cases = [(p, dict(kw, max_new_tokens=14, output_scores=True, return_dict_in_generate=True)) for p, kw in SAMPLING]
    with TargetClient(sequential.address) as client:
        want = [client.generate(prompts, **kw) for prompts, kw in cases]
    batcher = batcher_of(batched)
    before = batcher.stats().shared_process_batches
    got = [None] * len(cases)
    start = threading.Barrier(len(cases))

    def worker(i):
        with TargetClient(batched.address) as client:
            start.wait(30)
            got[i] = client.generate(cases[i][0], **cases[i][1])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert batcher.stats().shared_process_batches - before >= 3
    for (_, kw), ours, theirs in zip(cases, got, want, strict=True):
        assert torch.equal(ours.sequences, theirs.sequences), kw
        assert len(ours.scores) == len(theirs.scores)
        for a, b in zip(ours.scores, theirs.scores, strict=True):
            # Same -inf pattern (same kept sets); finite values up to the packed forward's float noise.
            assert torch.equal(torch.isinf(a), torch.isinf(b)), kw
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_full_queue_is_resource_exhausted_with_a_retry_hint(loaded, sequential):
    options = SchedulerOptions(max_batch_rows=2, max_queued=1)
    long = dict(max_new_tokens=200, min_new_tokens=200)
    with threaded_server(lambda: build_server(loaded, scheduler="batched", scheduler_options=options)) as server:
        batcher = batcher_of(server)
        with TargetClient(server.address) as a, TargetClient(server.address) as b:
            streams = [a.stream(PROMPTS[:1], **long), b.stream(PROMPTS[1:], **long)]
            for stream in streams:
                next(stream)  # both admitted: the two slots are taken
            assert batcher.free_slots == 0
            queued_result = {}

            def queued():
                with TargetClient(server.address) as c:
                    queued_result["out"] = c.generate(PROMPTS[:1], max_new_tokens=6).sequences

            waiter = threading.Thread(target=queued)
            waiter.start()
            wait_for(lambda: batcher.stats().queued == 1)
            with TargetClient(server.address) as d:
                with pytest.raises(SpecwireRpcError) as info:
                    d.generate(PROMPTS[:1], max_new_tokens=6)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queued" in info.value.message
            assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
            for stream in streams:
                stream.close()  # frees both slots: the queued request runs
            waiter.join(30)
        assert torch.equal(queued_result["out"], expected(sequential, [(PROMPTS[:1], dict(max_new_tokens=6))])[0])
        # A request wider than the whole cache is not refused: it runs alone in the sequential lane.
        wide = (PROMPTS[:1], dict(max_new_tokens=6, num_beams=3))
        with TargetClient(server.address) as client:
            assert torch.equal(client.generate(wide[0], **wide[1]).sequences, expected(sequential, [wide])[0])
        wait_for(lambda: batcher.free_slots == 2)


def test_full_sequential_lane_is_resource_exhausted_while_batched_requests_run(loaded, sequential):
    options = SchedulerOptions(max_lane_requests=1)
    lane = dict(use_cache=False)  # a request the slot cache cannot serve
    with threaded_server(lambda: build_server(loaded, scheduler="batched", scheduler_options=options)) as server:
        engine = server.server.bindings[0].servicer.engine
        with TargetClient(server.address) as a, TargetClient(server.address) as b:
            stream = a.stream(PROMPTS[:1], max_new_tokens=200, min_new_tokens=200, **lane)
            next(stream)
            assert engine.lane_active == 1
            with pytest.raises(SpecwireRpcError) as info:
                b.generate(PROMPTS[:1], max_new_tokens=4, **lane)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "sequential lane" in info.value.message and "use_cache=False" in info.value.message
            assert info.value.retry_after_s is not None
            # The batched path is not limited by the lane.
            want = expected(sequential, [(PROMPTS[1:], dict(max_new_tokens=5))])[0]
            assert torch.equal(b.generate(PROMPTS[1:], max_new_tokens=5).sequences, want)
            stream.close()
            wait_for(lambda: engine.lane_active == 0)
            want = expected(sequential, [(PROMPTS[:1], dict(max_new_tokens=4, **lane))])[0]
            assert torch.equal(b.generate(PROMPTS[:1], max_new_tokens=4, **lane).sequences, want)


def test_cancel_and_deadline_free_the_slot_within_one_step(loaded):
    with threaded_server(lambda: build_server(loaded, scheduler="batched")) as server:
        batcher = batcher_of(server)
        slots = batcher.cache.num_slots
        long = dict(max_new_tokens=240, min_new_tokens=240)
        with TargetClient(server.address) as other, TargetClient(server.address) as mine:
            background = other.stream(PROMPTS[1:], **long)  # keeps forwards running meanwhile
            next(background)
            stream = mine.stream(PROMPTS[:1], **long)
            for _ in range(3):
                next(stream)
            assert batcher.free_slots == slots - 2
            stream.close()  # cancels the RPC
            wait_for(lambda: batcher.free_slots == slots - 1)
            cancelled_at, freed_at = batcher.stats().cancellations[-1]
            assert freed_at - cancelled_at <= 1
            # A deadline is a cancellation too. The request (batched: it fits a slot) is running when
            # its deadline passes whatever the machine's speed: the test holds the scheduler's lock, so
            # no forward completes, from its first token until after the deadline.
            deadline_s = 2.0
            with TargetClient(server.address, timeout=deadline_s) as hurried:
                called = time.monotonic()
                hurried_stream = hurried.stream(PROMPTS[:1], **long)
                with pytest.raises(SpecwireRpcError) as info:
                    next(hurried_stream)
                    with batcher.cond:
                        time.sleep(max(called + deadline_s + 0.3 - time.monotonic(), 0.0))
                    for _ in hurried_stream:
                        pass
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_for(lambda: len(batcher.stats().cancellations) == 2 and batcher.free_slots == slots - 1)
            cancelled_at, freed_at = batcher.stats().cancellations[-1]
            assert freed_at - cancelled_at <= 1
            background.close()
        wait_for(lambda: batcher.free_slots == slots and batcher.stats().running == 0)


def test_long_request_finishes_while_short_ones_come_and_go(loaded, sequential):
    options = SchedulerOptions(max_batch_rows=3, max_queued=16)
    long_case = (PROMPTS[:1], dict(max_new_tokens=160, min_new_tokens=160))
    shorts = [
        (PROMPTS[1:], dict(max_new_tokens=4)),
        (PROMPTS[:1], dict(max_new_tokens=6, do_sample=True, seed=2)),
        ([REPETITIVE], dict(max_new_tokens=8, prompt_lookup_num_tokens=3)),
        (PROMPTS[1:], dict(max_new_tokens=5, num_beams=2)),
    ]
    want_long = expected(sequential, [long_case])[0]
    want_short = expected(sequential, shorts)
    with threaded_server(lambda: build_server(loaded, scheduler="batched", scheduler_options=options)) as server:
        batcher = batcher_of(server)
        done = threading.Event()
        long_out, short_outs, errors = {}, [], []

        def run_long():
            try:
                with TargetClient(server.address) as client:
                    long_out["out"] = client.generate(long_case[0], **long_case[1]).sequences
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                done.set()

        def run_shorts(offset):
            with TargetClient(server.address) as client:
                i = offset
                while not done.is_set():
                    prompts, kw = shorts[i % len(shorts)]
                    try:
                        short_outs.append((i % len(shorts), client.generate(prompts, **kw).sequences))
                    except Exception as exc:  # noqa: BLE001 - reported below
                        errors.append(exc)
                        return
                    i += 1

        threads = [threading.Thread(target=run_long)] + [threading.Thread(target=run_shorts, args=(k,)) for k in (0, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert torch.equal(long_out["out"], want_long)
        assert len(short_outs) >= 6  # short requests really came and went while the long one ran
        for index, out in short_outs:
            assert torch.equal(out, want_short[index]), shorts[index]
        wait_for(lambda: batcher.free_slots == 3)


def test_sequential_lane_runs_between_packed_forwards_on_the_scheduler_thread(sequential, batched):
    # use_cache=False, classifier-free guidance, group beam and contrastive search cannot use the slot
    # cache: they take the sequential lane, whose loops run in their own threads and whose forwards (the
    # guidance processor's included) the scheduler thread runs between packed forwards.
    engine = batched.server.bindings[0].servicer.engine
    lane_forwards_before = engine.batcher.stats().lane_forwards
    lane = [
        (PROMPTS[:1], dict(max_new_tokens=10, use_cache=False)),
        (PROMPTS[1:], dict(max_new_tokens=8, guidance_scale=1.5)),
        # Group beam search: its groups pick one after the other within a step.
        (PROMPTS[:1], dict(max_new_tokens=6, num_beams=4, num_beam_groups=2, diversity_penalty=1.0)),
        # Contrastive search: candidates ranked by hidden states, cache rows repeated and selected.
        (PROMPTS[1:], dict(max_new_tokens=6, penalty_alpha=0.6, top_k=4)),
    ]
    cases = lane + MIXED[:4]
    want = expected(sequential, cases)
    lane_before, shared_before = engine._lane_steps, engine.batcher.stats().shared_forwards
    got = run_concurrently(batched.address, cases)
    for (_, kw), ours, theirs in zip(cases, got, want, strict=True):
        assert torch.equal(ours, theirs), (kw, ours, theirs)
    assert engine._lane_steps - lane_before >= 18  # the lane requests' steps
    # Their forwards ran on the scheduler thread: one per use_cache=False step, two per guidance step.
    assert engine.batcher.stats().lane_forwards - lane_forwards_before >= 10 + 2 * 8
    assert engine.batcher.stats().shared_forwards > shared_before  # while the batched ones shared forwards


def test_constrained_beam_search_takes_the_sequential_lane(sequential, batched):
    # Its candidates depend on each hypothesis' constraint progress: the slot cache's beam step cannot run it.
    engine = batched.server.bindings[0].servicer.engine
    cases = [(PROMPTS, dict(max_new_tokens=6, num_beams=3, force_words_ids=[[70, 71], [[72], [73, 74]]]))]
    lane_before = engine._lane_steps
    assert torch.equal(expected(batched, cases)[0], expected(sequential, cases)[0])
    assert engine._lane_steps - lane_before >= 6


@pytest.mark.smollm
def test_bfloat16_smollm_keeps_the_batched_scheduler_and_the_lean_forward():
    # Packed and RowBatch forwards round bfloat16 sums in a different order (one ulp, 0.125, on
    # SmolLM2's logits): the start-up probe must accept that, not fall back to sequential serving.
    loaded = load_model("default", dtype="bfloat16", progress=False)
    scheduler = BatchScheduler(loaded.model, lambda *args: None, SchedulerOptions(), loaded.max_position_embeddings)
    try:
        assert scheduler.enabled, scheduler.unsupported
        assert scheduler.decoder is not None  # and the lean forward reproduces bfloat16 logits bitwise
    finally:
        scheduler.close()


def test_logits_tolerance_follows_the_dtype():
    want = torch.tensor([[28.0, -3.5, 0.25]])
    one_bf16_ulp = want + torch.tensor([[0.125, 0.0, 0.0]])
    wrong = want + torch.tensor([[0.0, 1.0, 0.0]])
    assert close_logits(want, one_bf16_ulp, torch.bfloat16)
    assert not close_logits(want, wrong, torch.bfloat16)
    assert not close_logits(want, one_bf16_ulp, torch.float32)  # float32 keeps its 1e-3
    assert close_logits(want, want + 5e-4, torch.float32)


@pytest.mark.parametrize("kind", ["sequential", "batched"])
@pytest.mark.parametrize(
    "overrides",
    [
        dict(max_new_tokens=6),
        dict(max_new_tokens=6, prompt_lookup_num_tokens=3),
        dict(max_new_tokens=6, num_beams=2),
        dict(max_new_tokens=6, use_cache=False),  # the batched scheduler's sequential lane
    ],
    ids=["greedy", "prompt_lookup", "beams", "lane"],
)
def test_each_request_is_planned_once(kind, overrides, request, monkeypatch):
    # Routing plans a request (lengths, rows) and its loop runs from that plan: prepare_generation
    # (validation included) runs once per request, whichever path it takes.
    import specwire.generation.loops.generate as generate_module
    import specwire.generation.loops.speculative as speculative_module
    import specwire.target_service.engine as engine_module
    import specwire.target_service.scheduler.batch_scheduler as batch_module
    from specwire.generation import planning

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return planning.prepare_generation(*args, **kwargs)

    for module in (engine_module, batch_module, generate_module, speculative_module):
        monkeypatch.setattr(module, "prepare_generation", counted)
    server = request.getfixturevalue(kind)
    with TargetClient(server.address) as client:
        client.generate([REPETITIVE], **overrides)
    assert len(calls) == 1
