"""Admission first, heavy work off the event loop, on real servers (tiny random Llama): a full queue, a
full preparation pool or too many concurrent RPCs answer RESOURCE_EXHAUSTED with a retry hint before
the request is validated or tokenized; tokenization runs on the preparation pool's threads; health
checks are never counted against the cap. Plus the config service's size caps."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specwire.client import ConfigClient, SpecwireRpcError, TargetClient
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.models import load_model
from specwire.security.channels import secure_channel
from specwire.target_service.__main__ import build_server
from specwire.target_service.admission import PreparationPool
from specwire.target_service.scheduler.options import SchedulerOptions
from tests.servers import threaded_server, wait_for

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
BAD_IDS = torch.tensor([[5, 6, 10**6]])  # out of the vocabulary: INVALID_ARGUMENT once validated
LONG = dict(max_new_tokens=240, min_new_tokens=240)


class RecordingTokenizer:
    """The model's tokenizer, recording the thread of every encode call (not a mock: it delegates)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.threads: list[str] = []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture
def recorded(loaded):
    return dataclasses.replace(loaded, tokenizer=RecordingTokenizer(loaded.tokenizer))


def servicer_of(server):
    return server.server.bindings[0].servicer


def exhausted(fn, *args, **kwargs) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    return info.value


def hold_scheduler(server) -> threading.Event:
    """Stall the batched scheduler's thread (no forward runs) until the returned event is set."""
    gate, held = threading.Event(), threading.Event()

    def stall() -> None:
        held.set()
        gate.wait(60)

    # `forward` runs a call on the scheduler thread and waits for it: wait in a thread of our own.
    batcher = servicer_of(server).engine.batcher
    threading.Thread(target=batcher.forward, args=(stall,), daemon=True).start()
    assert held.wait(30), "the scheduler thread never ran the stall"
    return gate


def test_full_preparation_pool_refuses_before_validation(recorded):
    pool = PreparationPool(workers=1, max_in_flight=1)
    with threaded_server(lambda: build_server(recorded, pool=pool)) as server:
        gate = threading.Event()
        held = asyncio.run_coroutine_threadsafe(pool.run(gate.wait, 60), server.loop)
        try:
            server.run(asyncio.sleep(0))  # the loop has taken the pool's only place
            assert pool.in_flight == 1
            with TargetClient(server.address) as client:
                # Invalid ids would be INVALID_ARGUMENT: refused first, so never checked.
                error = exhausted(client.generate, BAD_IDS, max_new_tokens=2)
                assert "--max-preparing 1" in error.message
                exhausted(client.generate, text="never tokenized", max_new_tokens=2)
                assert recorded.tokenizer.threads == []
        finally:
            gate.set()
            held.result(10)
        assert pool.in_flight == 0
        with TargetClient(server.address) as client:
            with pytest.raises(SpecwireRpcError) as info:
                client.generate(BAD_IDS, max_new_tokens=2)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert client.generate(PROMPT, max_new_tokens=2).sequences.shape == (1, 7)


def test_tokenization_runs_in_the_preparation_pool(recorded):
    with threaded_server(lambda: build_server(recorded)) as server:
        with TargetClient(server.address) as client:
            client.generate(text=["hello world", "a longer prompt here"], max_new_tokens=2)
        assert recorded.tokenizer.threads
        assert all(name.startswith("specwire-prepare") for name in recorded.tokenizer.threads)


def test_full_queue_refuses_before_preparation(recorded):
    options = SchedulerOptions(max_batch_rows=1, max_queued=0)
    with threaded_server(lambda: build_server(recorded, scheduler="batched", scheduler_options=options)) as server:
        batcher = servicer_of(server).engine.batcher
        with TargetClient(server.address) as a, TargetClient(server.address) as b:
            stream = a.stream(PROMPT, **LONG)
            next(stream)  # running: the one slot is taken
            gate = hold_scheduler(server)  # and it stays taken: no forward runs
            try:
                assert batcher.free_slots == 0
                error = exhausted(b.generate, BAD_IDS, max_new_tokens=2)
                assert "queued" in error.message and "--max-queued 0" in error.message
                exhausted(b.generate, text="never tokenized", max_new_tokens=2)
                assert recorded.tokenizer.threads == []
            finally:
                gate.set()
                stream.close()
        # The cancellation frees the slot on the scheduler's thread, after close() returns.
        wait_for(lambda: batcher.free_slots == 1)
        with TargetClient(server.address) as client:
            assert client.generate(PROMPT, max_new_tokens=2).sequences.shape == (1, 7)


def test_concurrent_rpc_cap_spares_health_checks(loaded):
    options = SchedulerOptions(max_batch_rows=2)
    build = lambda: build_server(loaded, scheduler_options=options, max_concurrent_rpcs=1)  # noqa: E731
    with threaded_server(build) as server:
        with TargetClient(server.address) as a, TargetClient(server.address) as b:
            stream = a.stream(PROMPT, **LONG)
            next(stream)  # one RPC in flight: the cap
            gate = hold_scheduler(server)
            try:
                error = exhausted(b.generate, PROMPT, max_new_tokens=2)
                assert "--max-concurrent-rpcs 1" in error.message
                exhausted(b.model_info)
                with secure_channel(server.address) as channel:
                    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            finally:
                gate.set()
                stream.close()
        with TargetClient(server.address) as client:
            for _ in range(3):  # the stream's end gave its place back
                try:
                    assert client.generate(PROMPT, max_new_tokens=2).sequences.shape == (1, 7)
                    break
                except SpecwireRpcError as exc:  # the server may not have seen the cancel yet
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    threading.Event().wait(exc.retry_after_s)
            else:
                pytest.fail("the cap was never released")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    db = tmp_path_factory.mktemp("registry") / "r.db"
    build = lambda: build_config_server(str(db), max_config_bytes=2000, max_extra_bytes=200)  # noqa: E731
    with threaded_server(build) as server:
        with ConfigClient(server.address) as client:
            yield client


def config_refused(fn, *args) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    return info.value


def test_config_service_caps_config_size(registry):
    big = {"do_sample": True, "bad_words_ids": [[i, i + 1] for i in range(5, 500)]}
    error = config_refused(registry.create, "big", big)
    assert {v.field for v in error.violations} == {"config"}
    assert "--max-config-bytes" in error.message
    config_refused(registry.validate, big)
    error = config_refused(registry.import_json, json.dumps(big), "big")
    assert {v.field for v in error.violations} == {"json"} and "--max-config-bytes" in error.message
    small = {"do_sample": True, "bad_words_ids": [[5, 6]]}
    assert registry.create("small", small).version == 1
    config_refused(registry.update, "small", big)


def test_config_service_caps_extra(registry):
    extra = {"do_sample": True, "custom_notes": "x" * 300}
    error = config_refused(registry.create, "extra", extra)
    assert {v.field for v in error.violations} == {"config.extra"} and "--max-extra-bytes" in error.message
    error = config_refused(registry.import_json, json.dumps(extra), "extra")
    assert {v.field for v in error.violations} == {"config.extra"}
    assert registry.create("extra", {"do_sample": True, "custom_notes": "short"}).version == 1
