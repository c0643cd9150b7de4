"""What every request on one target shares for the speculation controller (`speculation.controller`): the
measured costs of verify rounds, drafts and catch-ups, and each draft model's measured acceptance (the priors
of its next requests). The cost model that reads them is described in `speculation.controller`.

Pure Python, thread-safe; no services.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from specwire.generation.speculation.estimates import AcceptanceEstimate, LinearCost, SizedCost

__all__ = ["ALL_OR_NOTHING", "DEFAULT_PRIORS", "LAST_DRAFT_PRIOR", "PRIORS", "Prices", "SharedCosts"]

# Proposers whose proposals are all or nothing: prompt lookup finds a match and copies what followed it (as
# many tokens as asked, or up to the end of the text), or finds none and costs nothing (the round is a plain
# one). Their continuation estimate is the chance of a match per round, not per token.
ALL_OR_NOTHING = frozenset({"prompt_lookup"})
# Priors per proposer: (acceptance of a proposed token, continuation). A match of prompt lookup is a coin toss
# until the request's own rounds say otherwise (a few rounds do: the prior weighs 4 tokens). A draft model's
# prior, until this target has measured its acceptance (`SharedCosts.priors`), is cautious on purpose: on a
# CPU its drafting barely pays even where most drafts are kept (SmolLM2 + its int8 draft: +42% at k=20 on
# chat, -18% on the code edit), and (0.85, 0.85) drafted on the code edit at 0.81x of plain decoding, the
# prefill and the first blocks spent before the request's own rounds said no.
PRIORS = {"prompt_lookup": (0.8, 0.5)}
DEFAULT_PRIORS = (0.7, 0.8)
# A draft model's last draft, the one after which it stopped on its own (unsure of it, or its EOS), is kept far less
# often than the sure ones before it (`SpeculationController.last`): its prior until this target measured it.
LAST_DRAFT_PRIOR = 0.5
# Evidence the target's measured acceptance keeps at each row-round (`SharedCosts.priors`): about the last 100
# row-rounds of every request count, so a new request starts from what the pair of models has been doing lately.
SHARED_DECAY = 0.99

# The calibration of a draft model's kept drafts (`SharedCosts.kept_factor`): the prior weighs this many predicted
# drafts at a factor of 1, and the factor stays within these bounds.
KEPT_PRIOR_DRAFTS = 4.0
KEPT_FACTOR_BOUNDS = (1.0, 2.0)

# The prior line of a draft's price (`SharedCosts.draft`, `LinearCost.fit`): a block's fixed part as a fraction of a
# drafted token's. A block's first forward also catches the draft up on the last round's tokens, so a block of k
# drafts costs about k + 1 single-token forwards; a line through the origin charged that to the few drafts of the
# first (short) blocks: 2 drafts in 58 ms priced a drafted token at 29 ms where it costs ~17 (SmolLM2's int8 draft,
# co-located on 2 cores, the first block on a fresh target).
DRAFT_FIXED_RATIO = 1.0
# How many requests a draft, catch-up or verify cost stays known for without being measured again
# (`SharedCosts._current`).
STALE_AFTER_REQUESTS = 16


class _Measured(NamedTuple):
    """A proposer's acceptance, continuation and last draft's acceptance, as this target measured them."""

    acceptance: AcceptanceEstimate
    continuation: AcceptanceEstimate
    last: AcceptanceEstimate


@dataclass(frozen=True)
class Prices:
    """A snapshot of the costs one decision reads (seconds).

    Args:
        plain (`Callable[[float], float]`): a round without drafts, by tokens verified.
        verify (`Callable[[float], float]`): a round with drafts, by tokens verified.
        draft (`tuple[float, float]`): `(d0, d1)`, the drafter's seconds for `d0 + d1 * tokens drafted`.
        slope (`float`): seconds per verified token of a round with drafts (what a token costs the
            requests sharing the forward).
        catch_up (`float`): the drafter's seconds per token it has not seen yet (its prefill).
        kept_factor (`float`): measured drafts kept over the drafts the controller's model predicted
            (`SharedCosts.kept_factor`).
        ahead (`tuple[float, float]`, *optional*): `(h0, h1)`, the seconds of a round whose drafts were drafted
            ahead (`SharedCosts.ahead`), by tokens drafted; None until one was measured. `draft` is then the price
            of a round whose drafts were not (a miss: the draft service drafts them while the target waits).
    """

    plain: Callable[[float], float]
    verify: Callable[[float], float]
    draft: tuple[float, float]
    slope: float
    catch_up: float = 0.0
    kept_factor: float = 1.0
    ahead: tuple[float, float] | None = None


class SharedCosts:
    """The measured costs every request on one target shares: the verify forward, one draft cost per proposer,
    and one catch-up cost (the draft's prefill of the tokens it has not seen) per proposer; and each draft
    model's measured acceptance, the priors of its next requests (`priors`).

    Args:
        verify_slope_prior (`float`, *optional*, defaults to 0.05): verify seconds per extra token as a
            fraction of the forward's fixed cost, until block sizes vary.
        draft_slope_prior (`float`, *optional*, defaults to 0.2): draft seconds per proposed token as a
            fraction of the verify forward's fixed cost, until the draft was measured (prompt lookup: 0; at
            least a one-token forward of the draft once its catch-up was measured, `draft`).
        look_back_slope_prior (`float`, *optional*, defaults to 0.05): a look-back's seconds per token as a fraction
            of its fixed part, until the numbers of tokens look-backs caught up on vary: a forward over a few tokens
            costs about its fixed part. Not a line through the origin (all of the cost per token): an overlapped
            draft's look-backs all catch up on the few tokens after a prompt prefilled apart, and priced so, a
            pinned draft service's look-backs over ~5 tokens came to ~12 ms a token where its prefill ran at ~2.6:
            the next look-back was priced out of every request (`SpeculationController._look_back_interval`), so a
            target whose first request stopped drafting never drafted again (chat: 11.9 tok/s overlapped against
            14.3 serial on the same pinned cores).
        stale_after_requests (`int`, *optional*, defaults to `STALE_AFTER_REQUESTS`): a draft, catch-up or
            verify cost not measured again over this many requests (`new_request`) is forgotten.
    """

    def __init__(
        self,
        verify_slope_prior: float = 0.05,
        draft_slope_prior: float = 0.2,
        look_back_slope_prior: float = 0.05,
        stale_after_requests: int = STALE_AFTER_REQUESTS,
    ):
        self.verify_slope_prior = verify_slope_prior
        self.draft_slope_prior = draft_slope_prior
        self.look_back_slope_prior = look_back_slope_prior
        self.stale_after_requests = stale_after_requests
        self._requests = 0  # controllers made on this target (`new_request`)
        # (draft | ahead | catch_up | look_back | verify, proposer) -> `_requests` when last measured
        self._measured_at: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._verify = SizedCost()  # rounds with drafts
        self._plain = SizedCost()  # rounds without
        self._alone: set[str] = set()  # "verify", "plain": measured alone, not learned from loaded rounds since
        self._drafts: dict[str, LinearCost] = {}
        self._ahead: dict[str, LinearCost] = {}  # rounds whose drafts were drafted ahead (hits)
        self._catch_up: dict[str, LinearCost] = {}
        self._look_backs: dict[str, LinearCost] = {}
        self._measured: dict[str, _Measured] = {}
        self._since_plain = 0  # rounds with drafts since the last round without
        self._kept: dict[str, tuple[float, float]] = {}  # proposer -> (predicted, kept) drafts, forgotten

    def observe_verify(self, tokens: int, seconds: float, drafted: bool = True, loaded: bool = False) -> None:
        """A round's verify forward and bookkeeping took `seconds` for `tokens` (`drafted`: some row drafted).

        `loaded`: other requests shared the round. Its seconds are then mostly theirs (their tokens in the packed
        forward, their prefills, a co-located draft's forwards on the device) and change from round to round, so it
        prices rounds only until a round alone is measured (`_alone`), which replaces what they said; the controller
        prices a loaded round from rounds alone (`SpeculationController.expect`). Learned together, the prices of
        blocks measured alone met a plain round's measured under load: 8 co-located chat clients after single-client
        requests priced a block of one draft at 40 ms against a plain round's 112, drafted, and ran at 0.83x-0.88x of
        plain decoding in 3 of 4 paired waves."""
        with self._lock:
            kind = "verify" if drafted else "plain"
            if drafted:
                self._forget_stale_verify()
                self._measured_at[("verify", "")] = self._requests
            self._since_plain = self._since_plain + 1 if drafted else 0
            if loaded and kind in self._alone:
                return
            if not loaded and kind not in self._alone:  # the first round alone: what loaded rounds said goes
                self._alone.add(kind)
                if drafted:
                    self._verify = SizedCost()
                else:
                    self._plain = SizedCost()
            (self._verify if drafted else self._plain).observe(tokens, seconds)

    def _forget_stale_verify(self) -> None:
        """Rounds with drafts not measured for `stale_after_requests` are forgotten (under the lock), as a draft cost is
        (`_current`): measured in a burst, each request's verify waits for the others' in the packed forward, and
        such a price keeps every request off drafting once the burst is over."""
        at = self._measured_at.get(("verify", ""))
        if at is not None and self._requests - at > self.stale_after_requests:
            self._verify = SizedCost()
            self._alone.discard("verify")
            del self._measured_at[("verify", "")]

    def new_request(self) -> None:
        """A request's controller was made: unmeasured costs age by one request (`stale_after_requests`)."""
        with self._lock:
            self._requests += 1

    def plain_due(self, every: int) -> bool:
        """Whether a round without drafts should be measured now: none has been since a round with drafts was,
        or not for `every` rounds with drafts. A target whose requests all draft would otherwise price plain
        decoding by the verify line's intercept, which on a CPU is well above a plain round (SmolLM2 on one
        core: ~55 ms against 37), and keep drafting where plain decoding is faster."""
        with self._lock:
            if not self._plain.line.observations:
                return self._verify.line.observations > 0
            return self._since_plain >= every

    def plain(self) -> tuple[float, float] | None:
        """`(p0, p1)`: a round without drafts costs about `p0 + p1 * tokens`; None before one was measured."""
        with self._lock:
            return self._plain.line.fit(self.verify_slope_prior)

    def verify(self) -> tuple[float, float] | None:
        """`(v0, v1)`: a round with drafts costs about `v0 + v1 * tokens`; None before one was measured."""
        with self._lock:
            self._forget_stale_verify()
            return self._verify.line.fit(self.verify_slope_prior)

    def observe_draft(self, proposer: str, k: int, seconds: float, ahead_hit: bool = False) -> None:
        """`propose` took `seconds` for `k` drafts; `ahead_hit`: they were drafted ahead (`Proposal.ahead_hit`).

        Hits and misses are two prices: a hit waits for what drafting ahead had not finished, a miss for the whole
        draft. One line through both priced an overlapped draft by the mix of the requests that measured it: chat's
        mostly hits kept it low, and a code edit whose blocks mostly missed (11-15 hits against 28-29 misses a
        request) drafted at that price, at 0.93x of plain decoding (`SpeculationController.expect` mixes the two
        by the request's own chance of a hit)."""
        kind, table = ("ahead", self._ahead) if ahead_hit else ("draft", self._drafts)
        with self._lock:
            self._current(table, kind, proposer)  # a stale line is not extended
            table.setdefault(proposer, LinearCost()).observe(k, seconds)
            self._measured_at[(kind, proposer)] = self._requests

    def ahead(self, proposer: str) -> tuple[float, float] | None:
        """`(h0, h1)`: a round whose drafts were drafted ahead costs about `h0 + h1 * k` for `k` drafts; None until
        one was measured (no overlap, or none yet)."""
        with self._lock:
            cost = self._current(self._ahead, "ahead", proposer)
            return cost.fit(DRAFT_FIXED_RATIO) if cost is not None else None

    def observe_catch_up(self, proposer: str, tokens: int, seconds: float) -> None:
        """The drafter spent `seconds` (beyond drafting) on `tokens` it had not seen (the first block's prefill)."""
        with self._lock:
            self._current(self._catch_up, "catch_up", proposer)
            self._catch_up.setdefault(proposer, LinearCost()).observe(tokens, max(seconds, 0.0))
            self._measured_at[("catch_up", proposer)] = self._requests

    def observe_look_back(self, proposer: str, tokens: int, seconds: float) -> None:
        """A look-back caught the drafter up on `tokens` in `seconds`: its whole wall time, the call and a forward's
        fixed cost included (the catch-up line leaves out what a block's fixed part, `d0`, explains)."""
        with self._lock:
            self._current(self._look_backs, "look_back", proposer)
            self._look_backs.setdefault(proposer, LinearCost()).observe(tokens, seconds)
            self._measured_at[("look_back", proposer)] = self._requests

    def look_back_line(self, proposer: str) -> tuple[float, float] | None:
        """`(fixed, per token)` seconds of a look-back over that many tokens; None until two were measured (one,
        a request's first over its prompt, cannot tell its fixed part from its tokens)."""
        with self._lock:
            cost = self._current(self._look_backs, "look_back", proposer)
            return cost.fit(self.look_back_slope_prior) if cost is not None and cost.observations >= 2 else None

    def _current(self, table: dict[str, LinearCost], kind: str, proposer: str) -> LinearCost | None:
        """`table`'s cost of `proposer`, forgotten once not measured over `stale_after_requests` (under the lock).

        A cost measured under a burst (8 clients' drafts served in turn by one draft service: ~20x a single
        request's) stops every request from drafting, so nothing measures it again: it would outlive the burst
        for as long as the target runs. Forgotten, the next request drafts or looks back from the prior and
        measures it anew (a few rounds every `stale_after_requests` requests where drafting does not pay). Counted
        in requests, not seconds: sparse traffic that drafts keeps its costs between requests."""
        cost = table.get(proposer)
        if cost is not None and self._requests - self._measured_at[(kind, proposer)] > self.stale_after_requests:
            del table[proposer]
            return None
        return cost

    def draft(self, proposer: str, verify_intercept: float) -> tuple[float, float]:
        """`(d0, d1)`: draft seconds = `d0 + d1 * k`, from the prior until `proposer` was measured.

        The prior of a draft model's `d1` is `draft_slope_prior` of the verify forward's fixed cost, or, once its
        catch-up was measured (a look-back measures it before any block), what that forward cost for one token,
        if more: each drafted token is a forward of the draft. A slow draft (20 ms a forward against a ~2 ms
        target) otherwise looked cheap after its first look-back, and drafted a block it could never repay."""
        with self._lock:
            cost = self._current(self._drafts, "draft", proposer)
            fitted = cost.fit(DRAFT_FIXED_RATIO) if cost is not None else None
        if fitted is not None:
            return fitted
        # Prompt lookup searches the text it has: free until measured (a remote one's round trip then is).
        if proposer in ALL_OR_NOTHING:
            return (0.0, 0.0)
        return (0.0, max(self.draft_slope_prior * verify_intercept, self.forward_price(proposer) or 0.0))

    def forward_price(self, proposer: str) -> float | None:
        """Seconds of one forward of the drafter over one token, from its catch-up line (its fixed part and one
        token's); None until a catch-up was measured. Each drafted token is such a forward. The line is fitted to
        catch-ups over several tokens, which cost more than a drafting step (SmolLM2's int8 draft on 2 cores: ~28
        ms against ~17), so this errs high."""
        line = self.catch_up_line(proposer)
        return line[0] + line[1] if line is not None else None

    def draft_blocks(self, proposer: str) -> int:
        """How many blocks `proposer`'s current draft price was measured from (0: the prior's)."""
        with self._lock:
            cost = self._current(self._drafts, "draft", proposer)
            return cost.observations if cost is not None else 0

    def priors(self, proposer: str) -> tuple[float, float, float]:
        """`(acceptance, continuation, last draft's acceptance)` a new request of `proposer` starts from: what this
        target's earlier requests measured (`observe_acceptance`), `PRIORS` and `LAST_DRAFT_PRIOR` until they did."""
        with self._lock:
            measured = self._measured.get(proposer)
            if measured is None:
                return (*PRIORS.get(proposer, DEFAULT_PRIORS), LAST_DRAFT_PRIOR)
            return measured.acceptance.mean, measured.continuation.mean, measured.last.mean

    def observe_acceptance(
        self, proposer: str, drafted: int, kept: int, asked: int, proposed: int, last: tuple[int, int] = (0, 0)
    ) -> None:
        """One row-round of a request: the target kept the first `kept` of `drafted` drafts; asked for `asked` more
        after its first (which it always proposes), the drafter proposed `proposed` of them; `last`, `(trials,
        kept)` of the draft it stopped after on its own (`SpeculationController.observe`)."""
        with self._lock:
            measured = self._measured_of(proposer)
            measured.acceptance.observe(drafted, kept)
            measured.continuation.observe(asked, proposed)
            measured.last.observe(*last)

    def observe_hindsight(self, proposer: str, checked: int, kept: int, confident: int) -> None:
        """A request's look-back (`drafters.Hindsight`). Blocks are drafted only where the controller expects
        them to pay, so their acceptance alone overstates the pair's: the tokens of the time off count too."""
        with self._lock:
            measured = self._measured_of(proposer)
            measured.acceptance.observe_counts(kept, confident - kept)
            measured.continuation.observe_counts(confident, checked - confident)

    def observe_kept(self, proposer: str, predicted: float, kept: int) -> None:
        """One row-round of a request: the controller's model predicted `predicted` kept drafts, the target kept
        `kept`."""
        with self._lock:
            old_predicted, old_kept = self._kept.get(proposer, (0.0, 0.0))
            self._kept[proposer] = (old_predicted * SHARED_DECAY + predicted, old_kept * SHARED_DECAY + kept)

    def kept_factor(self, proposer: str) -> float:
        """Drafts the target kept over drafts the controller's model predicted, over this target's last ~100
        row-rounds of `proposer` (1 before any; within `KEPT_FACTOR_BOUNDS`).

        The model multiplies a per-token acceptance and continuation as if each token were a coin of its own. A
        draft model's are not: where it is sure for many tokens it is mostly right, so long runs are kept more
        often than the product says. On the chat prompt (SmolLM2, its int8 draft, blocks of up to 20 and the
        confidence stop) the first 15 rounds kept 2.6 drafts a round where the product of their measured rates
        (0.85 acceptance, 0.68 continuation) says 2.0; the model then priced drafting at break-even where it ran
        1.26x of plain decoding, and the controller stayed off for a third of the answer.

        Not below 1: the factor corrects that one bias, which only undercounts; a draft that keeps fewer drafts
        than before shows in its acceptance and continuation, which the model reads. Below 1, one rejected first
        block (0 kept where 1.5 were predicted) priced drafting out for good: with no blocks drafted, nothing
        measured the factor again."""
        with self._lock:
            predicted, kept = self._kept.get(proposer, (0.0, 0.0))
        low, high = KEPT_FACTOR_BOUNDS
        return min(max((kept + KEPT_PRIOR_DRAFTS) / (predicted + KEPT_PRIOR_DRAFTS), low), high)

    def _measured_of(self, proposer: str) -> _Measured:
        if proposer not in self._measured:
            priors = (*PRIORS.get(proposer, DEFAULT_PRIORS), LAST_DRAFT_PRIOR)
            self._measured[proposer] = _Measured(*(AcceptanceEstimate(prior, decay=SHARED_DECAY) for prior in priors))
        return self._measured[proposer]

    def catch_up(self, proposer: str) -> float:
        """Seconds per token the drafter has not seen (0 until measured)."""
        line = self.catch_up_line(proposer)
        return line[1] if line is not None else 0.0

    def catch_up_line(self, proposer: str) -> tuple[float, float] | None:
        """`(fixed, per token)` seconds of the drafter's catch-up (a forward's fixed cost, then its tokens);
        None until measured."""
        with self._lock:
            cost = self._current(self._catch_up, "catch_up", proposer)
            return cost.fit(None) if cost is not None else None

    def prices(self, proposer: str) -> Prices:
        """The costs of one decision; before any measurement the prior's shape on a unit scale, and a drafting
        round not measured yet is assumed to cost what a plain one does (it is then measured)."""
        verify_line, plain_line = self.verify(), self.plain()
        if verify_line is None and plain_line is None:
            plain_line = (1.0, self.verify_slope_prior)
        verify_line = verify_line if verify_line is not None else plain_line
        plain_line = plain_line if plain_line is not None else verify_line
        assert verify_line is not None and plain_line is not None  # one was measured, or the prior set it
        measured_verify = self._verify.line.observations > 0
        measured_plain = self._plain.line.observations > 0
        verify_sized, plain_sized = self._verify, self._plain

        def verify(tokens: float) -> float:
            if not measured_verify:
                return plain(tokens)
            with self._lock:
                return verify_sized.at(tokens, verify_line)

        def plain(tokens: float) -> float:
            if not measured_plain:
                return plain_line[0] + plain_line[1] * tokens
            with self._lock:
                return plain_sized.at(tokens, plain_line)

        return Prices(
            plain,
            verify,
            self.draft(proposer, plain_line[0]),
            verify_line[1],
            self.catch_up(proposer),
            self.kept_factor(proposer),
            self.ahead(proposer),
        )
