"""The adaptive speculation controller through the real services (`specwire.generation.speculation.controller`).

A request that names no draft length gets the controller: greedy output equals plain greedy token for
token (co-located draft model, a draft model behind a real draft service, prompt lookup; batch of
three; batched and sequential schedulers), and the response says what it chose. A draft that cannot
pay (slow, and mostly rejected) makes it decode without drafting (time off; no probe that the rest of the
request cannot repay) with the same output. A request naming a schedule keeps transformers' schedule, and
so does every request with `--no-adaptive-speculation`. A cancelled stream leaves no thread, drafter or KV slot behind.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from specwire.client import TargetClient
from specwire.client.cli.generate import draft_lengths_line
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.generation.config import GenerationConfig
from specwire.generation.speculation.controller import ControllerOptions
from specwire.generation.speculation.costs import SharedCosts
from specwire.models import load_model
from specwire.target.v1 import target_service_pb2 as pb
from specwire.target_service.__main__ import build_parser
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.config_resolver import ResolvedConfig
from specwire.target_service.drafting import DraftPolicy
from specwire.target_service.requests import named_draft_fields
from specwire.target_service.scheduler.options import SchedulerOptions
from specwire.wire.generation_config import config_to_proto
from tests.servers import threaded_server, wait_for
from tests.service.releases import (
    PROMPT,
    Faults,
    Target,
    assert_released,
    cancel_after_two_deltas,
    concurrently,
    warmed_baseline,
)

BATCH = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6],
    [20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21],
    [40, 41, 42, 40, 41, 42, 40, 41, 42, 40, 41],
]
# No draft length named: the controller decides. (A threshold of 0 keeps the draft from stopping early.)
DRAFT_MODEL = dict(proposer="draft_model", assistant_confidence_threshold=0.0)
PROMPT_LOOKUP = dict(proposer="prompt_lookup")
SCHEDULERS = ["batched", "sequential"]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def same_draft(tiny_model_dir):
    """The target's own weights as the draft: every greedy draft is accepted, so drafting pays."""
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def targets(loaded, same_draft):
    """`targets(scheduler, adaptive=True)`: a target with a co-located draft (built once per module)."""
    built: dict[tuple[str, bool], Target] = {}
    with ExitStack() as stack:

        def get(scheduler: str, adaptive: bool = True) -> Target:
            if (scheduler, adaptive) not in built:
                policy = DraftPolicy(draft_model=same_draft, adaptive=adaptive)
                stack.callback(policy.close)
                server = stack.enter_context(
                    threaded_server(
                        lambda: build_target_server(
                            loaded,
                            drafting=policy,
                            scheduler=scheduler,
                            scheduler_options=SchedulerOptions(lean_forward=False),
                        )
                    )
                )
                built[scheduler, adaptive] = Target(server, Faults(loaded.model, delay_s=0.0), scheduler, policy)
            return built[scheduler, adaptive]

        yield get


def _controlled(output, rounds_at_least: int = 1):
    s = output.speculation
    assert s.fallback_reason == ""
    assert s.draft_length_source == "controller"
    assert sum(rounds for _, rounds in s.draft_lengths) >= rounds_at_least
    return s


def _cheap_drafts() -> SharedCosts:
    """Fresh costs in which the draft and its catch-up cost next to nothing (as a draft on its own GPU would)."""
    costs = SharedCosts()
    for k in range(1, 21):
        for _ in range(5):
            costs.observe_draft("draft_model", k, 1e-6 * k)
            costs.observe_catch_up("draft_model", k, 1e-6 * k)
    return costs


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("kwargs", [DRAFT_MODEL, PROMPT_LOOKUP], ids=["draft_model", "prompt_lookup"])
def test_controller_greedy_equals_plain_greedy(targets, scheduler, kwargs):
    target = targets(scheduler)
    # The tiny draft costs what the target does per token, so on this CPU it never pays and the controller
    # would rightly not draft: the target starts from fresh costs (the other tests measured them) and is told
    # the draft and its catch-up cost next to nothing (as a draft on its own GPU would), so that always-accepted
    # drafts pay and the output is checked over blocks of the controller's lengths.
    target.policy.costs = _cheap_drafts()
    with TargetClient(target.address) as client:
        plain = client.generate(BATCH, max_new_tokens=40, proposer="none")
        for i in range(2):  # the second request starts from the costs the first one measured
            spec = client.generate(BATCH, max_new_tokens=40, **kwargs)
            assert torch.equal(spec.sequences, plain.sequences)
            s = _controlled(spec)
            # Never longer than the controller's bound; the first request asked for drafts (cheap, always-accepted
            # drafts pay), and a draft model drafts when asked. The second one may not ask: by then the draft's real
            # cost was measured. A lookup drafts only where the text repeats, which this tiny model's output first
            # does at its 8th token: a loaded machine's verify prices can give the controller time off by then.
            assert max(length for length, _ in s.draft_lengths) <= ControllerOptions().max_length
            assert any(length > 0 for length, _ in s.draft_lengths) or i == 1
            assert s.drafted_tokens > 0 or i == 1 or kwargs is PROMPT_LOOKUP
    assert s.proposer == kwargs["proposer"]


def test_controller_with_a_remote_draft_equals_plain_greedy(loaded, tiny_model_dir):
    draft = load_model(str(tiny_model_dir), progress=False)
    with ExitStack() as stack:
        drafts = stack.enter_context(threaded_server(lambda: build_draft_server(draft)))
        policy = DraftPolicy(drafts.address, round_timeout_s=30.0)
        # The tiny draft costs what the target does per token, plus a round trip: measured on a loaded CI machine
        # (the other worker's tests), that could rightly keep the controller from drafting at all (it did once).
        # Priced next to nothing, as in `test_controller_greedy_equals_plain_greedy`, the always-accepted drafts pay.
        policy.costs = _cheap_drafts()
        stack.callback(policy.close)
        server = stack.enter_context(threaded_server(lambda: build_target_server(loaded, drafting=policy)))
        with TargetClient(server.address) as client:
            plain = client.generate(BATCH, max_new_tokens=30, proposer="none")
            for kwargs in (DRAFT_MODEL, PROMPT_LOOKUP):  # the draft model remote, prompt lookup in the target
                spec = client.generate(BATCH, max_new_tokens=30, **kwargs)
                assert torch.equal(spec.sequences, plain.sequences)
                s = _controlled(spec)
                # The draft model's drafts are all accepted and pay. Prompt lookup finds little in the tiny
                # model's text: the controller may stop asking (and not probe again in 30 tokens).
                assert s.drafted_tokens > 0 if kwargs is DRAFT_MODEL else s.drafted_tokens or s.tokens_without_draft, s
            wait_for(lambda: policy.open_streams == 0, timeout=10)  # streams end asynchronously


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_draft_that_cannot_pay_is_switched_off(loaded, tiny_draft_dir, scheduler):
    """A slow draft (100 ms a forward) of other weights (most drafts rejected): plain decoding wins, and once the
    first look-back (where a first block used to be) measured the draft, a probe of it costs more than 5% of the
    rest of the request: none is made (the unit tests probe).

    100 ms, not 20: one catch-up over the prompt's ~16 tokens prices the draft at 1/16 of its forward a token
    (`SharedCosts.catch_up_line`, through the origin), and under a loaded CI run (5 ms plain rounds) a 20 ms draft
    looked cheap enough to draft a block after the look-back and to look back again 5 rounds later."""
    slow = load_model(str(tiny_draft_dir), progress=False)
    Faults(slow.model, delay_s=0.1)
    with ExitStack() as stack:
        policy = DraftPolicy(draft_model=slow)
        server = stack.enter_context(
            threaded_server(lambda: build_target_server(loaded, drafting=policy, scheduler=scheduler))
        )
        with TargetClient(server.address) as client:
            plain = client.generate(PROMPT, max_new_tokens=80, proposer="none")
            spec = client.generate(PROMPT, max_new_tokens=80, **DRAFT_MODEL)
    assert torch.equal(spec.sequences, plain.sequences)
    s = _controlled(spec)
    assert s.tokens_without_draft > 60, s  # most of the request decoded without drafting
    assert s.probes <= 1, s  # the first look-back; 80 tokens of a few-ms target never repay another
    assert max(rounds for length, rounds in s.draft_lengths if length == 0) >= 60
    assert "without drafting" in draft_lengths_line(s)


def test_a_named_schedule_decides(targets):
    with TargetClient(targets("batched").address) as client:
        named = client.generate(BATCH, max_new_tokens=30, num_assistant_tokens=5, **DRAFT_MODEL)
        lookup = client.generate(BATCH, max_new_tokens=30, prompt_lookup_num_tokens=4)
        heuristic = client.generate(BATCH, max_new_tokens=60, num_assistant_tokens_schedule="heuristic", **DRAFT_MODEL)
    for output in (named, lookup, heuristic):
        assert output.speculation.draft_length_source == "schedule"
        assert output.speculation.tokens_without_draft == 0 and output.speculation.probes == 0
    assert named.speculation.draft_lengths[0][0] == 5
    assert lookup.speculation.draft_lengths[0][0] == 4
    # transformers' heuristic: 20, then +2 while every draft is accepted (the draft is the target).
    assert heuristic.speculation.round_lengths()[:2] == [20, 22]


def test_without_the_controller_requests_draft_transformers_constant_length(targets):
    with TargetClient(targets("batched", adaptive=False).address) as client:
        plain = client.generate(BATCH, max_new_tokens=50, proposer="none")
        draft = client.generate(BATCH, max_new_tokens=50, **DRAFT_MODEL)
        lookup = client.generate(BATCH, max_new_tokens=50, **PROMPT_LOOKUP)
    assert torch.equal(draft.sequences, plain.sequences) and torch.equal(lookup.sequences, plain.sequences)
    assert draft.speculation.draft_length_source == "schedule"
    assert draft.speculation.round_lengths()[0] == 20  # transformers' num_assistant_tokens
    assert lookup.speculation.round_lengths()[0] == 10  # the target's prompt-lookup length
    assert build_parser().parse_args(["--no-adaptive-speculation"]).adaptive_speculation is False
    assert build_parser().parse_args([]).adaptive_speculation is True


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("kwargs", [DRAFT_MODEL, PROMPT_LOOKUP], ids=["draft_model", "prompt_lookup"])
def test_cancelled_streams_with_the_controller_release_everything(targets, scheduler, kwargs):
    target = targets(scheduler)
    target.faults.delay_s = 0.01  # still running when the client cancels
    try:
        baseline = warmed_baseline(target, kwargs)
        cancel_after_two_deltas(target.address, kwargs)
        concurrently(lambda: cancel_after_two_deltas(target.address, kwargs), 3)
        assert_released(baseline, target)
    finally:
        target.faults.delay_s = 0.0


def test_which_layers_name_a_draft_length(loaded):
    """The request's overrides, its inline config and its registry config name one; the model's
    generation_config.json does not (it would turn the controller off for every request unseen)."""
    assert named_draft_fields(pb.GenerateRequest(), None) == ()
    overrides = pb.GenerateRequest(overrides=config_to_proto(GenerationConfig(num_assistant_tokens=4)))
    assert named_draft_fields(overrides, None) == ("num_assistant_tokens",)
    inline = pb.GenerateRequest(config=config_to_proto(GenerationConfig(num_assistant_tokens_schedule="heuristic")))
    assert named_draft_fields(inline, None) == ("num_assistant_tokens_schedule",)
    registry = ResolvedConfig("fast", 1, GenerationConfig(prompt_lookup_num_tokens=3))
    assert named_draft_fields(pb.GenerateRequest(config_ref="fast"), registry) == ("prompt_lookup_num_tokens",)
    # Only set fields count: an inline config without them leaves the choice to the controller.
    assert named_draft_fields(pb.GenerateRequest(config=config_to_proto(GenerationConfig(top_k=5))), None) == ()
