"""Serving through registry outages, on real servers: a target subprocess keeps serving `name:tag`
from its last good value, with a warning naming the reference and its age, while the config service
is SIGKILLed, up to `--config-stale-max`, then fails UNAVAILABLE; `name@N` keeps working with no
warning; NOT_FOUND is never masked by a cached value; a hung (SIGSTOPped) registry costs a request
no more than its own deadline, and one lookup timeout in all; concurrent lookups share one fetch."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import grpc
import pytest
import torch

from specwire.client import ConfigClient, SpecwireRpcError, TargetClient
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.deadline import set_caller_deadline
from specwire.errors import DeadlineExceeded, Unavailable
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.config_resolver import ConfigResolver
from tests.servers import InjectedFaults, free_port, subprocess_server, threaded_server

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
REGISTRY = "specwire.config.v1.ConfigService"
TTL_S = 2.0  # the resolver's refresh period (ConfigResolver's default)
STALE_MAX_S = 8.0


def failing(code, fn, *args, **kwargs) -> SpecwireRpcError:
    with pytest.raises(SpecwireRpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value
    return info.value


def wait_until(moment: float) -> None:
    time.sleep(max(moment - time.monotonic(), 0.0))


def stale_age(output, ref: str) -> float:
    """The age a stale-config warning reports for `ref` (the warning must be there)."""
    (warning,) = [w for w in output.warnings if w.field == "config_ref"]
    assert warning.severity == "warning" and ref in warning.value, warning
    match = re.search(r"(\d+\.\d)s old", warning.message)
    assert match, warning.message
    assert "--config-stale-max" in warning.message and "unreachable" in warning.message
    return float(match.group(1))


def registry_args(port: int, db) -> list[str]:
    return ["specwire.config_service", "--port", str(port), "--db", str(db)]


def test_target_serves_the_last_good_config_while_the_registry_is_killed(tmp_path, tiny_model_dir):
    registry_port, target_port = free_port(), free_port()
    with subprocess_server(registry_args(registry_port, tmp_path / "r.db"), registry_port, REGISTRY) as registry:
        with ConfigClient(f"127.0.0.1:{registry_port}") as admin:
            admin.create("chat", {"max_new_tokens": 3})
            admin.set_tag("chat", "prod", 1)
            admin.create("gone", {"max_new_tokens": 2})
        target_args = [
            "specwire.target_service",
            "--port",
            str(target_port),
            "--model",
            str(tiny_model_dir),
            "--config-address",
            f"127.0.0.1:{registry_port}",
            "--config-stale-max",
            str(STALE_MAX_S),
        ]
        with (
            subprocess_server(target_args, target_port, timeout=180),
            TargetClient(f"127.0.0.1:{target_port}") as client,
        ):
            assert client.generate(PROMPT, generation_config="gone").warnings == []
            # NOT_FOUND is the registry's answer: the cached value of a deleted config is not served.
            with ConfigClient(f"127.0.0.1:{registry_port}") as admin:
                admin.delete("gone")
            time.sleep(TTL_S + 0.2)
            failing(grpc.StatusCode.NOT_FOUND, client.generate, PROMPT, generation_config="gone")

            fresh = client.generate(PROMPT, generation_config="chat:prod")
            fetched = time.monotonic()
            assert fresh.warnings == [] and fresh.sequences.shape == (1, 5 + 3)
            assert client.generate(PROMPT, generation_config="chat@1").warnings == []

            registry.send_signal(signal.SIGKILL)
            registry.wait(10)
            wait_until(fetched + TTL_S + 0.5)  # due for a refresh, and the registry is gone
            stale = client.generate(PROMPT, generation_config="chat:prod")
            assert (stale.config_name, stale.config_version) == ("chat", 1)
            assert torch.equal(stale.sequences, fresh.sequences)  # the same config, served
            assert TTL_S <= stale_age(stale, "chat:prod") <= STALE_MAX_S
            # A stream's final response carries the warning too.
            final = list(client.stream(PROMPT, generation_config="chat:prod"))[-1]
            assert stale_age(final, "chat:prod") >= TTL_S
            # A pinned version is immutable: cached for good, never stale.
            pinned = client.generate(PROMPT, generation_config="chat@1")
            assert pinned.warnings == [] and torch.equal(pinned.sequences, fresh.sequences)
            # A reference never resolved has no last good value.
            error = failing(grpc.StatusCode.UNAVAILABLE, client.generate, PROMPT, generation_config="chat:canary")
            assert "chat:canary" in error.message and "bring the registry back" in error.message

            wait_until(fetched + STALE_MAX_S + 0.5)
            error = failing(grpc.StatusCode.UNAVAILABLE, client.generate, PROMPT, generation_config="chat:prod")
            assert "'chat:prod'" in error.message and f"--config-stale-max {STALE_MAX_S:g}s" in error.message
            assert re.search(r"is \d+s old", error.message), error.message
            assert client.generate(PROMPT, generation_config="chat@1").warnings == []


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


def test_a_hung_registry_costs_a_request_its_deadline_at_most(tmp_path, loaded):
    # SIGSTOP: the registry's kernel still accepts connections and data, nothing answers (a partition
    # or a frozen node). Lookups then end with the lookup timeout (5 s) or the caller's deadline.
    port = free_port()
    with subprocess_server(registry_args(port, tmp_path / "r.db"), port, REGISTRY) as registry:
        address = f"127.0.0.1:{port}"
        with ConfigClient(address) as admin:
            admin.create("chat", {"max_new_tokens": 3})
            admin.set_tag("chat", "prod", 1)
        build = lambda: build_target_server(loaded, address, config_stale_max=60)  # noqa: E731
        with threaded_server(build) as target, TargetClient(target.address) as client:
            assert client.generate(PROMPT, generation_config="chat:prod").warnings == []
            fetched = time.monotonic()
            registry.send_signal(signal.SIGSTOP)
            try:
                # A deadline shorter than the 5 s lookup timeout bounds the lookup.
                started = time.monotonic()
                failing(grpc.StatusCode.DEADLINE_EXCEEDED, client.generate, PROMPT, generation_config="chat", timeout=1)
                assert time.monotonic() - started < 3
                # Due for a refresh: the lookup times out (5 s), then the last good value is served.
                wait_until(fetched + TTL_S + 0.2)
                started = time.monotonic()
                stale = client.generate(PROMPT, generation_config="chat:prod", timeout=30)
                assert 4 < time.monotonic() - started < 15
                assert stale_age(stale, "chat:prod") > 4
                assert "DEADLINE_EXCEEDED" in stale.warnings[0].message
                # Right after a failed refresh, requests get the stale value without waiting again.
                started = time.monotonic()
                again = client.generate(PROMPT, generation_config="chat:prod", timeout=30)
                assert time.monotonic() - started < 2 and stale_age(again, "chat:prod") > 4
            finally:
                registry.send_signal(signal.SIGCONT)
            # Back: a background refresh (one per TTL) gets the fresh value, and the warnings stop.
            give_up = time.monotonic() + 20
            while client.generate(PROMPT, generation_config="chat:prod").warnings and time.monotonic() < give_up:
                time.sleep(0.3)
            assert client.generate(PROMPT, generation_config="chat:prod").warnings == []


def test_stale_serving_can_be_turned_off(tmp_path):
    faults = InjectedFaults(fail_first=10**6)  # no code yet: every call goes through

    async def scenario(registry_address: str, stale_max_s: float):
        faults.code = None
        resolver = ConfigResolver(registry_address, ttl_s=0.2, stale_max_s=stale_max_s)
        try:
            first = await resolver.resolve("chat:prod")
            faults.code = grpc.StatusCode.UNAVAILABLE  # from now on the registry is unreachable
            await asyncio.sleep(0.3)
            return first, await resolver.resolve("chat:prod")
        finally:
            await resolver.close()

    with threaded_server(lambda: faults.install(build_config_server(str(tmp_path / "r.db")))) as registry:
        with ConfigClient(registry.address) as admin:
            admin.create("chat", {"max_new_tokens": 3})
            admin.set_tag("chat", "prod", 1)
        first, stale = asyncio.run(scenario(registry.address, 30.0))
        assert first.warnings == () and stale.config == first.config and len(stale.warnings) == 1
        with pytest.raises(Unavailable, match=r"stale values are not served \(--config-stale-max 0\)"):
            asyncio.run(scenario(registry.address, 0.0))
    with pytest.raises(ValueError, match="stale_max_s must be >= 0"):
        ConfigResolver("127.0.0.1:1", stale_max_s=-1)


def test_concurrent_lookups_share_one_fetch_and_keep_their_own_deadlines(tmp_path):
    faults = InjectedFaults(delay_s=0.5)  # every call reaches the real registry half a second late
    with threaded_server(lambda: faults.install(build_config_server(str(tmp_path / "r.db")))) as registry:
        with ConfigClient(registry.address) as admin:
            admin.create("chat", {"max_new_tokens": 3})
        faults.calls.clear()

        async def lookups():
            resolver = ConfigResolver(registry.address)
            try:
                results = await asyncio.gather(*(resolver.resolve("chat") for _ in range(8)))
                # A caller with 0.1 s left stops waiting then; the fetch it joined goes on for the others.
                await asyncio.sleep(2.1)  # past the TTL: the next lookup fetches again
                waiting = asyncio.ensure_future(resolver.resolve("chat"))
                await asyncio.sleep(0)
                set_caller_deadline(0.1)
                with pytest.raises(DeadlineExceeded, match="during the config lookup"):
                    await resolver.resolve("chat")
                set_caller_deadline(None)
                return results, await waiting
            finally:
                await resolver.close()

        results, last = asyncio.run(lookups())
        assert {r.version for r in results} == {1} and last.version == 1
        assert faults.count("GetConfig") == 2  # one fetch for the 8, one for the last 2
