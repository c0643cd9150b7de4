"""The target's load gauges (queued and running requests, KV slot use) scraped under a known load.

Two KV slots and six requests that each hold their slot for a while: the draft service answers every
stream two seconds late, and a request waiting on its draft keeps its slot. So two run and four wait,
and a scrape in that window must say so; once they are done, it must say nothing runs.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specwire.client import TargetClient
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.scheduler.options import SchedulerOptions
from specwire.vocabulary import (
    METRIC_KV_SLOT_USAGE,
    METRIC_KV_SLOTS,
    METRIC_KV_SLOTS_USED,
    METRIC_REQUESTS_QUEUED,
    METRIC_REQUESTS_RUNNING,
)
from tests.servers import InjectedFaults, threaded_server
from tests.telemetry.conftest import PROMPT, telemetry_for_module

DRAFT_DELAY_S = 2.0
SLOTS = 2
REQUESTS = 6
SETTLE_S = 5.0  # how long after the last answer the gauges may take to say nothing runs


def load_samples(url: str) -> dict[str, float]:
    """The load gauges of one scrape (one model: one sample each)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    names = {
        METRIC_REQUESTS_QUEUED,
        METRIC_REQUESTS_RUNNING,
        METRIC_KV_SLOTS_USED,
        METRIC_KV_SLOTS,
        METRIC_KV_SLOT_USAGE,
    }
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                assert sample.labels.get("model"), sample  # labelled by model, for per-model rules
                out[sample.name] = sample.value
    return out


@pytest.fixture(scope="module")
def observed(loaded):
    """Peak load seen by scrapes while six slow requests share two slots, and the load after them."""
    with (
        telemetry_for_module("specwire-target", env={"SPECWIRE_PROMETHEUS_PORT": "0"}) as state,
        threaded_server(lambda: InjectedFaults(delay_s=DRAFT_DELAY_S).install(build_draft_server(loaded))) as draft,
    ):
        url = f"http://127.0.0.1:{state.prometheus_port}/metrics"
        policy = DraftPolicy(draft.address, round_timeout_s=30.0)
        options = SchedulerOptions(max_batch_rows=SLOTS)
        with (
            threaded_server(lambda: build_target_server(loaded, drafting=policy, scheduler_options=options)) as target,
            TargetClient(target.address) as client,
        ):
            idle = load_samples(url)
            errors: list[BaseException] = []

            def one():
                try:
                    client.generate(PROMPT, max_new_tokens=4, proposer="draft_model", num_assistant_tokens=2)
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    errors.append(exc)

            threads = [threading.Thread(target=one) for _ in range(REQUESTS)]
            for thread in threads:
                thread.start()
            busy: dict[str, float] = {}
            deadline = time.monotonic() + DRAFT_DELAY_S
            while time.monotonic() < deadline and busy.get(METRIC_REQUESTS_QUEUED) != REQUESTS - SLOTS:
                busy = load_samples(url)
                time.sleep(0.05)
            for thread in threads:
                thread.join(60)
            # A request's thread frees its slot just after handing out the result, which the client may read
            # first: on a busy machine a scrape at once still saw one running. Not for long.
            deadline = time.monotonic() + SETTLE_S
            done = load_samples(url)
            while (done[METRIC_REQUESTS_RUNNING] or done[METRIC_KV_SLOTS_USED]) and time.monotonic() < deadline:
                time.sleep(0.05)
                done = load_samples(url)
        yield idle, busy, done, errors


def test_a_queue_shows_while_every_slot_is_taken(observed):
    _, busy, _, errors = observed
    assert not errors
    assert busy[METRIC_REQUESTS_QUEUED] == REQUESTS - SLOTS
    assert busy[METRIC_REQUESTS_RUNNING] == SLOTS
    assert busy[METRIC_KV_SLOTS_USED] == SLOTS
    assert busy[METRIC_KV_SLOTS] == SLOTS
    assert busy[METRIC_KV_SLOT_USAGE] == 1.0


def test_idle_before_and_after(observed):
    idle, _, done, _ = observed
    for scrape in (idle, done):
        assert scrape[METRIC_REQUESTS_QUEUED] == 0
        assert scrape[METRIC_REQUESTS_RUNNING] == 0
        assert scrape[METRIC_KV_SLOTS_USED] == 0
        assert scrape[METRIC_KV_SLOTS] == SLOTS
        assert scrape[METRIC_KV_SLOT_USAGE] == 0.0
