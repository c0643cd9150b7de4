"""No head-of-line blocking in the batched scheduler: a request waiting on a hung draft service (in the
batched path or in the sequential lane) does not hold up the other requests' forwards.

Functional, not timed: the gather window is made enormous (`gather_fraction`), so a forward that
waited for the drafting request would never come within the other request's deadline, and the draft
timeout is longer than that deadline, so a lane loop blocking the scheduler thread would too.
(Throughput is measured by `python -m bench.head_of_line`.)"""

from __future__ import annotations

import threading

import pytest
import torch

from bench.head_of_line import HungDraftService
from specwire.client import TargetClient
from specwire.models import load_model
from specwire.target_service.__main__ import build_server
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.scheduler.options import SchedulerOptions
from tests.servers import threaded_server, wait_for

PROMPT = [5, 6, 7, 8, 9]
DRAFT_TIMEOUT_S = 120.0  # longer than the deadlines below: only the fix lets those requests finish
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.mark.parametrize("path", ["batched", "lane"])
def test_a_request_waiting_on_a_hung_draft_service_does_not_hold_up_the_others(loaded, path):
    # 2 slots: the lane case's hung request has 3 rows, more than the slots, so it runs in the lane.
    options = SchedulerOptions(max_batch_rows=2, gather_fraction=1e6)
    with (
        HungDraftService() as hung,
        threaded_server(
            lambda: build_server(
                loaded,
                scheduler="batched",
                scheduler_options=options,
                drafting=DraftPolicy(hung.address, round_timeout_s=DRAFT_TIMEOUT_S),
            )
        ) as server,
    ):
        engine = server.server.bindings[0].servicer.engine
        batcher = engine.batcher
        with TargetClient(server.address) as reference:
            want = reference.generate([PROMPT], max_new_tokens=20, min_new_tokens=20).sequences
        hung_prompts = [PROMPT] if path == "batched" else [PROMPT, PROMPT[1:], PROMPT[2:]]
        stuck = TargetClient(server.address, timeout=DEADLINE_S * 3)
        stream = stuck.stream(hung_prompts, max_new_tokens=8, proposer="draft_model")
        try:
            next(stream)  # step 0 is out; the next step waits on the hung draft service
            if path == "batched":
                # The hung service counts the stream when its handler starts, which on a busy machine can come
                # after the other request's 20 forwards.
                wait_for(lambda: batcher.stats().drafting > 0 and hung.streams == 1)
            else:
                wait_for(lambda: engine.lane_active == 1 and hung.streams == 1)
            forwards = batcher.stats().forwards
            outputs, errors = [], []

            def generate():
                try:
                    with TargetClient(server.address, timeout=DEADLINE_S) as client:
                        outputs.append(client.generate([PROMPT], max_new_tokens=20, min_new_tokens=20).sequences)
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            worker = threading.Thread(target=generate)
            worker.start()
            worker.join(DEADLINE_S + 30)
            assert not errors, errors
            assert torch.equal(outputs[0], want)
            assert batcher.stats().forwards - forwards >= 20
            # The hung request is still waiting on its drafter: it was never what the forwards waited for.
            assert hung.streams == 1
            if path == "batched":
                assert batcher.stats().drafting > 0
            else:
                assert engine.lane_active == 1
        finally:
            stream.close()
            stuck.close()
