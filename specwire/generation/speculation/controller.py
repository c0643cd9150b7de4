"""The adaptive speculation controller: each round, the draft length that maximizes expected tokens per second.

A request that names no draft schedule (no `num_assistant_tokens`, no `num_assistant_tokens_schedule`,
no `prompt_lookup_num_tokens`) gets one `SpeculationController`. Before each round it picks `k` in
`0..max_length` maximizing the expected tokens per second of the round. Per row, asked for `k`:

- the drafter proposes: a draft model its first token always, then token after token, going on after each
  with probability `c` (it stops after a token it is unsure of, its confidence threshold, or its EOS);
  prompt lookup all or nothing (`ALL_OR_NOTHING`): a block of `k` with probability `c` (a match), else
  nothing, and a round without a block is a plain round. `c` is an `AcceptanceEstimate` (a Beta posterior
  over the request's own rounds, forgetting old ones);
- drafts `1..j` are all kept with probability `S(j) = h_1 .. h_j`, `h_j` per position from the request's
  own blocks (`RunLengths`), shrunk towards a geometric run. A draft model's positions count drafts
  proposed and kept, shrunk towards `c a + (1 - c) u` for the first and `c a` for each next one: a draft is
  sure (the drafter goes on after it) and kept at `a`, or it is the drafter's last, unsure one, kept at `u`
  (two `AcceptanceEstimate`s: a block's drafts but its last, which it stopped after short of `k`, count
  towards `a`, the last towards `u`; one rate for both, a block's unsure last draft dragged the sure drafts'
  rate down after every block, and a look-back's back up). That fits a draft model. Prompt lookup's count its
  proposed drafts, shrunk towards `a`: a copy from the prompt is either wrong at once or goes on to the end of
  the block;
- so a round emits `E(k) = 1 + f sum_j S(j)` tokens (draft model, at most `1 + N(k)`; prompt lookup:
  `c (1 + sum_j S(j)) + (1 - c)`): the accepted drafts plus the target's recovered or bonus token. `f >= 1`
  is the measured ratio of a draft model's kept drafts to the kept drafts this model predicted for the same
  blocks: a draft model sure of many tokens in a row is mostly right, so its long runs are kept more often than
  the product of per-token rates says. The target's ratio (`SharedCosts.kept_factor`) is the prior of the
  request's own (`_kept_factor`): how much the product undercounts depends on the text;
- it costs `D + V(rows * (1 + N(k))) + L` (draft model; prompt lookup: `D + c * V(rows * (1 + k)) +
  (1 - c) * P(rows) + L`): `D = d0 + d1 * rows * N(k)` is the
  wall time of `drafter.propose(k)` for `N(k)` expected drafts per row, as the target sees it (a
  remote or co-located draft is measured the same way; a `LinearCost` per proposer). An overlapped remote draft
  (`overlapped`: the draft service drafts the next block while the target verifies) has two prices: a round whose
  drafts were drafted ahead (a hit) waits only for what drafting ahead had not finished, `H = h0 + h1 * rows * N(k)`,
  and one whose block was discarded (a miss) for the whole draft, `D`. The next round is a hit when the target keeps
  every draft of this one and its own token is the draft's guess, so a round drafting `k` is priced
  `P(hit) H + (1 - P(hit)) D` in place of `D`, with `P(hit) = W(k) g`, per row: `W(k)`, every proposed draft kept
  (`sum_{j<k} (c a)^(j-1) (1 - c) u + (c a)^(k-1) (c a + (1 - c) u)`), and `g = c a + (1 - c) u` (`_hit_chance`).
  Long blocks are drafted ahead less often than short ones are: a hit needs all of them kept;
  `V(n)` a round with drafts verifying `n` tokens (the verify forward and its bookkeeping: each
  position's processors, the acceptance, the cache crop) and `P(n)` a round without. `V` and `P` are
  `SizedCost`s: each size's measured mean, shrunk
  towards a line through all sizes, because a verify forward's cost is not a line in its tokens: on a
  2-core CPU with SmolLM2-135M (batched scheduler) a plain round takes ~36 ms and rounds verifying 2,
  3, 4 and 11 tokens ~72, 97, 76 and 105 ms (the matrix products change kernels with the row count),
  so 3 drafts cost less than 2. Costs are shared by every request on the target: they are
  properties of the model and the hardware;
- `L = others * v1 * rows * N(k)` is the load term: with other requests in the same forwards (the
  batched scheduler) or in turn on the model thread, a block's extra tokens make each of them wait
  `v1` (the slope of `V`'s line) per token; `others` comes from a callable the target passes in. A draft
  model co-located on the target's device (`shares_device`) takes the device from them as well while it
  drafts: `L` then adds `others * D`. Under load this request's own rounds are the packed forward too, priced as
  rounds alone priced a forward of that many tokens, each other request's one included: `P' = max(P(rows),
  V(rows + others))` a plain round, `max(V(rows * (1 + N(k)) + others), P' + v1 * rows * N(k))` one with drafts.
  Not as loaded rounds measured them: their seconds are mostly the others' (their prefills, a co-located draft's
  forwards) and change from round to round, so they do not price rounds once rounds alone did
  (`SharedCosts.observe_verify`). Loaded prices set against prices learned alone made drafting look cheap, and with
  the loaded plain round alone (a block of 32 drafts amortizing a 290 ms plain round measured while the others
  prefilled), 8 co-located chat clients drafted at 0.67x of plain decoding.

`k = 0` is plain decoding (one target forward per round, no draft). Plain rounds are measured now and
then even where drafting pays (`SharedCosts.plain_due`), so the choice compares against what plain
decoding costs. Drafting starts where it beats plain decoding by `ControllerOptions.margin` and, once started,
goes on while it does not lose to it (`keep_margin`: a hysteresis, so that estimates near the break-even point do
not stop it after every block that kept a little less). When plain decoding wins, the controller stops drafting
for `off_rounds` rounds ("time off"), then drafts a probe block to learn whether the acceptance changed; each
probe after which drafting still does not pay at least doubles the time off (up to `max_off_rounds`), and makes
it long enough that the probe's extra cost stays within `probe_budget` of it; a probe that pays resumes drafting
and resets it.

Drafting judged by its rounds. A draft model's request alone on the target and on its draft (`_by_rounds`), once
drafting, goes on by what its own rounds did instead of by the estimates: it asks for the longest block (the drafter
ends it after a draft it is unsure of) for as long as its drafting rounds, look-backs and probes have cost no more
than `loss_budget` of the request's plain decoding over plain decoding of the tokens they emitted (rounds that gain
refund, up to that much), and takes time off past it (`_length_by_rounds`). The estimates read the past, and an answer
that starts hard for the draft and turns easy (chat) had stopped drafting before the turn. Under load the estimates
decide: a block's price there is also what it costs the others, which a request's own rounds do not show. Loaded or
not, no look-back or probe takes a draft model's request past its loss budget: each one alone is within its own
budget, so a request that had lost the budget drafting would look back, resume at its estimates and lose a block
more, again and again (`observe`).

Look-backs. A greedy draft model's request (`look_back`) ends its time off with a look-back instead: the drafter
only catches up on the target's tokens and reports how many of them it would have drafted itself, and whether it
would have gone on after each (`drafters.Hindsight`: its greedy guesses, checked against tokens the target
emitted anyway). That is evidence on every token of the time off, for the price of the catch-up a probe pays too
and no block to verify. Acceptance changes along an answer (SmolLM2 and its int8 draft agree on ~0.65 of a chat
answer's first 60 tokens and ~0.98 after; on a fifth of the low-acceptance prompt's first 20 and nearly all
after), and a probe every 4, 8, 16.. rounds saw too few tokens to notice: the request's estimates weigh the
look-back's tokens as the most recent evidence, forgetting what came before by `HINDSIGHT_DECAY` per token. A
look-back after which drafting would not pay is followed by the time off after which the next one costs at most
`probe_budget` of it (`_look_back_interval`: a look-back's fixed cost and that time off's tokens, as look-backs
measured them, `SharedCosts.look_back_line`), or after twice the last time off where that is shorter (and at
least a quarter of it): the next one may see a later part of the answer, and an answer's start is where acceptance
changes most. One that would pay resumes drafting. Such a request with a co-located draft drafts from its first
round where the draft's prefill of the prompt costs no more than `probe_budget` of the rest and its rounds judge
its drafting (alone on the target) or drafting pays at its estimates (the target's priors, `_drafts_at_once`): a
verify of a few drafts costs about a plain round (`specwire.runtime.lean_decoder`, small blocks) and a draft unsure
of the answer's first tokens stops after one or two, so a first block costs a draft forward or two where it is
rejected. Otherwise (a remote draft, a long prompt) it starts with time off, and its first look-back checks the
draft on the answer's first tokens; it is skipped, like any look-back, where the rest of the request cannot repay
the draft's prefill of the prompt (a long prompt, a short answer). A look-back that reports nothing (a draft service
without hindsight) turns the request to probes.

The rest of the request. The loop tells the controller how many tokens the request may still generate
and how many tokens the drafter has not seen yet (`behind`: the whole context before its first block,
the tokens of the time off before a probe). Catching up (a draft model's prefill) is a one-off cost,
measured per proposer from the first blocks (`SharedCosts.catch_up`, seconds per token): drafting
starts only when the expected saving over the remaining tokens repays it, and a probe is made only
when its expected extra cost (catch-up, draft, verify over a plain round) is within `probe_budget`
of the plain decoding of the rest (a probe it cannot repay even when it succeeds is not worth it).

Priors. A draft model's request starts from the acceptance and continuation this target measured over the last
~100 row-rounds (blocks and look-backs) of earlier requests with that drafter (`SharedCosts.priors`), weighed
as 4 tokens: how often a draft model agrees with its target is mostly a property of the pair, and a cautious
constant kept a request with a long prompt from ever drafting (the saving it expected did not repay the
draft's prefill) where drafting every round was 1.78x faster. Before any request measured it, and for prompt
lookup always, the constant `PRIORS`: a draft model acceptance 0.7, continuation 0.8; prompt lookup acceptance
0.8 (its copies are kept at 0.8-0.85 per token on the benchmark's prompts, counted as runs), a match half the
time (whether a prompt repeats itself is a property of the prompt); its drafts cost nothing measurable, so it
drafts from the first round. Until a cost has been measured it is taken relative to the plain round's cost
(`v1 = verify_slope_prior * v0`, `d1 = draft_slope_prior * p0`, or a one-token forward of the draft once a
catch-up measured it, if more; `d0 = 0`; a drafting round is first assumed to cost what a plain one does).
Draft times are learned only from rounds whose previous round drafted or looked back (the drafter lacked only that
round's tokens), or, for a co-located draft, measured plain decoding between blocks (`plain_due`: its one token rides
along in the next block's first forward): the first block of a request and a probe after time off include the
catch-up, learned apart. So look-backs and probes never measure the draft's price: where a price from fewer than
`SURE_DRAFT_BLOCKS` blocks is all that keeps drafting out after one, and the draft's forward (its catch-up) says
drafting would pay, the next round drafts a block to measure it again (`_doubted_length`).

Pure Python, thread-safe where shared (`SharedCosts`); no services. Output never depends on it: the
draft length changes how many tokens a round verifies, not which tokens are emitted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import NamedTuple

from specwire.generation.speculation.costs import (
    ALL_OR_NOTHING,
    KEPT_FACTOR_BOUNDS,
    KEPT_PRIOR_DRAFTS,
    Prices,
    SharedCosts,
)
from specwire.generation.speculation.estimates import AcceptanceEstimate, RunLengths
from specwire.vocabulary import DRAFT_LENGTH_CONTROLLER, DRAFT_LENGTH_SCHEDULE

log = logging.getLogger(__name__)

__all__ = [
    "DECIDED_BY_CONTROLLER",
    "DECIDED_BY_SCHEDULE",
    "ControllerOptions",
    "Expected",
    "SpeculationController",
]

# What decided a request's draft lengths (`SpeculationStats.decided_by`).
DECIDED_BY_CONTROLLER = DRAFT_LENGTH_CONTROLLER
DECIDED_BY_SCHEDULE = DRAFT_LENGTH_SCHEDULE
# A draft price measured from fewer blocks than this is measured again by a block where it alone keeps a request
# off drafting (`SpeculationController._doubted_length`).
SURE_DRAFT_BLOCKS = 4
# Evidence a request's estimates keep per token a look-back checked (`SpeculationController.observe`): about the last
# 10 tokens count. Where an answer turns easy for the draft (SmolLM2 and its int8 draft on the chat answer: 0.40 of
# the first 40 tokens sure and right, 0.91 after), with 0.95 (the last ~20) a look-back over 18 easy tokens still read
# ~0.75, the harder ones before them weighing in, and drafting resumed ~40 tokens after the turn.
HINDSIGHT_DECAY = 0.9
# Evidence a request's own kept factor keeps at each row-round with drafts (`SpeculationController._kept_factor`):
# about the last 10 count.
KEPT_DECAY = 0.9


@dataclass(frozen=True)
class ControllerOptions:
    """Bounds of the controller.

    Args:
        max_length (`int`, *optional*, defaults to 32): the longest block. Longer than transformers' default
            `num_assistant_tokens` (20), which its heuristic schedule grows past while blocks are kept whole: on
            the low-acceptance prompt's answer, all kept after its first 20 tokens, blocks up to 32 made the
            co-located draft ~7% faster than blocks up to 20.
        probe_length (`int`, *optional*, defaults to 5): the block drafted after time off (a probe; a greedy
            request with a draft model looks back instead, `look_back`). Not 2: on a CPU a verify forward of
            more tokens can cost less than one of 3 (see `SizedCost`).
        off_rounds (`int`, *optional*, defaults to 4): rounds of plain decoding before the first probe.
        max_off_rounds (`int`, *optional*, defaults to 256): the longest time off, after failed probes.
        margin (`float`, *optional*, defaults to 0.02): how much faster than plain decoding drafting must
            be expected to be to start (drafting on a tie only risks the cost estimates' errors).
        keep_margin (`float`, *optional*, defaults to 0.0): how much faster drafting must be expected to be to go
            on after a block. Below `margin` on purpose (hysteresis): a request whose estimates hover near the
            break-even point stopped after any block that kept a little less, and each stop costs a time off of
            `off_rounds` plain rounds and a look-back where drafting went on paying (co-located chat: blocks of
            32 kept whole, one rejected early, then 4 plain rounds at 0.97 of drafting's expected rate).
        plain_every (`int`, *optional*, defaults to 32): rounds with drafts (on this target) after which a
            round without is measured (`SharedCosts.plain_due`).
        probe_budget (`float`, *optional*, defaults to 0.05): the most a failed probe's extra cost may
            add to the time off before the next one (the time off after it is at least the probe's
            extra seconds / (budget x a plain round)); 0 only doubles. Together, the look-backs and probes since
            drafting last resumed cost at most this much of the plain decoding of the whole request (as long as
            its first decision was told it may run, `_probe_affordable`). A draft model's probe pays its
            catch-up on every token since it last drafted (and the first one the draft's prefill of
            the prompt): on a CPU that is several plain rounds, which probing every few rounds repeats.
            A co-located draft's probe or look-back delays every request waiting for the device, a remote
            one every request drafting with the same draft service: its extra cost counts once per request
            (`shares_device`, `draft_load`).
        loss_budget (`float`, *optional*, defaults to 0.03): what a draft model's request may lose to speculation:
            its drafting rounds, look-backs and probes may cost this much of the plain decoding of the whole request
            more than plain decoding of the tokens they emitted (`excess_s`, gains refunding up to as much). Alone on
            the target (and on its draft) it drafts on within it, whatever the estimates say (`_by_rounds`), and no
            look-back or probe takes it past it (`_probe_affordable`, `probe_budget` 0 included). None: the
            estimates and `probe_budget` alone decide.
    """

    max_length: int = 32
    probe_length: int = 5
    off_rounds: int = 4
    max_off_rounds: int = 256
    margin: float = 0.02
    keep_margin: float = 0.0
    probe_budget: float = 0.05
    plain_every: int = 32
    loss_budget: float | None = 0.03

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.probe_length < 1 or self.off_rounds < 1:
            raise ValueError(
                f"max_length, probe_length and off_rounds must be >= 1, got {self.max_length}, "
                f"{self.probe_length}, {self.off_rounds}."
            )
        if self.loss_budget is not None and self.loss_budget < 0:
            raise ValueError(f"loss_budget must be >= 0 (or None), got {self.loss_budget}.")
        if self.max_off_rounds < self.off_rounds:
            raise ValueError(f"max_off_rounds ({self.max_off_rounds}) must be >= off_rounds ({self.off_rounds}).")


def _within(k: int, remaining: int | None) -> int:
    """A block of `k`, no longer than the rest of the request leaves room for (the target's token fills the last)."""
    return k if remaining is None else max(min(k, remaining - 1), 0)


def _count(requests: Callable[[], float] | None) -> float:
    """How many other requests a callable the target passed in says there are now (0 without one)."""
    return max(float(requests()), 0.0) if requests is not None else 0.0


class _Sums(NamedTuple):
    """Per block length `k` (at `k - 1`): drafts expected kept per row, proposed, and a draft model's chance that the
    next block drafted ahead is used (`SpeculationController._sums`)."""

    kept: list[float]
    proposed: list[float]
    hits: list[float]


class Expected(NamedTuple):
    """A round's expected tokens per row and its seconds: drafting, the verify (or plain) round, and the load term."""

    tokens: float
    draft_s: float
    verify_s: float
    load_s: float

    @property
    def seconds(self) -> float:
        return self.draft_s + self.verify_s + self.load_s


@dataclass
class SpeculationController:
    """One request's draft-length decisions (see the module docstring).

    Call `next_length()` before each round and `observe(...)` after it.

    Args:
        costs (`SharedCosts`): the target's measured costs (shared, updated by this request too).
        proposer (`str`): whose draft cost applies (`prompt_lookup`, `draft_model`).
        rows (`int`): the request's rows (every block verifies one per row).
        load (`Callable[[], float]`, *optional*): how many other requests wait on this one's forwards now.
        shares_device (`bool`, *optional*, defaults to `False`): the drafter computes on the target's device (a
            co-located draft model): its forwards take the device from the other requests too, so the load term
            charges them its draft time as well.
        draft_load (`Callable[[], float]`, *optional*): how many other requests draft with the same remote draft
            service now. It serves them in turn on one model thread, so a look-back or probe makes each of them
            wait for it, as a co-located one makes every request wait for the device (`_sharers`).
        overlapped (`bool`, *optional*, defaults to `False`): the remote draft service drafts each next block ahead
            while the target verifies (`--draft-overlap`): a round's draft is priced by the request's own chance
            of a hit (`_hit_chance`, module docstring).
        options (`ControllerOptions`, *optional*): bounds.
        acceptance (`AcceptanceEstimate`, *optional*): the request's acceptance of proposed tokens (a fresh
            prior by default, `PRIORS`).
        continuation (`AcceptanceEstimate`, *optional*): how often the drafter proposes the next token asked
            of it, or for an all-or-nothing proposer (`ALL_OR_NOTHING`) proposes a block at all (a fresh
            prior by default, `PRIORS`).
        last (`AcceptanceEstimate`, *optional*): a draft model's acceptance of the draft it stopped after on its
            own (a fresh prior by default, `LAST_DRAFT_PRIOR`); `acceptance` is then that of the drafts it went
            on after.
        look_back (`bool`, *optional*, defaults to `False`): the drafter reports hindsight (`Proposal.hindsight`:
            a greedy draft model), so time off ends with a look-back (the drafter catches up and says how many
            of the target's tokens it would have drafted) instead of a probe block. Turned off by a look-back
            that reports nothing.
    """

    costs: SharedCosts
    proposer: str
    rows: int = 1
    load: Callable[[], float] | None = None
    shares_device: bool = False
    draft_load: Callable[[], float] | None = None
    overlapped: bool = False
    options: ControllerOptions = field(default_factory=ControllerOptions)
    acceptance: AcceptanceEstimate | None = None
    continuation: AcceptanceEstimate | None = None
    last: AcceptanceEstimate | None = None
    probes: int = 0
    off_left: int = 0  # rounds of time off still to go
    off_period: int = 0  # the current time off (doubles after each failed probe)
    look_back: bool = False
    probing: bool = False  # the last length handed out was a probe
    looking_back: bool = False  # the last round was a look-back (no drafts, the drafter caught up)
    caught_up: bool = False  # the last round drafted or looked back: the drafter lacks only its tokens
    drafting: bool = False  # drafting goes on (the next block needs only `keep_margin`), no time off since
    recheck: int = 0  # the block that measures a doubtful draft price again (`_doubted_length`), to draft next
    decided: bool = False  # `next_length` was called: the first round is decided
    length: int | None = None  # the tokens per row the request may generate, as its first decision was told
    kept_seen: tuple[float, float] = (0.0, 0.0)  # drafts the model predicted kept and the target kept, recent rounds
    explored_s: float = 0.0  # what look-backs and probes cost over plain rounds since drafting last resumed
    excess_s: float = 0.0  # drafting, look-back and probe rounds' seconds over plain decoding of their tokens

    def __post_init__(self) -> None:
        self.runs = RunLengths(self.options.max_length, chained=self.all_or_nothing)
        self.costs.new_request()
        accept_prior, continue_prior, last_prior = self.costs.priors(self.proposer)
        if self.acceptance is None:
            self.acceptance = AcceptanceEstimate(prior_mean=accept_prior)
        if self.continuation is None:
            self.continuation = AcceptanceEstimate(prior_mean=continue_prior)
        if self.last is None:
            self.last = AcceptanceEstimate(prior_mean=last_prior)
        if self.look_back:
            # Time off first: the first look-back, not a block, tries the draft (module docstring, Look-backs).
            self.off_period = self.options.off_rounds
            self.off_left = self.off_period

    @property
    def all_or_nothing(self) -> bool:
        return self.proposer in ALL_OR_NOTHING

    def _means(self) -> tuple[float, float, float]:
        """`(a, c, u)`: acceptance, continuation, and a draft model's last draft's acceptance."""
        assert self.acceptance is not None and self.continuation is not None and self.last is not None  # __post_init__
        return self.acceptance.mean, self.continuation.mean, self.last.mean

    def rate(self, k: int, prices: Prices, others: float = 0.0, sums: _Sums | None = None) -> float:
        """Expected tokens per second of a round drafting `k` tokens per row (0: plain decoding)."""
        expected = self.expect(k, prices, others, sums)
        return self.rows * expected.tokens / max(expected.seconds, 1e-9)

    def expect(self, k: int, prices: Prices, others: float = 0.0, sums: _Sums | None = None) -> Expected:
        """What a round drafting `k` tokens per row (0: plain decoding) is expected to emit and cost.

        `sums`: `_sums(n)` for some `n >= k`, computed once by a decision that rates every `k` (computed for `k` alone
        without it)."""
        rows = self.rows
        plain_s = prices.plain(rows)
        if others:  # the packed forward, as rounds alone priced it: the others' tokens and this request's
            plain_s = max(plain_s, prices.verify(rows + others))
        if k == 0:
            return Expected(1.0, 0.0, plain_s, 0.0)
        sums = sums if sums is not None else self._sums(k)
        kept = sums.kept[k - 1]
        _, c, _ = self._means()
        if self.all_or_nothing:  # a block of k with probability c, else a plain round
            drafted, block = c * k, float(k)
            tokens = c * (1.0 + kept) + (1.0 - c)
        else:  # the first draft always, then token after token with probability c: always a block
            drafted = block = sums.proposed[k - 1]
            # The drafts kept as the model predicts them (`_sums`), times what the target measured of such predictions
            # (`SharedCosts.kept_factor`), and no more than the drafts proposed.
            tokens = 1.0 + min(prices.kept_factor * kept, drafted)
        d0, d1 = prices.draft
        draft_s = d0 + d1 * rows * drafted
        if self.overlapped and prices.ahead is not None and not self.all_or_nothing:
            h0, h1 = prices.ahead
            hit = sums.hits[k - 1] ** rows  # every row's block drafted ahead, or the round waits for a draft
            draft_s = hit * (h0 + h1 * rows * drafted) + (1.0 - hit) * draft_s
        with_block = 1.0 if not self.all_or_nothing else c
        if others:
            block_s = max(prices.verify(rows * (1.0 + block) + others), plain_s + prices.slope * rows * block)
        else:
            block_s = prices.verify(rows * (1.0 + block))
        verify_s = with_block * block_s + (1.0 - with_block) * plain_s
        load_s = others * (prices.slope * rows * drafted + (draft_s if self.shares_device else 0.0))
        return Expected(tokens, draft_s, verify_s, load_s)

    def _sums(self, longest: int) -> _Sums:
        """For every block length `k` up to `longest`: the drafts expected kept per row (`sum S(j)`, `j <= k`) and,
        for a draft model, proposed (`N(k)`).

        `S(j)` is the chance that drafts `1..j` are all proposed and kept. Prompt lookup's: its copy's drafts kept
        at `a`. A draft model's: each draft is sure (the drafter goes on after it, `c`) and kept at `a`, or the
        last one, kept at `u`, so `S(j) = (c a)^(j-1) (c a + (1 - c) u)` (look-backs measure `c a` as such:
        `Hindsight`), shaped by the request's own runs (`RunLengths`). And the chance of a hit (`_hit_chance`). One
        pass for every `k`: a decision rates them all (`best_length`)."""
        a, c, u = self._means()
        if self.all_or_nothing:
            survival = self.runs.survival(a, longest)
        else:
            survival = self.runs.survival(c * a, longest, first=c * a + (1.0 - c) * u)
        # W(k) g: every draft kept, the block stopping after an unsure one at j < k or reaching k, then the guess.
        sure, unsure = c * a, (1.0 - c) * u
        guess = sure + unsure
        hits, stopped, run = [], 0.0, 1.0  # run: sure^(k-1); stopped: sum_{j<k} sure^(j-1) unsure
        for _ in range(longest):
            hits.append((stopped + run * guess) * guess)
            stopped += run * unsure
            run *= sure
        return _Sums(list(accumulate(survival)), list(accumulate(c**i for i in range(longest))), hits)

    def _hit_chance(self, k: int) -> float:
        """The chance that a row's next block, drafted ahead while this round drafting `k` verifies, is used: the
        target keeps every draft the drafter proposes (it stops after an unsure one, kept at `u`, or after `k`) and
        its own token is the draft's greedy guess (kept as a first draft is, `c a + (1 - c) u`)."""
        return self._sums(k).hits[-1]

    def _prices(self) -> Prices:
        """The target's prices, with this request's kept factor (`_kept_factor`)."""
        prices = self.costs.prices(self.proposer)
        return replace(prices, kept_factor=self._kept_factor(prices.kept_factor))

    def _kept_factor(self, target: float) -> float:
        """Drafts this request's recent blocks kept over those the model predicted (`kept_seen`), from the target's
        factor (`SharedCosts.kept_factor`) weighed as `KEPT_PRIOR_DRAFTS` predicted drafts; within
        `KEPT_FACTOR_BOUNDS`.

        The target's alone is the factor of whatever its requests drafted most: learned on chat answers, whose
        sure runs are long and right, it doubled the kept drafts predicted on the code edit, whose draft keeps
        0.59 of its blocks' drafts (SmolLM2's int8 draft, blocks of 5) where look-backs read its sure guesses right
        at 0.88: an overlapped draft drafted there at a predicted 1.3x of plain decoding and ran at 0.89x of the
        serial draft, which did not draft."""
        predicted, kept = self.kept_seen
        low, high = KEPT_FACTOR_BOUNDS
        return min(max((kept + KEPT_PRIOR_DRAFTS * target) / (predicted + KEPT_PRIOR_DRAFTS), low), high)

    def _kept(self, k: int) -> float:
        """A draft model's expected drafts kept per row when asked for `k`, as the model predicts them (`sum S(j)`)."""
        return self._sums(k).kept[-1]

    def best_length(
        self,
        remaining: int | None = None,
        behind: int = 0,
        prices: Prices | None = None,
        margin: float | None = None,
    ) -> int:
        """The `k` in `0..max_length` with the highest expected rate; 0 unless drafting beats plain by the margin.

        Args:
            remaining (`int`, *optional*): tokens the request may still generate per row.
            behind (`int`, *optional*, defaults to 0): tokens the drafter has not seen yet (its prefill, a
                one-off cost): drafting starts only when the remaining tokens repay it.
            prices (`Prices`, *optional*): the costs to decide by (the target's measured ones by default).
            margin (`float`, *optional*): how much faster than plain decoding drafting must be (`options.margin`
                by default).
        """
        prices = prices if prices is not None else self._prices()
        margin = self.options.margin if margin is None else margin
        others = self._others()
        plain_rate = self.rate(0, prices, others)
        longest = self.options.max_length if remaining is None else min(self.options.max_length, remaining - 1)
        best, best_rate = 0, 0.0
        sums = self._sums(longest)
        for k in range(1, longest + 1):
            rate = self.rate(k, prices, others, sums)
            if rate > best_rate:  # the first of equal rates: the shortest block
                best, best_rate = k, rate
        chosen = best if best_rate > plain_rate * (1.0 + margin) else 0
        if chosen and behind and remaining is not None:
            saved = self.rows * remaining * (1.0 / plain_rate - 1.0 / best_rate)
            if saved <= prices.catch_up * behind:
                chosen = 0
        if log.isEnabledFor(logging.DEBUG):
            self._log_choice(chosen, best, plain_rate, best_rate, others, prices, remaining, behind)
        return chosen

    def _log_choice(
        self,
        k: int,
        best: int,
        plain_rate: float,
        best_rate: float,
        others: float,
        prices: Prices,
        remaining: int | None,
        behind: int,
    ) -> None:
        """What a decision read and chose (DEBUG: `--log-level DEBUG` says why a request drafted or not)."""
        a, c, u = self._means()
        d0, d1 = prices.draft
        plain, block = self.expect(0, prices, others), self.expect(best, prices, others)
        log.debug(
            "%s: k=%d (acceptance %.2f, continuation %.2f, last %.2f, plain %.1f tok/s in %.1f ms, best k=%d %.1f "
            "tok/s: %.2f tokens in %.1f ms draft + %.1f verify + %.1f load, others %.0f, remaining %s, behind %d, "
            "catch-up %.2f ms/token, draft %.2f + %.2f ms/token, kept x%.2f)",
            self.proposer,
            k,
            a,
            c,
            u,
            plain_rate,
            plain.seconds * 1e3,
            best,
            best_rate,
            block.tokens,
            block.draft_s * 1e3,
            block.verify_s * 1e3,
            block.load_s * 1e3,
            others,
            remaining,
            behind,
            prices.catch_up * 1e3,
            d0 * 1e3,
            d1 * 1e3,
            prices.kept_factor,
        )

    def next_length(self, remaining: int | None = None, behind: int = 0) -> int:
        """The draft length of the coming round (0: plain decoding), with the time off and probes.

        Args:
            remaining (`int`, *optional*): tokens the request may still generate per row (a probe the rest
                of the request cannot repay is skipped, and no block is longer than the rest).
            behind (`int`, *optional*, defaults to 0): tokens the drafter has not seen yet.
        """
        self.probing = self.looking_back = False
        if not self.decided:
            self.length = remaining
        if self.look_back and not self.decided and self._drafts_at_once(remaining, behind):
            self.off_period = self.off_left = 0  # no time off first: the first round drafts
            self.drafting = self._by_rounds()  # its rounds judge it from the first block on
        self.decided = True
        if self.off_left > 0:
            self.off_left -= 1
            return 0
        if self.off_period:  # the time off is over: a probe, if the rest of the request can afford it
            if remaining is not None and not self._probe_affordable(remaining, behind):
                self.off_left = self.off_period - 1
                return 0
            if self.look_back:
                self.looking_back = True
                self.probes += 1
                return 0
            self.probing = True
            self.probes += 1
            return _within(min(self.options.probe_length, self.options.max_length), remaining)
        if self.costs.plain_due(self.options.plain_every):
            return 0  # a round to measure plain decoding by, not time off
        if self.recheck:  # drafted whatever the measured price says: it measures that price again
            k, self.recheck = self.recheck, 0
            return _within(k, remaining)
        if self.drafting and self._by_rounds():
            k = self._length_by_rounds(remaining)
        else:
            k = self.best_length(remaining, behind, margin=self.options.keep_margin if self.drafting else None)
        if k == 0:  # this round is the first of the time off
            self.off_period = self.options.off_rounds
            self.off_left = self.off_period - 1
        return k

    def _drafts_at_once(self, remaining: int | None, behind: int) -> bool:
        """Whether a look-back request drafts from its first round instead of starting with time off: its draft is
        co-located (`shares_device`), the draft's prefill of the prompt is within what a first look-back may cost
        (`_probe_affordable`), and its rounds judge its drafting (`_by_rounds`) or drafting pays at the request's
        estimates (the target's priors, `best_length`).

        Time off first cost the low-acceptance prompt's answer its start: 4 plain rounds and a look-back for 5
        tokens, then blocks of one or two drafts, where transformers' constant schedule had drafted those from the
        first round for about a plain round each (SmolLM2 and its int8 draft, co-located on 2 cores: the controller
        0.89x of the schedule over 5 triples; drafting at once, 1.19x of transformers' assisted generation in the
        speculation matrix, against 0.91x). A long prompt (the code edit's) still starts with time off: its prefill
        is what a first block risks. So does a remote draft's request: drafting at once there, the first chat
        requests on a fresh pinned target drafted little (remote overlapped: 16.0 tok/s against 22.2 starting with
        time off). The batched scheduler's start-up now warms small blocks, which removed one cause (a cold first
        verify priced drafting out), but an overlapped target's first chat requests still ran 15.4-21.1 tok/s
        drafting at once."""
        if not self.shares_device or remaining is None or not self._probe_affordable(remaining, behind):
            return False
        # Alone, its rounds judge the drafting from the first block (`_by_rounds`): the priors need not say it pays.
        return self._by_rounds() or self.best_length(remaining, behind) > 0

    def _by_rounds(self) -> bool:
        """Whether this request's drafting goes on by what its own drafting rounds gained or lost
        (`_length_by_rounds`) rather than by the estimates: a draft model's request (prompt lookup's rounds without a
        match are plain ones), with a `loss_budget`, alone on the target and on its draft (with others waiting, a
        block also costs them, which its own rounds do not show), whose drafted token costs less than a plain round
        (a dearer one never pays, and one longest block of it could cost more than the budget)."""
        if not self._rounds_may_judge or self._others() or self._sharers() != 1.0:
            return False
        prices = self.costs.prices(self.proposer)
        return prices.draft[1] * self.rows < prices.plain(self.rows)

    @property
    def _rounds_may_judge(self) -> bool:
        """Whether `_by_rounds` can ever hold for this request (a draft model's, with a `loss_budget`): only then is
        `excess_s` kept."""
        return self.options.loss_budget is not None and not self.all_or_nothing

    def _plain_round(self) -> float:
        """Seconds of a round without drafts for this request's rows, at the target's current prices."""
        return self.costs.prices(self.proposer).plain(self.rows)

    def _length_by_rounds(self, remaining: int | None) -> int:
        """The longest block while the seconds its drafting rounds, look-backs and probes took over plain decoding of
        their tokens (`excess_s`, gains refunding up to the budget) are within `loss_budget` of the whole request's
        plain decoding; 0 past it.

        The longest: the drafter ends a block after a draft it is unsure of, so a long one costs only where the draft
        is sure, and is mostly kept there. The estimates read the past and the answer turns: SmolLM2's int8 draft is
        sure and right of ~0.44 of a chat answer's first 16 tokens and of nearly all after token ~50, and requests
        whose estimates had read the start stopped drafting and missed the easy rest (co-located, 6 alternating
        triples on 2 cores, twice: 0.92x and 1.00x of plain greedy, where drafting on by its rounds ran 1.11x and
        1.29x; the low-acceptance prompt 1.18x and 1.07x against 1.31x and 1.24x). The budget bounds what drafting
        on, and trying again after it, cost where the answer stays hard: a few percent of the request."""
        plain_s = self._plain_round()
        budget = self._loss_budget(plain_s)
        k = _within(self.options.max_length, remaining) if self.excess_s <= budget else 0
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: k=%d by its rounds (%.1f ms over plain decoding's %.1f ms rounds, budget %.1f ms)",
                self.proposer,
                k,
                self.excess_s * 1e3,
                plain_s * 1e3,
                budget * 1e3,
            )
        return k

    def _loss_budget(self, plain_s: float) -> float:
        """`loss_budget` of the plain decoding of the whole request (`length` tokens per row, a round `plain_s`
        seconds), in seconds."""
        return (self.options.loss_budget or 0.0) * plain_s * (self.length or 0)

    def _probe_affordable(self, remaining: int, behind: int) -> bool:
        """Whether a probe's expected extra cost (over a plain round) is within `probe_budget` of the plain
        decoding of the rest of the request (a probe it cannot repay even when it succeeds is not worth it), and,
        with what the look-backs and probes since drafting last resumed cost (`explored_s`), within `probe_budget`
        of the plain decoding of the whole request (`length` tokens).

        The second bound is what a request that never drafts pays for trying: each look-back alone was within the
        budget of the rest, and those at an answer's start come at up to four times the budget of the time off
        before them (`observe`), so a short answer paid the budget several times over. The demo's 54 tokens (a
        remote draft on the target's 2 cores, never drafting) paid ~0.2 s of look-backs in ~2.7 s, 7% against
        plain decoding: the first one caught up on the prompt at about the budget, the second came ~10 tokens
        later. Exploration that resumes drafting is repaid by it, so `explored_s` starts again from there.

        Before both, and with `probe_budget` 0 too: none takes the request past its loss budget (`excess_s`)."""
        prices = self.costs.prices(self.proposer)
        k = self.options.probe_length
        plain_s = prices.plain(self.rows)
        d0, d1 = prices.draft
        if self.look_back:  # its whole cost: the catch-up forward
            line = self._look_back_line()
            extra = line[0] + line[1] * behind if line is not None else 0.0
        else:
            extra = prices.catch_up * behind + d0 + d1 * self.rows * k + prices.verify(self.rows * (1 + k)) - plain_s
        if self._rounds_may_judge and self.excess_s + extra > self._loss_budget(plain_s):
            return False  # this request's speculation has cost it its loss budget (`observe`)
        if not self.options.probe_budget:
            return True
        extra *= self._sharers()
        budget = self.options.probe_budget * plain_s
        return extra <= budget * remaining and self.explored_s + extra <= budget * max(self.length or 0, remaining)

    def _look_back_line(self) -> tuple[float, float] | None:
        """A look-back's cost, `(fixed, per token)` seconds: as look-backs measured it (`SharedCosts.look_back_line`),
        else the drafter's catch-up line; None (free) until measured, so that a request measures it. Not when
        others share the draft (`_sharers`): they would all measure it at once (a wave of requests on a cold or
        stale target), so it is priced as the target's own plain line until then (a draft model is smaller than
        its target).

        Not the catch-up line alone: that line leaves out what a block's fixed part explains, which a look-back
        pays as well (the call, a forward's fixed cost). Priced without it, a remote draft's look-backs, each
        about one plain round, came every `off_rounds` rounds: 8 in the demo's 54 tokens, 12% of its time."""
        line = self.costs.look_back_line(self.proposer)
        if line is None:
            line = self.costs.catch_up_line(self.proposer)
        if line is None and self._sharers() > 1:
            return self.costs.plain()
        return line

    def _sharers(self) -> float:
        """How many requests a probe's extra time delays: this one, and every other one waiting for the device
        while it drafts or catches up: for a draft on the target's device (`shares_device`) every request on
        the target, for a remote draft service those drafting with it (`draft_load`)."""
        return 1.0 + (self._others() if self.shares_device else _count(self.draft_load))

    def _others(self) -> float:
        """Other requests waiting on this one's forwards now (the target's `load`)."""
        return _count(self.load)

    @property
    def off(self) -> bool:
        """Whether the controller is taking time off (plain rounds, or the probe that ends them)."""
        return bool(self.off_period)

    def observe(
        self,
        asked: int,
        wanted: list[int],
        drafted: list[int],
        accepted: list[int],
        draft_s: float,
        verify_s: float,
        verify_tokens: int,
        behind: int = 0,
        hindsight: tuple[int, int, int] | None = None,
        ahead_hit: bool = False,
    ) -> None:
        """What a round did.

        Args:
            asked (`int`): the draft length asked of the drafter (0: it was not called).
            wanted (`list[int]`): per row, the draft length it asked for (0 for a finished row).
            drafted (`list[int]`), accepted (`list[int]`): per row, drafts verified and kept.
            draft_s (`float`): wall time of `propose`.
            verify_s (`float`): wall time of the verify forward and its acceptance.
            verify_tokens (`int`): tokens the verify forward ran for this request.
            behind (`int`, *optional*, defaults to 0): tokens the drafter had not seen before this round.
            hindsight (`tuple[int, int, int]`, *optional*): `(checked, kept, confident)` over the request's
                rows (`drafters.Hindsight`): evidence from the tokens the drafter caught up on.
            ahead_hit (`bool`, *optional*, defaults to `False`): the drafts were drafted ahead
                (`Proposal.ahead_hit`): `draft_s` is a hit's price, learned apart (`SharedCosts.observe_draft`).
        """
        assert self.acceptance is not None and self.continuation is not None and self.last is not None
        if asked and not self.all_or_nothing:  # what the model predicted of the blocks, before it learns from them
            for k, n, m in zip(wanted, drafted, accepted, strict=True):
                if k and n:
                    predicted = self._kept(k)
                    self.costs.observe_kept(self.proposer, predicted, min(m, n))
                    before, kept = self.kept_seen
                    self.kept_seen = (before * KEPT_DECAY + predicted, kept * KEPT_DECAY + min(m, n))
        checked, kept, confident = hindsight or (0, 0, 0)
        if checked:
            # Each of the target's tokens the draft guessed is one after which it would have gone on or stopped
            # (continuation), and each sure guess a draft it would have gone on after and had kept or not
            # (acceptance: the rate counts a draft kept and gone on after as c * a, see `Hindsight`).
            self.acceptance.observe_counts(kept, confident - kept, per_token_decay=HINDSIGHT_DECAY)
            self.continuation.observe_counts(confident, checked - confident, per_token_decay=HINDSIGHT_DECAY)
            # Where in a block the drafts stop being kept is learned from blocks only: those before the checked
            # tokens are that much older, forgotten as the estimates forget them (blocks rejected early where the
            # answer was hard otherwise kept pricing long blocks out once it had turned easy).
            self.runs.forget(HINDSIGHT_DECAY**checked)
            self.costs.observe_hindsight(self.proposer, checked, kept, confident)
        for k, n, m in zip(wanted, drafted, accepted, strict=True):
            if self.all_or_nothing:
                self.continuation.observe(1 if asked and k else 0, 1 if n else 0)
                self.acceptance.observe(n, min(m, n))
            else:
                # The first draft is always proposed: going on after each of the others is the evidence.
                could, went_on = (k - 1, n - 1) if asked and n else (0, 0)
                self.continuation.observe(could, went_on)
                # A draft it stopped after on its own (short of `k`) is its last, unsure one, kept at `u`; the ones it
                # went on after are sure, kept at `a` (what a look-back reads too). Counted as one acceptance, every
                # block's unsure last draft pulled a sure-draft rate measured at ~0.98 by look-backs down to ~0.85.
                sure = n - 1 if asked and 0 < n < k else n
                last = (1, int(m >= n)) if sure < n and m >= sure else (0, 0)
                self.acceptance.observe(sure, min(m, sure))
                self.last.observe(*last)
                # Not prompt lookup's: whether a prompt repeats itself is a property of that prompt, not of the
                # deployment, so its requests start from `PRIORS`.
                self.costs.observe_acceptance(self.proposer, sure, min(m, sure), could, went_on, last)
            # Prompt lookup's runs count its proposed drafts (a block or none is `c`); a draft model's
            # count every draft asked, proposed and kept (a draft it did not propose ends the run).
            self.runs.observe(n if self.all_or_nothing else (k if asked else 0), min(m, n))
        self.costs.observe_verify(verify_tokens, verify_s, drafted=any(drafted), loaded=self._others() > 0)
        if asked and self.caught_up and not self.probing:
            self.costs.observe_draft(self.proposer, sum(drafted), draft_s, ahead_hit=ahead_hit)
        elif (asked or self.looking_back) and behind > 1:  # the drafter caught up: what drafting does not explain
            d0, d1 = self.costs.prices(self.proposer).draft
            self.costs.observe_catch_up(self.proposer, behind, draft_s - d0 - d1 * sum(drafted))
        # The loss budget's ledger: every drafting round whose drafter lacked only the last round's tokens, every
        # probe, and every look-back's wait (its round is a plain one). Not a first block's catch-up on the prompt,
        # afforded apart (`_drafts_at_once`). Not `behind <= 1`: after a round that kept drafts the drafter lacks those
        # too (`behind` is the tokens the last round emitted), and counting only the rounds after a rejected first
        # draft, a pinned serial target drafted a code edit on at 0.76x of plain decoding, its count 0.06 s over
        # plain. Look-backs and probes count too: with only their own budgets, a pinned overlapped code edit looked
        # back, drafted on to 0.49 s over plain decoding (its budget 0.35 s), looked back twice more, and ran at 0.89x
        # of plain greedy.
        if self._rounds_may_judge and (self.looking_back or (asked and (self.caught_up or self.probing))):
            plain_s = self._plain_round()
            if self.looking_back:
                spent = draft_s
            else:
                emitted = sum(min(m, n) + 1 for k, n, m in zip(wanted, drafted, accepted, strict=True) if k)
                spent = draft_s + verify_s - emitted * plain_s / self.rows
            self.excess_s = max(self.excess_s + spent, -self._loss_budget(plain_s))  # gains bank at most the budget
        if self.looking_back and behind:
            self.costs.observe_look_back(self.proposer, behind, draft_s)
        between_blocks = not asked and not self.looking_back and not self.off_period  # a round measuring plain decoding
        if not (between_blocks and self.shares_device):
            # A co-located draft's next block still prices the draft after a round measuring plain decoding
            # (`plain_due`): its first forward takes that round's token along for about nothing. Counted as a catch-up,
            # a fresh target's first blocks (a block, the plain round, a block) measured no draft price, which then
            # stayed what catch-ups said of a forward (`SharedCosts.forward_price`, which errs high): ~40 ms a drafted
            # token for SmolLM2's int8 draft on its target's 2 cores where a block measured ~28, and no later request
            # drafted. Not a remote draft's: its block after a plain round measured dear (a pinned serial target
            # then drafted less on chat, 10.7 tok/s against 11.3).
            self.caught_up = asked > 0 or self.looking_back
        if self.looking_back or self.probing:  # what trying cost over a plain round (`_probe_affordable`)
            plain_s = verify_s if self.looking_back else self._plain_round()
            self.explored_s += max(draft_s + verify_s - plain_s, 0.0) * self._sharers()
        if self.looking_back:
            if not checked:
                self.look_back = False  # the drafter reports no hindsight: the next round probes instead
            elif self._resumes():
                self.off_period = 0  # drafting would have paid over the time off (or its price is in doubt)
                self.explored_s = 0.0
            else:
                # Twice the last time off, from a quarter of the budgeted interval up to it: an answer's start is
                # where the draft's acceptance changes most (the low-acceptance prompt's after ~20 tokens), and there
                # the budget alone looked back after 20-25 rounds, at 0.79x of transformers' constant schedule
                # against 0.91x. Not from `off_rounds` alone: a draft far dearer than its target would look back
                # every few rounds at many times the budget.
                interval = self._look_back_interval()
                self.off_period = min(
                    max(self.options.off_rounds, min(2 * self.off_period, interval), math.ceil(interval / 4)),
                    self.options.max_off_rounds,
                )
                self.off_left = self.off_period
        elif self.probing:
            if self._resumes():
                self.off_period = 0  # drafting pays again (or its price is in doubt)
                self.explored_s = 0.0
            else:
                self.off_period = min(
                    max(self.off_period * 2, self._budgeted_off_rounds(draft_s + verify_s)),
                    self.options.max_off_rounds,
                )
                self.off_left = self.off_period
        if asked or self.off_period:  # a round measuring plain decoding (`plain_due`) leaves it as it was
            self.drafting = asked > 0 and not self.off_period

    def _resumes(self) -> bool:
        """Whether drafting resumes after a look-back or probe: it pays, or only a doubtful price keeps it out
        (`_doubted_length`), and then the next round drafts the block that measures that price (`recheck`)."""
        if self.best_length() > 0:
            return True
        self.recheck = self._doubted_length()
        return self.recheck > 0

    def _doubted_length(self) -> int:
        """The block to draft where only a draft price measured from fewer than `SURE_DRAFT_BLOCKS` blocks rules
        drafting out, and drafting would pay at the price of the draft's forward (`SharedCosts.forward_price`,
        which every catch-up measures again); 0 otherwise. That block measures the draft's price once more.

        Look-backs and probes do not measure that price (their drafter catches up first), so a price from one slow
        block stood for as long as it kept the request off drafting: on a cold co-located target one early block
        priced the draft at 26 ms a token (17-19 ms once warm), and the request decoded 79 tokens without drafts."""
        if self.all_or_nothing or self.costs.draft_blocks(self.proposer) >= SURE_DRAFT_BLOCKS:
            return 0
        forward = self.costs.forward_price(self.proposer)
        prices = self._prices()
        d0, d1 = prices.draft
        if forward is None or d1 <= forward:  # a drafted token no dearer than a forward: nothing to doubt
            return 0
        return self.best_length(prices=replace(prices, draft=(d0, forward)))

    def _look_back_interval(self) -> int:
        """Plain rounds after which the next look-back (its fixed cost, and the catch-up of those rounds' tokens,
        `_look_back_line`) costs at most `probe_budget` of them. Not the last look-back's cost: the first one also
        caught up on the prompt, which is not done again."""
        plain, line = self.costs.plain(), self._look_back_line()
        if not self.options.probe_budget or plain is None or line is None:
            return 0
        sharers = self._sharers()
        room = self.options.probe_budget * (plain[0] + plain[1] * self.rows) - line[1] * self.rows * sharers
        if room <= 0:
            return self.options.max_off_rounds
        return int(math.ceil(line[0] * sharers / room))

    def _budgeted_off_rounds(self, probe_seconds: float) -> int:
        """Plain rounds after which a probe's extra cost is at most `probe_budget` of the time off."""
        plain = self.costs.plain()
        if not self.options.probe_budget or plain is None:
            return 0
        plain_round = plain[0] + plain[1] * self.rows
        extra = max(probe_seconds - plain_round, 0.0) * self._sharers()
        return int(math.ceil(extra / (self.options.probe_budget * max(plain_round, 1e-9))))
