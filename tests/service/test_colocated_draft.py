"""A co-located draft (`target-service --draft-model`): the target drafts with a draft model in its own
process, no draft service. Greedy outputs equal plain greedy token for token (through both schedulers),
seeded sampling equals the same draft behind the draft service, the `speculation` stats are filled,
a cancelled or timed-out request releases its drafter, and a bad `--draft-model` (unloadable, another
vocabulary, together with `--draft-address`) is refused at start with the reason."""

from __future__ import annotations

import threading
import time
import types
from contextlib import ExitStack

import pytest
import torch

from specwire.client import TargetClient
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.__main__ import main as target_main
from specwire.target_service.drafting import DraftPolicy, check_draft_model
from specwire.target_service.scheduler.options import SchedulerOptions
from tests.servers import threaded_server
from tests.service.releases import (
    LONG,
    PROMPT,
    Faults,
    Target,
    assert_released,
    cancel_after_two_deltas,
    concurrently,
    warmed_baseline,
)
from tests.tiny_models import build_tokenizer

BATCH = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6],
    [20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21],
    [40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41],
]
DRAFT = dict(proposer="draft_model", num_assistant_tokens=3, assistant_confidence_threshold=0.0)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def targets(loaded, tiny_draft):
    """`targets(scheduler)`: a target with the co-located draft (built once per module and scheduler)."""
    built: dict[str, Target] = {}
    with ExitStack() as stack:

        def get(scheduler: str) -> Target:
            if scheduler not in built:
                policy = DraftPolicy(draft_model=tiny_draft)
                # Slots of 64 positions in "lane": longer requests run in the sequential lane.
                options = SchedulerOptions(lean_forward=False, slot_tokens=64 if scheduler == "lane" else None)
                server = stack.enter_context(
                    threaded_server(
                        lambda: build_target_server(
                            loaded,
                            drafting=policy,
                            scheduler="sequential" if scheduler == "sequential" else "batched",
                            scheduler_options=options,
                        )
                    )
                )
                built[scheduler] = Target(server, Faults(loaded.model, delay_s=0.0), scheduler, policy)
            return built[scheduler]

        yield get


SCHEDULERS = ["batched", "sequential", "lane"]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("draft_length", [1, 4])
def test_greedy_equals_plain_greedy(targets, scheduler, draft_length):
    target = targets(scheduler)
    new_tokens = 70 if scheduler == "lane" else 24  # past a lane slot: the request runs in the lane
    with TargetClient(target.address) as client:
        plain = client.generate(BATCH, max_new_tokens=new_tokens, proposer="none")
        spec = client.generate(
            BATCH,
            max_new_tokens=new_tokens,
            proposer="draft_model",
            num_assistant_tokens=draft_length,
            assistant_confidence_threshold=0.0,
        )
    assert torch.equal(spec.sequences, plain.sequences)
    s = spec.speculation
    assert s.proposer == "draft_model" and s.fallback_reason == ""
    assert s.rounds > 0 and s.drafted_tokens > 0 and s.accepted_tokens <= s.drafted_tokens
    assert sum(s.accepted_by_position) == s.accepted_tokens
    assert s.draft_seconds > 0 and s.verify_seconds > 0
    assert target.policy.open_streams == 0


def test_seeded_sampling_equals_the_same_draft_behind_the_draft_service(targets, loaded, tiny_draft):
    """The co-located drafter is the draft service's drafter: same seed, same tokens (both lossless)."""
    kwargs = dict(max_new_tokens=20, do_sample=True, seed=7, top_k=20, num_return_sequences=2, **DRAFT)
    with TargetClient(targets("batched").address) as client:
        colocated = client.generate(BATCH[:1], **kwargs)
        again = client.generate(BATCH[:1], **kwargs)
    with ExitStack() as stack:
        drafts = stack.enter_context(threaded_server(lambda: build_draft_server(tiny_draft)))
        policy = DraftPolicy(drafts.address, round_timeout_s=30.0)
        stack.callback(policy.close)
        remote = stack.enter_context(threaded_server(lambda: build_target_server(loaded, drafting=policy)))
        with TargetClient(remote.address) as client:
            served = client.generate(BATCH[:1], **kwargs)
    assert torch.equal(colocated.sequences, again.sequences)
    assert torch.equal(colocated.sequences, served.sequences)
    assert colocated.speculation.rounds == served.speculation.rounds
    assert colocated.speculation.accepted_tokens == served.speculation.accepted_tokens


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_cancelled_and_late_requests_release_the_drafter(targets, scheduler):
    target = targets(scheduler)
    target.faults.delay_s = 0.01  # still running when the client cancels or the deadline passes
    try:
        baseline = warmed_baseline(target, DRAFT)
        concurrently(lambda: cancel_after_two_deltas(target.address, DRAFT), 3)
        assert_released(baseline, target)

        def late():
            with TargetClient(target.address) as client:
                with pytest.raises(Exception, match="DEADLINE_EXCEEDED|deadline"):
                    client.generate(PROMPT, timeout=0.3, **LONG, **DRAFT)

        concurrently(late, 2)
        assert_released(baseline, target)
    finally:
        target.faults.delay_s = 0.0


@pytest.mark.parametrize(
    "scheduler, thread",
    [("batched", "specwire-scheduler"), ("lane", "specwire-scheduler"), ("sequential", "specwire-model")],
)
def test_drafts_run_where_the_targets_forwards_run(targets, scheduler, thread):
    """Draft forwards run on the thread of the target's forwards, with the process's torch threads: the batched
    scheduler's (batched and lane requests alike) or the model thread (sequential); never on the event loop,
    nor on a request's own thread, which runs torch single-threaded (there the draft ran ~1.3x slower)."""
    target = targets(scheduler)
    names: list[str] = []
    # Every draft forward embeds its tokens first: the model's own and the lean one (`runtime.lean_draft`).
    embed = target.policy.draft_model.model.get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda *_: names.append(threading.current_thread().name))
    try:
        with TargetClient(target.address) as client:
            client.generate(BATCH[:1], max_new_tokens=70 if scheduler == "lane" else 8, **DRAFT)
    finally:
        hook.remove()
    assert names and all(n.startswith(thread) for n in names), set(names)


def test_another_vocabulary_is_refused(loaded, tiny_draft):
    check_draft_model(loaded, tiny_draft)  # the same tokenizer: accepted
    other = types.SimpleNamespace(tokenizer=build_tokenizer(vocab_size=300), model_id="other-draft")
    with pytest.raises(ValueError, match="another vocabulary"):
        check_draft_model(loaded, other)


def test_the_controller_counts_who_shares_the_draft(tiny_draft):
    """A co-located draft shares the target's device with every request (`load`); a remote draft service's model
    thread only with the requests drafting with it (`draft_load`), so only a remote controller reads that."""
    remote = DraftPolicy("127.0.0.1:1").controller("draft_model", (), lambda: 7, draft_load=lambda: 3)
    assert remote is not None and not remote.shares_device and remote.draft_load is not None
    assert remote._sharers() == 4
    colocated = DraftPolicy(draft_model=tiny_draft).controller("draft_model", (), lambda: 7, draft_load=lambda: 3)
    assert colocated is not None and colocated.shares_device and colocated.draft_load is None
    assert colocated._sharers() == 8
    lookup = DraftPolicy().controller("prompt_lookup", (), lambda: 7, draft_load=lambda: 3)
    assert lookup is not None and lookup._sharers() == 1


def test_start_up_refuses_a_bad_draft_model_with_the_reason(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        target_main(["--model", str(tiny_model_dir), "--port", "0", "--draft-model", str(tmp_path / "missing")])
    assert "--draft-model" in str(info.value) and "missing" in str(info.value)
    with pytest.raises(SystemExit) as info:
        target_main(["--draft-model", "default-int8", "--draft-address", "127.0.0.1:1"])
    assert "--draft-address" in str(info.value) and "give one" in str(info.value)
    with pytest.raises(ValueError, match="give one"):
        DraftPolicy("127.0.0.1:1", draft_model=object())


def test_without_a_draft_model_the_request_falls_back_and_says_so(loaded):
    with threaded_server(lambda: build_target_server(loaded, drafting=DraftPolicy())) as server:
        with TargetClient(server.address) as client:
            started = time.monotonic()
            output = client.generate(BATCH[:1], max_new_tokens=6, **DRAFT)
    assert "--draft-model" in output.speculation.fallback_reason
    assert time.monotonic() - started < 30
