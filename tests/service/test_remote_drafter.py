"""The target's remote drafter (`RemoteDrafter`) against a real draft service: its proposals are the ones the
same draft model makes in-process (`ModelDrafter`) after the same rounds, rounds without a proposal included
(the controller's time off, before the first block and between blocks), serial and drafted ahead."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from specwire.draft_service.__main__ import build_server
from specwire.generation.config import GenerationConfig
from specwire.generation.speculation.drafters import open_model_drafter
from specwire.target_service.remote_drafter import DraftChannel, RemoteDrafter
from tests.servers import threaded_server, wait_for

ROWS = [[5, 6, 7, 8, 9, 10, 5, 6], [20, 21, 22, 23, 20]]
# The draft length asked each round; 0: a round of time off (no proposal, the target decodes plainly); LOOK: a
# look-back (a proposal of 0: the draft catches up and reports its hindsight), before the first block too.
LOOK = -1
LENGTHS = [0, 0, 3, 4, 0, 0, 0, 2, 5, 0, 3]
WITH_LOOK_BACKS = [0, 0, LOOK, 0, 3, 0, 0, 0, LOOK, 2, 0, 0, LOOK, LOOK, 4]


@pytest.fixture(scope="module")
def channel(tiny_draft):
    with threaded_server(lambda: build_server(tiny_draft)) as running:
        opened = DraftChannel(running.address)
        yield opened
        opened.close()


@pytest.mark.parametrize("overlap, lengths", [(False, LENGTHS), (True, LENGTHS), (False, WITH_LOOK_BACKS)])
def test_rounds_without_a_proposal_reach_the_draft_service(tiny_draft, channel, overlap, lengths):
    config = GenerationConfig(eos_token_id=2, assistant_confidence_threshold=0.0)
    local = open_model_drafter(tiny_draft.model, [list(r) for r in ROWS], config, 378, return_probs=False)
    remote = RemoteDrafter(channel, [list(r) for r in ROWS], config, 378, False, 30.0, overlap=overlap)
    if LOOK in lengths and lengths.index(LOOK) < next(i for i, n in enumerate(lengths) if n > 0):
        # A look-back before the first block opens the remote session on the prompt alone, which the draft service
        # prefills whole before it hears the tokens since: the local drafter does the same.
        local.propose(0)
    try:
        drafted = checked = 0
        for round_, length in enumerate(lengths):
            accepted = [0, 0]
            if length == LOOK:
                want, got = local.propose(0), remote.propose(0)
                assert got.tokens == [[], []] and got.hindsight == want.hindsight, f"round {round_}"
                checked += sum(h.checked for h in got.hindsight)
            elif length:
                want, got = local.propose(length), remote.propose(length)
                assert got.tokens == want.tokens, f"round {round_}"
                drafted += sum(map(len, got.tokens))
                # Row 0 keeps its whole block, row 1 half of it.
                accepted = [len(want.tokens[0]), len(want.tokens[1]) // 2]
            # The target's token after the kept drafts: another one than the draft's, so a draft service that
            # missed it would draft from another context.
            appended = [[(31 * round_ + 7 * r) % 300 + 3] for r in range(len(ROWS))]
            local.feedback(accepted, appended, [False, False])
            remote.feedback(accepted, appended, [False, False])
        assert drafted > 0
        # Every token of the time off before a look-back is checked but the one a block's answer left behind.
        assert checked == 0 if LOOK not in lengths else checked > 0
    finally:
        remote.close()
        local.close()


def test_a_proposal_drafted_ahead_says_so(tiny_draft, channel):
    """With overlap, a proposal whose block the draft service drafted ahead (the target kept the whole block and its
    token was the draft's guess) says so (`Proposal.ahead_hit`, which the speculation controller prices apart); the
    first proposal and one after a rejection do not."""
    config = GenerationConfig(eos_token_id=2, assistant_confidence_threshold=0.0)
    local = open_model_drafter(tiny_draft.model, [list(ROWS[0])], config, 378, return_probs=False)
    remote = RemoteDrafter(channel, [list(ROWS[0])], config, 378, False, 30.0, overlap=True)
    try:
        hits = []
        for kept in (3, 3, 3, 1, 3):
            want = local.propose(4)  # the block of 3, and the draft's guess of the target's token after it
            got = remote.propose(3)
            assert got.tokens == [want.tokens[0][:3]]
            hits.append(got.ahead_hit)
            guess = want.tokens[0][3]
            appended = [[guess] if kept == 3 else [(guess + 1) % 300 + 3]]
            local.feedback([kept], appended, [False])
            remote.feedback([kept], appended, [False])
            time.sleep(0.3)  # the target verifying: the draft service drafts the next block ahead meanwhile
        assert hits == [False, True, True, True, False]
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_session_prefilled_apart_drafts_what_one_started_later_does(tiny_draft, channel, overlap):
    """`prefill()` sends the DraftStart before the target's first token: the draft service catches up on the prompt
    meanwhile, hears the time off as feedback, and then checks and drafts as a session started on the same tokens."""
    config = GenerationConfig(eos_token_id=2, assistant_confidence_threshold=0.0)
    local = open_model_drafter(tiny_draft.model, [list(r) for r in ROWS], config, 378, return_probs=False)
    remote = RemoteDrafter(channel, [list(r) for r in ROWS], config, 378, False, 30.0, overlap=overlap)
    local.propose(0)  # the prompt's prefill, as the draft service makes it for `prefill()`
    try:
        remote.prefill()
        assert remote.early is not None and remote.start is None  # sent, not waited for
        remote.early.result(30)
        assert remote.prefilled
        checked = 0
        for round_, length in enumerate([0, 0, 0, LOOK, 3, 0, 2]):
            accepted = [0, 0]
            if length == LOOK:
                want, got = local.propose(0), remote.propose(0)
                assert got.tokens == [[], []] and got.hindsight == want.hindsight, f"round {round_}"
                checked += sum(h.checked for h in got.hindsight)
            elif length:
                want, got = local.propose(length), remote.propose(length)
                assert got.tokens == want.tokens, f"round {round_}"
                accepted = [len(want.tokens[0]), 0]
            appended = [[(31 * round_ + 7 * r) % 300 + 3] for r in range(len(ROWS))]
            local.feedback(accepted, appended, [False, False])
            remote.feedback(accepted, appended, [False, False])
        # The time off's tokens (three rounds) are checked but the first, whose guess came with the prompt's prefill
        # before it was known; the prompt's are not: a draft service that took the feedback for prompt would report
        # no checks.
        assert checked == 2 * len(ROWS)
    finally:
        remote.close()
        local.close()


def test_a_session_closed_before_its_prefill_is_answered_ends_its_stream(channel):
    config = GenerationConfig(eos_token_id=2)
    remote = RemoteDrafter(channel, [list(r) for r in ROWS], config, 378, False, 30.0)
    remote.prefill()
    remote.close()  # at once: the stream waits for the prefill's answer, then ends politely
    wait_for(lambda: channel.open_streams == 0)


@pytest.mark.parametrize("ended", [False, True])
def test_a_channel_closed_with_streams_open_leaves_nothing_pending(tiny_draft, caplog, ended):
    """Closing the channel (the target's shutdown) with a draft stream still open, or still saying goodbye, ends
    every task on its loop first: nothing is destroyed pending later, and no completion reaches a closed loop."""
    config = GenerationConfig(eos_token_id=2, assistant_confidence_threshold=0.0)
    gc.collect()  # earlier tests' garbage is collected before, not blamed on this channel
    with threaded_server(lambda: build_server(tiny_draft)) as running:
        for _ in range(3):
            channel = DraftChannel(running.address)
            remote = RemoteDrafter(channel, [list(ROWS[0])], config, 378, False, 30.0, overlap=True)
            remote.propose(3)
            if ended:
                remote.close()  # its goodbye is still on the loop when the channel closes
            channel.close()
            del remote, channel
            gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


@pytest.mark.parametrize("controlled", [True, False])
def test_a_remote_draft_prefills_the_prompt_while_the_target_does(tiny_model_dir, channel, controlled):
    """With `prefill_apart` the decoding loop opens the session on the prompt before the target's prefill and tells it
    the first token as feedback; the controller then prices its first look-back by the tokens after the prompt. The
    output is plain greedy's, with the controller and with transformers' schedule named."""
    from specwire.generation.config import merge
    from specwire.generation.loops.generate import drain, generate
    from specwire.generation.loops.speculative import iter_speculative
    from specwire.generation.speculation.controller import SpeculationController
    from specwire.generation.speculation.costs import SharedCosts
    from specwire.generation.speculation.stats import SpeculationStats
    from specwire.models import load_model

    target = load_model(str(tiny_model_dir), progress=False)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9]
    config = merge(GenerationConfig.from_dict({"do_sample": False, "max_new_tokens": 24}), target.generation_config)
    events: list[tuple[str, object]] = []

    class Recorded(RemoteDrafter):
        def prefill(self):
            events.append(("prefill", [list(row.ids) for row in self.start.rows]))
            super().prefill()
            self.early.result(30)  # the draft service's prefill is done before the target's: no race in the test

        def feedback(self, num_accepted, appended, finished):
            events.append(("feedback", appended))
            super().feedback(num_accepted, appended, finished)

        def propose(self, num_tokens):
            events.append(("propose", num_tokens))
            return super().propose(num_tokens)

    class Controller(SpeculationController):
        def next_length(self, remaining=None, behind=0):
            events.append(("behind", behind))
            return super().next_length(remaining, behind)

    stats = SpeculationStats()
    result = drain(
        iter_speculative(
            target.model,
            torch.tensor([prompt]),
            config=config,
            open_drafter=lambda rows, resolved: Recorded(channel, rows, resolved, target.vocab_size, False, 30.0),
            stats=stats,
            controller=Controller(SharedCosts(), "draft_model", look_back=True) if controlled else None,
            draft_length=None if controlled else 4,
            prefill_apart=True,
        )
    )
    plain = generate(target.model, torch.tensor([prompt]), config=config).sequences
    assert torch.equal(result.sequences, plain)
    first = int(plain[0, len(prompt)])
    assert events[:2] == [("prefill", [prompt]), ("feedback", [[first]])]
    if controlled:
        behind = [value for kind, value in events if kind == "behind"]
        assert behind[0] == 1  # the first token: the prompt was prefilled apart, not `len(prompt) + 1` tokens
        assert stats.probes >= 1  # the time off ended in a look-back, priced by the tokens after the prompt
    else:
        assert events[2] == ("propose", 4) and stats.drafted_tokens > 0  # the schedule drafts from the first round
