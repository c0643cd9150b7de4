"""Two real target processes behind one gRPC name: calls spread over them, and a killed one's share moves.

The name is gRPC's multi-address target `ipv4:127.0.0.1:A,127.0.0.1:B` (a headless Service's DNS
answer, without the DNS). Which replica served how many requests is read from each target's own
Prometheus endpoint (`gen_ai_server_request_duration_seconds_count`, `specwire_target_requests_running`),
as an operator would. Requests that must stay in flight for a while ask for the draft model, whose
service (in this process) answers every stream a few seconds late while the request holds its slot.

Retries, as stated to users (`TargetClient`'s docstring): Generate is not idempotent, so a call in
flight on a replica that dies fails with UNAVAILABLE and is not resent (neither `retries=`, which
resends only load refusals, nor the channel's retry policy, which resends generation only before a
target took it up: the target sends its headers on admission). A call that never reached a replica's
application is resent: by gRPC's transparent retry (gRFC A6) when a draining replica's GOAWAY refused it
unread, by the channel's retry policy when the replica's gRPC core cancelled it before any handler took
it (grpc/grpc#41785). The drain test shows the outcome (no failed call); which of its calls needed a
retry depends on timing and is not asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specwire.client import AsyncTargetClient, SpecwireRpcError, TargetClient
from specwire.client.cli import main as cli_main
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.models import load_model
from specwire.vocabulary import METRIC_REQUESTS_RUNNING
from tests.servers import InjectedFaults, free_port, subprocess_server, threaded_server

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6]
DRAFT_DELAY_S = 3.0
REQUESTS = "gen_ai_server_request_duration_seconds_count"


class Replica:
    """A target subprocess: its gRPC port, its Prometheus port and its process."""

    def __init__(self, port: int, metrics_port: int, process):
        self.port, self.metrics_port, self.process = port, metrics_port, process

    def scrape(self, name: str) -> float:
        """The sum of `name` over every label set, from this replica's scrape endpoint."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)

    def served(self) -> int:
        return int(self.scrape(REQUESTS))


@pytest.fixture(scope="module")
def draft(tiny_model_dir):
    """A draft service in this process answering every stream `DRAFT_DELAY_S` late."""
    loaded = load_model(str(tiny_model_dir), progress=False)
    faults = InjectedFaults(delay_s=DRAFT_DELAY_S)
    with threaded_server(lambda: faults.install(build_draft_server(loaded))) as server:
        yield server.address


@contextlib.contextmanager
def two_targets(model_dir, draft_address: str):
    """Two target processes (with their Prometheus endpoints) using the draft service."""
    with contextlib.ExitStack() as stack:
        found = []
        for _ in range(2):
            port, metrics_port = free_port(), free_port()
            args = ["specwire.target_service", "--port", str(port), "--model", str(model_dir), "--grace", "10"]
            args += ["--draft-address", draft_address, "--draft-timeout", "30"]
            env = {"SPECWIRE_PROMETHEUS_PORT": str(metrics_port)}
            process = stack.enter_context(subprocess_server(args, port, env=env))
            found.append(Replica(port, metrics_port, process))
            # A fresh target's first requests are slow (first forwards, thread pools): warm each one
            # up on its own, so that timing in the tests is that of a running service.
            with TargetClient(f"127.0.0.1:{port}") as client:
                for _ in range(3):
                    client.generate(PROMPT, max_new_tokens=3)
        yield found


@pytest.fixture(scope="module")
def pair(tiny_model_dir, draft):
    with two_targets(tiny_model_dir, draft) as found:
        yield found


def target_of(pair) -> str:
    return "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in pair)


def test_round_robin_gives_each_replica_a_share_of_32_requests(pair):
    before = [r.served() for r in pair]
    with TargetClient(target_of(pair)) as client, ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(lambda _: client.generate(PROMPT, max_new_tokens=3), range(32)))
    assert all(o.sequences.shape == (1, len(PROMPT) + 3) for o in outputs)
    shares = [r.served() - n for r, n in zip(pair, before, strict=True)]
    assert sum(shares) == 32
    assert min(shares) >= 8, shares  # round robin: about half each, whatever the thread timing


def test_the_asyncio_client_balances_too(pair):
    async def main():
        async with AsyncTargetClient(target_of(pair)) as client:
            await client.model_info()  # connects; then let both replicas' connections come up
            await asyncio.sleep(0.5)
            return await asyncio.gather(*(client.generate(PROMPT, max_new_tokens=3) for _ in range(16)))

    before = [r.served() for r in pair]
    assert len(asyncio.run(main())) == 16
    shares = [r.served() - n for r, n in zip(pair, before, strict=True)]
    assert sum(shares) == 16 and min(shares) >= 4, shares


def test_pick_first_sends_every_request_to_one_replica(pair):
    before = [r.served() for r in pair]
    with TargetClient(target_of(pair), load_balancing="pick_first") as client, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: client.generate(PROMPT, max_new_tokens=3), range(16)))
    shares = [r.served() - n for r, n in zip(pair, before, strict=True)]
    assert sorted(shares) == [0, 16]


def test_cli_takes_an_address_list_and_the_policy(pair, capsys):
    """`specwire generate --address ipv4:A,B --load-balancing pick_first`: every call on A, the first
    address (with the default round_robin, each fresh channel would start at a random replica)."""
    before = [r.served() for r in pair]
    for _ in range(8):
        argv = ["generate", "hello", "--address", target_of(pair), "--load-balancing", "pick_first"]
        assert cli_main([*argv, "--no-chat", "--set", "max_new_tokens=2"]) == 0
    capsys.readouterr()
    assert [r.served() - n for r, n in zip(pair, before, strict=True)] == [8, 0]


def test_a_killed_replica_fails_only_its_requests_in_flight_and_its_share_moves(pair):
    a, b = pair
    outcomes: list[BaseException | None] = []
    lock = threading.Lock()
    # retries=3 changes nothing here: it resends load refusals only, never a call that may have run.
    with TargetClient(target_of(pair), retries=3) as client:

        def slow():  # holds its slot on the replica for DRAFT_DELAY_S, waiting on its draft
            try:
                client.generate(PROMPT, max_new_tokens=3, proposer="draft_model", num_assistant_tokens=2)
                outcome = None
            except SpecwireRpcError as exc:
                outcome = exc
            with lock:
                outcomes.append(outcome)

        threads = [threading.Thread(target=slow) for _ in range(8)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + DRAFT_DELAY_S
        running = [0, 0]
        while time.monotonic() < deadline and sum(running) < 8:
            running = [int(r.scrape(METRIC_REQUESTS_RUNNING)) for r in pair]
            time.sleep(0.05)
        assert sum(running) == 8 and min(running) >= 1, running  # all in flight, on both replicas
        served_by_b = b.served()
        a.process.send_signal(signal.SIGKILL)
        a.process.wait(10)
        for thread in threads:
            thread.join(60)

        failed = [o for o in outcomes if o is not None]
        # Exactly the requests in flight on the killed replica fail, with UNAVAILABLE; B's finish.
        assert len(failed) == running[0], (running, failed)
        assert all(exc.code() == grpc.StatusCode.UNAVAILABLE for exc in failed), failed
        # From now on every request goes to B, and none fails.
        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(lambda _: client.generate(PROMPT, max_new_tokens=3), range(32)))
        assert len(outputs) == 32
    assert b.served() - served_by_b == running[1] + 32


def test_a_drained_replica_fails_no_request(tiny_model_dir, draft):
    """SIGTERM (a rolling update, a scale-down): the replica finishes its calls and refuses new ones
    unread (GOAWAY), so the client's calls move to the other replica and none fails."""
    with two_targets(tiny_model_dir, draft) as (a, b), TargetClient(target_of((a, b))) as client:
        errors: list[SpecwireRpcError] = []
        served = itertools.count()
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                try:
                    client.generate(PROMPT, max_new_tokens=3)
                    next(served)
                except SpecwireRpcError as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=loop) for _ in range(8)]
        for thread in threads:
            thread.start()
        before = [r.served() for r in (a, b)]
        deadline = time.monotonic() + 30
        while min(r.served() - n for r, n in zip((a, b), before, strict=True)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)  # until both replicas carry the load
        served_by_b = b.served()
        assert served_by_b - before[1] >= 4
        b.process.send_signal(signal.SIGTERM)
        assert b.process.wait(30) == 0  # drained: its calls finished, then it exited
        on_a = a.served()
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(60)
        assert errors == []
        assert a.served() > on_a + 8  # the load went on, on A
        # Every call answered: A's share, and B's (at least what it had when told to drain).
        assert next(served) >= a.served() - before[0] + served_by_b - before[1]
