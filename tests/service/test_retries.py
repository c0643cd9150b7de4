"""Retries on real servers: every client channel retries the idempotent reads on UNAVAILABLE (and
nothing that writes), generation only while no target has taken it up (before its response headers),
and the clients' `retries=` sends a call the server refused for load (RESOURCE_EXHAUSTED with a retry
hint) again after the hinted wait, within the call's timeout.

Faults are injected in front of the real config service (`tests.servers.InjectedFaults`); the target
is saturated for real (its preparation pool held full, as in test_admission.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specwire.client import AsyncTargetClient, ConfigClient, SpecwireRpcError, TargetClient
from specwire.client.retrying import JITTER
from specwire.config.v1 import config_service_pb2
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.models import load_model
from specwire.security.channels import IDEMPOTENT_READS, secure_channel
from specwire.target.v1 import target_service_pb2
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.admission import PreparationPool
from tests.servers import InjectedFaults, threaded_server

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
CONFIG = {"max_new_tokens": 3}


def failing(code, fn, *args, **kwargs) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value
    return info.value


@pytest.fixture
def registry_with(tmp_path):
    """`registry_with(faults)`: a real config service with `faults` in front of it (a context manager)."""

    def start(faults: InjectedFaults):
        return threaded_server(lambda: faults.install(build_config_server(str(tmp_path / "r.db"))))

    return start


def test_retried_reads_are_reads_of_the_real_services():
    # A typo in the list would silently retry nothing; a write in it would repeat writes.
    services = {
        "specwire.config.v1.ConfigService": config_service_pb2.DESCRIPTOR.services_by_name["ConfigService"],
        "specwire.target.v1.TargetService": target_service_pb2.DESCRIPTOR.services_by_name["TargetService"],
        "grpc.health.v1.Health": health_pb2.DESCRIPTOR.services_by_name["Health"],
    }
    for service, methods in IDEMPOTENT_READS.items():
        for method in methods:
            descriptor = services[service].methods_by_name[method]
            assert not descriptor.client_streaming and not descriptor.server_streaming, method
    reads = {m for methods in IDEMPOTENT_READS.values() for m in methods}
    writes = {"CreateConfig", "UpdateConfig", "SetTag", "DeleteConfig", "ImportConfig", "Generate", "GenerateStream"}
    assert not reads & writes


class _CutAfterHeaders:
    """Each method's first call is taken up (response headers sent, as the target does on admission) and
    then fails UNAVAILABLE: a replica killed in the middle of a generation."""

    def __init__(self):
        self.calls = 0

    def install(self, server):
        cut = self

        class Interceptor(grpc.aio.ServerInterceptor):
            async def intercept_service(self, continuation, details):
                if not details.method.endswith("/Generate"):
                    return await continuation(details)
                cut.calls += 1
                if cut.calls > 1:
                    return await continuation(details)

                async def taken_up_then_lost(request, context):
                    await context.send_initial_metadata(())
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: the replica went away")

                return grpc.unary_unary_rpc_method_handler(taken_up_then_lost)

        server.interceptors.insert(0, Interceptor())
        return server


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE])
def test_generation_no_target_took_up_is_resent(loaded, code):
    # A draining replica's gRPC core cancels the calls it received but had not handed to a handler
    # (grpc/grpc#41785); they never ran, so the channel sends them again.
    faults = InjectedFaults(code)
    with threaded_server(lambda: faults.install(build_target_server(loaded))) as server:
        with TargetClient(server.address, timeout=30) as client:
            out = client.generate(PROMPT, max_new_tokens=3)
    assert out.sequences.shape[1] == PROMPT.shape[1] + 3
    assert faults.count("TargetService/Generate") == 2


def test_generation_a_target_took_up_is_not_resent(loaded):
    cut = _CutAfterHeaders()
    with threaded_server(lambda: cut.install(build_target_server(loaded))) as server:
        with TargetClient(server.address, timeout=30) as client:
            failing(grpc.StatusCode.UNAVAILABLE, client.generate, PROMPT, max_new_tokens=3)
            assert cut.calls == 1  # heard once, never resent
            assert client.generate(PROMPT, max_new_tokens=3).sequences.shape[1] == PROMPT.shape[1] + 3


def test_reads_are_retried_on_unavailable_and_writes_are_not(registry_with):
    faults = InjectedFaults(grpc.StatusCode.UNAVAILABLE)  # each method's first call fails
    with registry_with(faults) as server, ConfigClient(server.address, timeout=10) as client:
        # Writes: the first call of each fails, once, and the client hears it.
        failing(grpc.StatusCode.UNAVAILABLE, client.create, "chat", CONFIG)
        assert faults.count("ConfigService/CreateConfig") == 1
        assert client.create("chat", CONFIG).version == 1
        failing(grpc.StatusCode.UNAVAILABLE, client.update, "chat", {"max_new_tokens": 4})
        failing(grpc.StatusCode.UNAVAILABLE, client.set_tag, "chat", "prod", 1)
        failing(grpc.StatusCode.UNAVAILABLE, client.import_json, json.dumps(CONFIG), "imported")
        failing(grpc.StatusCode.UNAVAILABLE, client.delete, "chat")
        for write in ("UpdateConfig", "SetTag", "ImportConfig", "DeleteConfig"):
            assert faults.count(f"ConfigService/{write}") == 1, write
        # Reads: the channel sends them again, and the caller never sees the first failure.
        assert client.get("chat").version == 1
        assert [r.name for r in client.list()] == ["chat"]
        assert json.loads(client.export("chat@1"))["max_new_tokens"] == 3
        assert client.validate(CONFIG).valid
        with secure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        for read in ("GetConfig", "ListConfigs", "ExportConfig", "ValidateConfig", "Health/Check"):
            assert faults.count(read) == 2, read
    # Without the policy the same read fails: it is the channel's retry policy that hid the failure.
    faults = InjectedFaults(grpc.StatusCode.UNAVAILABLE)
    with registry_with(faults) as server:
        channel = secure_channel(server.address, [("grpc.enable_retries", 0)])
        with ConfigClient(channel=channel) as client:
            failing(grpc.StatusCode.UNAVAILABLE, client.get, "chat")
        channel.close()
    # Other codes are answers: not retried.
    faults = InjectedFaults(grpc.StatusCode.INTERNAL)
    with registry_with(faults) as server, ConfigClient(server.address) as client:
        failing(grpc.StatusCode.INTERNAL, client.get, "chat")
        assert faults.count("GetConfig") == 1


def test_a_read_outlasts_a_registry_that_comes_back_during_the_backoff(registry_with):
    # Three failures in a row, then the real answer: within the policy's 4 attempts.
    faults = InjectedFaults(grpc.StatusCode.UNAVAILABLE, fail_first=3)
    with registry_with(faults) as server, ConfigClient(server.address) as client:
        assert client.validate(CONFIG).valid
        assert faults.count("ValidateConfig") == 4
    # Past the policy's attempts the caller gets UNAVAILABLE (no endless retrying).
    faults = InjectedFaults(grpc.StatusCode.UNAVAILABLE, fail_first=10)
    with registry_with(faults) as server, ConfigClient(server.address) as client:
        failing(grpc.StatusCode.UNAVAILABLE, client.validate, CONFIG)
        assert faults.count("ValidateConfig") == 4


def test_config_client_retries_load_refusals_after_the_hint(registry_with):
    hint = 0.3
    faults = InjectedFaults(grpc.StatusCode.RESOURCE_EXHAUSTED, [("retry-after-s", f"{hint:.3f}")])
    with registry_with(faults) as server:
        with ConfigClient(server.address) as plain:
            error = failing(grpc.StatusCode.RESOURCE_EXHAUSTED, plain.create, "chat", CONFIG)  # retries=0: today's
            assert error.retry_after_s == pytest.approx(hint)
        with ConfigClient(server.address, retries=2) as client:
            assert client.create("chat", CONFIG).version == 1  # CreateConfig's refusal was the plain client's
            # A write refused before it ran is safe to send again: it lands exactly once.
            started = time.monotonic()
            assert client.update("chat", {"max_new_tokens": 4}).version == 2
            assert hint <= time.monotonic() - started < 5
            assert faults.count("UpdateConfig") == 2
            assert [client.get(f"chat@{v}").config.max_new_tokens for v in (1, 2)] == [3, 4]
    # Within the call's timeout only: a hint that ends past it is not waited for.
    faults = InjectedFaults(grpc.StatusCode.RESOURCE_EXHAUSTED, [("retry-after-s", "5.000")])
    with registry_with(faults) as server, ConfigClient(server.address, timeout=1.0, retries=3) as client:
        started = time.monotonic()
        failing(grpc.StatusCode.RESOURCE_EXHAUSTED, client.get, "chat")
        assert time.monotonic() - started < 1.0 and faults.count("GetConfig") == 1
    # RESOURCE_EXHAUSTED with no hint (e.g. a message over the size limit) would fail again: not retried.
    faults = InjectedFaults(grpc.StatusCode.RESOURCE_EXHAUSTED)
    with registry_with(faults) as server, ConfigClient(server.address, retries=3) as client:
        failing(grpc.StatusCode.RESOURCE_EXHAUSTED, client.list)
        assert faults.count("ListConfigs") == 1
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        ConfigClient("127.0.0.1:1", retries=-1)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


def test_target_clients_retry_a_saturated_target_after_its_hint(loaded):
    # The preparation pool's one place is held: every request is refused with a 0.5 s hint until the
    # hold ends, 0.8 s in.
    pool = PreparationPool(workers=1, max_in_flight=1, retry_after_s=0.5)
    with threaded_server(lambda: build_target_server(loaded, pool=pool)) as server:

        def saturate(seconds: float) -> None:
            deadline = time.monotonic() + 10
            while pool.in_flight and time.monotonic() < deadline:  # the previous hold's thread is ending
                time.sleep(0.02)
            gate = threading.Event()
            asyncio.run_coroutine_threadsafe(pool.run(gate.wait, 60), server.loop)
            server.run(asyncio.sleep(0))
            assert pool.in_flight == 1
            threading.Timer(seconds, gate.set).start()

        with TargetClient(server.address) as plain, TargetClient(server.address, retries=3) as patient:
            saturate(0.8)
            failing(grpc.StatusCode.RESOURCE_EXHAUSTED, plain.generate, PROMPT, max_new_tokens=2)  # retries=0
            started = time.monotonic()
            assert patient.generate(PROMPT, max_new_tokens=2).sequences.shape == (1, 7)
            assert 0.5 <= time.monotonic() - started < 10
            # A stream refused before its first message is sent again too.
            saturate(0.8)
            final = list(patient.stream(PROMPT, max_new_tokens=2))[-1]
            assert final.sequences.shape == (1, 7)
            # Not past the call's timeout: a 0.5 s hint with 0.3 s left is the caller's answer at once.
            saturate(2.0)
            started = time.monotonic()
            failing(grpc.StatusCode.RESOURCE_EXHAUSTED, patient.generate, PROMPT, max_new_tokens=2, timeout=0.3)
            assert time.monotonic() - started < 0.3
        with TargetClient(server.address, retries=2) as limited:
            saturate(3.0)
            started = time.monotonic()
            failing(grpc.StatusCode.RESOURCE_EXHAUSTED, limited.generate, PROMPT, max_new_tokens=2)
            # Not more than `retries` times: 2 retries of 0.5 s (+ jitter) end before the 3 s hold does.
            assert 2 * 0.5 <= time.monotonic() - started < 2 * 0.5 * (1 + JITTER) + 1.0

        async def with_async_client():
            async with AsyncTargetClient(server.address, retries=3) as client:
                started = time.monotonic()
                out = await client.generate(PROMPT, max_new_tokens=2)
                return out, time.monotonic() - started

        saturate(0.8)
        out, took = asyncio.run(with_async_client())
        assert out.sequences.shape == (1, 7) and took >= 0.5


def test_cli_retries_load_refusals_with_the_retries_option(registry_with, loaded, capsys):
    from specwire.client.cli import main

    faults = InjectedFaults(grpc.StatusCode.RESOURCE_EXHAUSTED, [("retry-after-s", "0.200")], fail_first=2)
    with registry_with(faults) as server:
        base = ["config", "--address", server.address]
        assert main([*base, "list"]) == 1  # no retry: the first refusal is the answer
        assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err
        assert main([*base, "--retries", "1", "list"]) == 0  # the second refusal, then the answer
        assert faults.count("ListConfigs") == 3
    with pytest.raises(SystemExit) as usage:
        main(["config", "--retries", "-1", "list"])
    assert usage.value.code == 2
    assert "--retries" in capsys.readouterr().err
    # generate: a saturated target's refusal is waited out.
    pool = PreparationPool(workers=1, max_in_flight=1, retry_after_s=0.3)
    with threaded_server(lambda: build_target_server(loaded, pool=pool)) as server:
        gate = threading.Event()
        asyncio.run_coroutine_threadsafe(pool.run(gate.wait, 60), server.loop)
        server.run(asyncio.sleep(0))
        threading.Timer(0.5, gate.set).start()
        base = ["generate", "Hi", "--address", server.address, "--no-chat", "--json", "--set", "max_new_tokens=2"]
        assert main(base) == 1
        assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err
        started = time.monotonic()
        assert main([*base, "--retries", "5"]) == 0
        assert len(json.loads(capsys.readouterr().out)["sequences"][0]) > 2 and time.monotonic() - started >= 0.2
