"""Liveness that tells the truth, on real servers: health goes NOT_SERVING when the device fails, the
scheduler thread dies or the forward loop is stuck, and RPCs then fail fast with UNAVAILABLE; deadlines
reach the config lookup and the draft rounds; the config resolver's caches are bounded; keepalive
finds a hung peer; SIGTERM drains in-flight requests within the grace period.

Faults are injected the test-only way: the served model's `forward` (the packed forward runs through
`model(...)` with `lean_forward=False`) is replaced, after start-up, by one that raises or blocks."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.head_of_line import HungDraftService
from specwire.client import ConfigClient, SpecwireRpcError, TargetClient
from specwire.config.v1 import config_service_pb2_grpc as config_pb_grpc
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.deadline import set_caller_deadline
from specwire.errors import DeadlineExceeded
from specwire.models import load_model
from specwire.security.channels import KEEPALIVE_CLIENT_OPTIONS, secure_channel
from specwire.serving import KEEPALIVE_SERVER_OPTIONS, GrpcServer
from specwire.target_service.__main__ import build_server
from specwire.target_service.config_resolver import ConfigResolver, LruCache
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.scheduler.options import SchedulerOptions
from tests.servers import free_port, subprocess_server, threaded_server, wait_for

PROMPT = [5, 6, 7, 8, 9]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str) -> int:
    with secure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def fresh_model(tiny_model_dir):
    # Its own copy: the tests replace its forward.
    return load_model(str(tiny_model_dir), progress=False)


def serve(loaded, scheduler: str, **kwargs):
    options = SchedulerOptions(lean_forward=False)  # packed forwards call model(...), so the fault reaches them
    return threaded_server(lambda: build_server(loaded, scheduler=scheduler, scheduler_options=options, **kwargs))


def generate(address: str, timeout: float = 30.0, **kwargs):
    with TargetClient(address, timeout=timeout) as client:
        return client.generate([PROMPT], max_new_tokens=kwargs.pop("max_new_tokens", 8), **kwargs)


class ThreadKiller(BaseException):
    """Not an `Exception`: nothing in the forward path catches it, so it ends the scheduler's thread."""


@pytest.mark.parametrize("scheduler", ["batched", "sequential"])
def test_device_error_makes_the_service_not_serving_and_rpcs_fail_fast(tiny_model_dir, scheduler):
    loaded = fresh_model(tiny_model_dir)
    with serve(loaded, scheduler) as server:
        generate(server.address)  # healthy: it generates
        assert health(server.address) == SERVING

        def broken(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        loaded.model.forward = broken
        with pytest.raises(SpecwireRpcError) as info:
            generate(server.address)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "device failed" in info.value.message
        wait_for(lambda: health(server.address) == NOT_SERVING)
        # Sticky: even with the model working again, the device context is not trusted.
        del loaded.model.forward
        with pytest.raises(SpecwireRpcError) as info:
            generate(server.address)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert health(server.address) == NOT_SERVING


@pytest.mark.parametrize("lane", [False, True], ids=["batched", "lane"])
def test_dead_scheduler_thread_fails_in_flight_and_new_requests(tiny_model_dir, lane):
    in_flight = dict(use_cache=False) if lane else {}  # use_cache=False runs in the sequential lane
    loaded = fresh_model(tiny_model_dir)
    with serve(loaded, "batched") as server:
        batcher = server.server.bindings[0].servicer.engine.batcher
        generate(server.address)
        calls = []

        def dies(*args, **kwargs):
            calls.append(1)
            raise ThreadKiller("injected")

        loaded.model.forward = dies
        with pytest.raises(SpecwireRpcError) as info:
            generate(server.address, **in_flight)  # in flight when the thread dies: not left waiting forever
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "ThreadKiller" in info.value.message
        wait_for(lambda: not batcher.thread.is_alive())
        wait_for(lambda: health(server.address) == NOT_SERVING)
        del loaded.model.forward
        with pytest.raises(SpecwireRpcError) as info:
            generate(server.address)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(calls) == 1  # refused before reaching the model


@pytest.mark.parametrize("scheduler", ["batched", "sequential"])
def test_stuck_forward_loop_is_not_serving_until_it_moves_again(tiny_model_dir, scheduler):
    loaded = fresh_model(tiny_model_dir)
    with serve(loaded, scheduler, stuck_after=0.5) as server:
        want = generate(server.address).sequences
        release, entered = threading.Event(), threading.Event()
        original = loaded.model.forward

        def hangs(*args, **kwargs):
            entered.set()
            release.wait(60)
            return original(*args, **kwargs)

        loaded.model.forward = hangs
        result, errors = {}, []

        def in_flight():
            try:
                result["out"] = generate(server.address, timeout=120).sequences
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        worker = threading.Thread(target=in_flight)
        worker.start()
        try:
            assert entered.wait(30)
            wait_for(lambda: health(server.address) == NOT_SERVING)
            with pytest.raises(SpecwireRpcError) as info:
                generate(server.address, timeout=60)  # fails at once, not after 60 s
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stuck" in info.value.message or "running for" in info.value.message
        finally:
            loaded.model.forward = original
            release.set()
        worker.join(60)
        assert not errors, errors
        assert torch.equal(result["out"], want)  # the stalled request finishes once the loop moves
        wait_for(lambda: health(server.address) == SERVING)
        assert torch.equal(generate(server.address).sequences, want)


def test_draft_round_waits_at_most_the_callers_remaining_time(tiny_model_dir):
    loaded = fresh_model(tiny_model_dir)
    with (
        HungDraftService() as hung,
        threaded_server(
            lambda: build_server(loaded, drafting=DraftPolicy(hung.address, round_timeout_s=600.0))
        ) as server,
    ):
        servicer = server.server.bindings[0].servicer
        with TargetClient(server.address) as client:
            with pytest.raises(SpecwireRpcError) as info:
                client.generate([PROMPT], max_new_tokens=8, proposer="draft_model", timeout=1.0)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The request's thread stopped waiting on the hung draft service with its caller (not after
        # the 600 s round timeout): its slot is back and no request is left running.
        batcher = servicer.engine.batcher
        wait_for(lambda: batcher.stats().running == 0 and batcher.free_slots == batcher.cache.num_slots)
        assert hung.streams == 1


def test_config_lookup_uses_the_callers_remaining_time():
    # A registry that never answers GetConfig, a resolver whose own cap is 600 s, a caller with 0.5 s
    # left: the lookup ends with the caller's deadline (the test fails rather than hangs without it).
    class HungRegistry(config_pb_grpc.ConfigServiceServicer):
        async def GetConfig(self, request, context):  # noqa: N802 - the gRPC method name
            await asyncio.sleep(3600)

    async def scenario():
        server = grpc.aio.server()
        config_pb_grpc.add_ConfigServiceServicer_to_server(HungRegistry(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        resolver = ConfigResolver(f"127.0.0.1:{port}", timeout_s=600.0)
        try:
            set_caller_deadline(0.5)
            with pytest.raises(DeadlineExceeded):
                await asyncio.wait_for(resolver.resolve("anything"), 60)
            set_caller_deadline(0.0)  # no time left: not even sent
            with pytest.raises(DeadlineExceeded, match="before the config lookup"):
                await resolver.resolve("anything")
        finally:
            await resolver.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_config_resolver_caches_are_bounded(tmp_path):
    cache: LruCache[str, int] = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recently used
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3 and len(cache) == 2

    with threaded_server(lambda: build_config_server(str(tmp_path / "registry.db"))) as registry:
        with ConfigClient(registry.address) as client:
            for i in range(6):
                client.create(f"c{i}", {"max_new_tokens": 4 + i})

        async def lookups():
            resolver = ConfigResolver(registry.address, max_entries=3)
            for i in range(6):
                assert (await resolver.resolve(f"c{i}@1")).config.max_new_tokens == 4 + i
                assert (await resolver.resolve(f"c{i}")).config.max_new_tokens == 4 + i
            sizes = len(resolver._pinned), len(resolver._moving)
            await resolver.close()
            return sizes

        assert asyncio.run(lookups()) == (3, 3)


def test_servers_and_channels_have_keepalive():
    server = GrpcServer([])
    options = dict(server.options)
    for key, value in KEEPALIVE_SERVER_OPTIONS:
        assert options[key] == value
    # gRPC core times keepalive pings out after the ping timeout: it must not outlast the keepalive's.
    for options_of in (options, dict(KEEPALIVE_CLIENT_OPTIONS)):
        assert options_of["grpc.http2.ping_timeout_ms"] == options_of["grpc.keepalive_timeout_ms"]
    # The servers accept the clients' pings.
    client = dict(KEEPALIVE_CLIENT_OPTIONS)
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert options["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1


def test_a_servers_on_stop_runs_once_it_stopped_off_its_event_loop():
    """`on_stop` (the services close their threads and database there) runs after the server stopped serving,
    on another thread than the event loop's (joining threads that post to the loop would deadlock it)."""
    seen = []

    def on_stop():
        try:
            answer = health(server.address)
        except grpc.RpcError as error:
            answer = error.code()
        seen.append((threading.current_thread(), answer))

    with threaded_server(lambda: GrpcServer([], on_stop=on_stop)) as server:
        loop_thread = server.thread
        assert seen == []
    assert len(seen) == 1 and seen[0][0] is not loop_thread
    assert seen[0][1] == grpc.StatusCode.UNAVAILABLE  # the server no longer answers by then


def test_keepalive_finds_a_hung_server(tmp_path):
    # A config service process, SIGSTOPped after a first call: its TCP connection stays open (the
    # kernel keeps acking), so only keepalive can tell. With a 1 s ping the call fails UNAVAILABLE,
    # long before its 60 s deadline.
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "specwire.config_service", "--port", str(port), "--db", str(tmp_path / "r.db")],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from specwire.client.health import wait_healthy

        wait_healthy(f"127.0.0.1:{port}", timeout=60, process=process)
        # No pings while idle: one that timed out between the two calls would close the connection
        # before the second call is sent, and that call would wait on a reconnect (the stopped
        # process's kernel still accepts TCP). Only the in-flight call is pinged. No read retry: it would
        # resend the call on a new connection to the stopped process, which waits out gRPC's 20 s connect
        # timeout (the keepalive had already failed the first attempt within ~2 s).
        fast = [
            ("grpc.keepalive_time_ms", 1000),
            ("grpc.keepalive_timeout_ms", 1000),
            ("grpc.http2.ping_timeout_ms", 1000),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.enable_retries", 0),
        ]
        channel = secure_channel(f"127.0.0.1:{port}", fast)
        client = ConfigClient(channel=channel, timeout=60)
        assert client.list() == []
        process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(SpecwireRpcError) as info:
                client.list()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            process.send_signal(signal.SIGCONT)
            channel.close()
    finally:
        process.terminate()
        process.wait(30)


def test_sigterm_drains_in_flight_requests_then_exits_cleanly(tiny_model_dir):
    # The in-flight request waits 3 s on a hung draft service, then finishes with plain decoding:
    # it is running when SIGTERM arrives, and finishes within the 30 s grace.
    with HungDraftService() as hung:
        port = free_port()
        args = [
            "specwire.target_service",
            "--port",
            str(port),
            "--model",
            str(tiny_model_dir),
            "--draft-address",
            hung.address,
            "--draft-timeout",
            "3",
            "--grace",
            "30",
        ]
        process = subprocess.Popen(
            [sys.executable, "-m", *args],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            from specwire.client.health import wait_healthy

            address = f"127.0.0.1:{port}"
            wait_healthy(address, timeout=120, process=process)
            with TargetClient(address, timeout=60) as client:
                stream = client.stream([PROMPT], max_new_tokens=12, min_new_tokens=12, proposer="draft_model")
                first = next(stream)  # step 0 is out; the request now waits on the hung draft service
                wait_for(lambda: hung.streams == 1)
                process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                # New calls are refused while it drains.
                time.sleep(0.5)
                with pytest.raises(SpecwireRpcError) as info:
                    with TargetClient(address, timeout=5) as late:
                        late.generate([PROMPT], max_new_tokens=2)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                rest = list(stream)
            final = rest[-1]
            assert final.sequences.shape[1] == len(PROMPT) + 12  # the in-flight generation completed
            assert "draft" in final.speculation.fallback_reason
            assert first.token_ids == final.sequences[0, len(PROMPT) : len(PROMPT) + 1].tolist()
            code = process.wait(30 + 15)
            output = process.stdout.read()
            assert code == 0, output
            assert time.monotonic() - signalled < 30 + 15
            # The start said how it drafts: a CPU target with its draft service on loopback does not overlap.
            assert "draft overlap off (auto: the draft service" in output
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_sigterm_with_a_forward_stuck_on_its_device_exits_1_without_waiting_for_it(tiny_model_dir, tmp_path):
    """A stopped target whose model thread does not end (stuck in a forward) reports it and exits 1 once the
    engine's bound (10 s) passed: Python's exit would wait for that thread forever."""
    port, flag = free_port(), tmp_path / "stuck"
    args = ["--port", str(port), "--model", str(tiny_model_dir), "--scheduler", "sequential", "--grace", "1"]
    with subprocess_server(["tests.service.stuck_target", str(flag), *args], port) as process:
        flag.touch()
        caller = threading.Thread(target=_generate_quietly, args=(f"127.0.0.1:{port}",), daemon=True)
        caller.start()
        before = list(itertools.takewhile(lambda line: line.strip() != "forward stuck", process.stdout))
        assert process.poll() is None, before
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = process.wait(60)
        output = process.stdout.read()
        assert code == 1, output
        assert time.monotonic() - signalled < 1 + 10 + 15
        assert "target-service: exiting without waiting for specwire-model" in output, output
        assert "stuck on its device" in output


def _generate_quietly(address: str) -> None:
    with TargetClient(address, timeout=60) as client, contextlib.suppress(SpecwireRpcError):
        client.generate([PROMPT], max_new_tokens=4)
