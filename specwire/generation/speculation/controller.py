"""The adaptive speculation controller: each round, the draft length that maximizes expected tokens per second.

A request that names no draft schedule (no `num_assistant_tokens`, no `num_assistant_tokens_schedule`,
no `prompt_lookup_num_tokens`) gets one `SpeculationController`. Before each round it picks `k` in
`0..max_length` maximizing the expected tokens per second of the round. Per row, asked for `k`:

- the drafter proposes its next token with probability `c` (prompt lookup may find no match, a draft
  model may stop at its EOS or its confidence threshold) and the target accepts a proposed token
  with probability `a` (`AcceptanceEstimate` each: a Beta posterior over the request's own rounds,
  forgetting old rounds so that it follows a request whose text changes character);
- so the round emits `E(k) = (1 - (ca)^(k+1)) / (1 - ca)` tokens (accepted drafts plus the target's
  recovered or bonus token), verifies `N(k) = c + c^2 + .. + c^k` drafted tokens, and has a block at
  all with probability `c`;
- it costs `D + c * v0 + (1 - c) * P(rows) + v1 * rows * (c + N(k)) + L`, where
  `D = d0 + d1 * rows * N(k)` is the wall time of `drafter.propose(k)` as the target sees it (a
  remote, overlapped or co-located draft is measured the same way; `LinearCost` per proposer, shared
  by the requests of one target), `V(n) = v0 + v1 * n` a round with drafts for `n` tokens (the verify
  forward and its bookkeeping: each position's processors, the acceptance, the cache crop) and
  `P(n) = p0 + p1 * n` a round without. Two lines, because a round with drafts costs a fixed amount
  more than one without (on a 2-core CPU with SmolLM2-135M about 30 ms over a 37 ms plain round), which
  one line through both would mistake for a steep cost per token. Both are shared by every request on
  the target: they are properties of the model and the hardware;
- `L = others * v1 * rows * N(k)` is the load term: with other requests in the same forwards (the
  batched scheduler) or in turn on the model thread, a block's extra tokens make each of them wait
  `v1` per token; `others` comes from a callable the target passes in.

`k = 0` is plain decoding (one target forward per round, no draft). A drafting choice must beat
plain decoding by `ControllerOptions.margin`. When plain decoding wins, the controller stops
drafting for `off_rounds` rounds ("time off"), then drafts a short probe block to learn whether the
acceptance changed; each probe after which drafting still does not pay at least doubles the time off
(up to `max_off_rounds`), and makes it long enough that the probe's extra cost stays within
`probe_budget` of it; a probe that pays resumes drafting and resets it.

Cost priors. Until a cost has been measured it is taken relative to the plain round's cost
(`v1 = verify_slope_prior * v0`, `d1 = draft_slope_prior * p0`, `d0 = 0`; a drafting round is first
assumed to cost what a plain one does), so the first rounds draft a few tokens, not transformers' 20.
Draft times are learned only from rounds whose previous round also drafted: the first block of a
request (the draft's prefill) and a probe after time off (the draft catches up on every token since
it last drafted) would teach it a per-round cost that steady drafting does not pay.

Pure Python, thread-safe where shared (`SharedCosts`); no services. Output never depends on it: the
draft length changes how many tokens a round verifies, not which tokens are emitted.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from specwire.vocabulary import DRAFT_LENGTH_CONTROLLER, DRAFT_LENGTH_SCHEDULE

__all__ = [
    "DECIDED_BY_CONTROLLER",
    "DECIDED_BY_SCHEDULE",
    "AcceptanceEstimate",
    "ControllerOptions",
    "LinearCost",
    "SharedCosts",
    "SpeculationController",
    "expected_tokens",
]

# What decided a request's draft lengths (`SpeculationStats.decided_by`).
DECIDED_BY_CONTROLLER = DRAFT_LENGTH_CONTROLLER
DECIDED_BY_SCHEDULE = DRAFT_LENGTH_SCHEDULE


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens one row emits from a block of `k` drafts: `(1 - a^(k+1)) / (1 - a)`.

    Args:
        acceptance (`float`): per-token acceptance probability `a` in `[0, 1]`.
        k (`int`): drafted tokens (0: plain decoding, one token).
    """
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class LinearCost:
    """`seconds = intercept + slope * x`, fitted by least squares over exponentially forgotten observations.

    The slope is pulled towards a prior (ridge) so a model fitted from one block size stays sane.

    Args:
        decay (`float`, *optional*, defaults to 0.98): weight kept by past observations at each new one.
        slope_weight (`float`, *optional*, defaults to 40.0): strength of the slope prior, in
            observation-weight times x². Strong on purpose: rounds of nearly one size (blocks of 2 and
            3 tokens) on a busy CPU give a slope that is mostly noise, and a steep one would rule long
            blocks out before they were ever tried; blocks of many sizes outweigh it.
    """

    def __init__(self, decay: float = 0.98, slope_weight: float = 40.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"`decay` must lie in (0, 1], got {decay}; e.g. 0.98.")
        self.decay = decay
        self.slope_weight = slope_weight
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.observations = 0

    def observe(self, x: float, seconds: float) -> None:
        """One measurement: `seconds` for a size of `x`."""
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + seconds
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * seconds
        self.observations += 1

    def fit(self, slope_ratio: float | None) -> tuple[float, float] | None:
        """`(intercept, slope)`, or None before the first observation.

        Args:
            slope_ratio (`float`, *optional*): the prior slope as a fraction of the intercept; None puts
                the prior line through the origin (all of the cost per unit of x).
        """
        if not self.observations:
            return None
        w = self._w
        mean_x, mean_y = self._x / w, self._y / w
        var = max(self._xx / w - mean_x * mean_x, 0.0)
        cov = self._xy / w - mean_x * mean_y
        # The prior's line through the mean: intercept * (1 + ratio * mean_x) = mean_y.
        if slope_ratio is None:
            prior_slope = mean_y / max(mean_x, 1.0)  # (x counts tokens: below one, the cost is fixed)
        else:
            prior_slope = slope_ratio * mean_y / (1.0 + slope_ratio * mean_x)
        slope = max((w * cov + self.slope_weight * prior_slope) / (w * var + self.slope_weight), 0.0)
        intercept = max(mean_y - slope * mean_x, 0.0)
        return intercept, slope


class SharedCosts:
    """The measured costs every request on one target shares: the verify forward, and one draft cost per proposer.

    Args:
        verify_slope_prior (`float`, *optional*, defaults to 0.05): verify seconds per extra token as a
            fraction of the forward's fixed cost, until block sizes vary.
        draft_slope_prior (`float`, *optional*, defaults to 0.2): draft seconds per proposed token as a
            fraction of the verify forward's fixed cost, until the draft was measured.
    """

    def __init__(self, verify_slope_prior: float = 0.05, draft_slope_prior: float = 0.2):
        self.verify_slope_prior = verify_slope_prior
        self.draft_slope_prior = draft_slope_prior
        self._lock = threading.Lock()
        self._verify = LinearCost()  # rounds with drafts
        self._plain = LinearCost()  # rounds without
        self._drafts: dict[str, LinearCost] = {}

    def observe_verify(self, tokens: int, seconds: float, drafted: bool = True) -> None:
        """A round's verify forward and bookkeeping took `seconds` for `tokens` (`drafted`: some row drafted)."""
        with self._lock:
            (self._verify if drafted else self._plain).observe(tokens, seconds)

    def plain(self) -> tuple[float, float] | None:
        """`(p0, p1)`: a round without drafts costs `p0 + p1 * tokens`; None before one was measured."""
        with self._lock:
            return self._plain.fit(self.verify_slope_prior)

    def observe_draft(self, proposer: str, k: int, seconds: float) -> None:
        with self._lock:
            self._drafts.setdefault(proposer, LinearCost()).observe(k, seconds)

    def verify(self) -> tuple[float, float] | None:
        """`(v0, v1)`: a round with drafts costs `v0 + v1 * tokens`; None before one was measured."""
        with self._lock:
            return self._verify.fit(self.verify_slope_prior)

    def draft(self, proposer: str, verify_intercept: float) -> tuple[float, float]:
        """`(d0, d1)`: draft seconds = `d0 + d1 * k`, from the prior until `proposer` was measured."""
        with self._lock:
            cost = self._drafts.get(proposer)
            fitted = cost.fit(None) if cost is not None else None
        return fitted if fitted is not None else (0.0, self.draft_slope_prior * verify_intercept)


class AcceptanceEstimate:
    """A per-token probability of one request (acceptance, continuation): a Beta posterior whose evidence
    is forgotten geometrically.

    A chain of `k` trials of which the first `m` succeeded adds `m` successes and, when `m < k`, one
    failure (the trials after the first failure never happened): `n` drafted tokens of which the
    target kept `m` (acceptance), or `k` tokens asked of which the drafter proposed `n` (continuation).

    Args:
        prior_mean (`float`, *optional*, defaults to 0.6): acceptance before any round.
        prior_strength (`float`, *optional*, defaults to 4.0): pseudo-tokens the prior weighs.
        decay (`float`, *optional*, defaults to 0.95): evidence kept at each observed row-round (about
            the last 20 rounds count).
    """

    def __init__(self, prior_mean: float = 0.6, prior_strength: float = 4.0, decay: float = 0.95):
        if not 0.0 < prior_mean < 1.0:
            raise ValueError(f"`prior_mean` must lie in (0, 1), got {prior_mean}.")
        self.alpha0 = prior_mean * prior_strength
        self.beta0 = (1.0 - prior_mean) * prior_strength
        self.decay = decay
        self.accepted = 0.0
        self.rejected = 0.0

    def observe(self, trials: int, successes: int) -> None:
        """A chain of `trials` whose first `successes` succeeded (no trials: no evidence)."""
        if trials <= 0:
            return
        self.accepted = self.accepted * self.decay + successes
        self.rejected = self.rejected * self.decay + (1.0 if successes < trials else 0.0)

    @property
    def mean(self) -> float:
        return (self.alpha0 + self.accepted) / (self.alpha0 + self.beta0 + self.accepted + self.rejected)


@dataclass(frozen=True)
class ControllerOptions:
    """Bounds of the controller.

    Args:
        max_length (`int`, *optional*, defaults to 20): the longest block (transformers' default
            `num_assistant_tokens`).
        probe_length (`int`, *optional*, defaults to 2): the block drafted after time off.
        off_rounds (`int`, *optional*, defaults to 4): rounds of plain decoding before the first probe.
        max_off_rounds (`int`, *optional*, defaults to 256): the longest time off, after failed probes.
        margin (`float`, *optional*, defaults to 0.02): how much faster than plain decoding drafting must
            be expected to be (drafting on a tie only risks the cost estimates' errors).
        probe_budget (`float`, *optional*, defaults to 0.05): the most a failed probe's extra cost may
            add to the time off before the next one (the time off after it is at least the probe's
            extra seconds / (budget x a plain round)); 0 only doubles. A draft model's probe pays its
            catch-up on every token since it last drafted (and the first one the draft's prefill of
            the prompt): on a CPU that is several plain rounds, which probing every few rounds repeats.
    """

    max_length: int = 20
    probe_length: int = 2
    off_rounds: int = 4
    max_off_rounds: int = 256
    margin: float = 0.02
    probe_budget: float = 0.05

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.probe_length < 1 or self.off_rounds < 1:
            raise ValueError(
                f"max_length, probe_length and off_rounds must be >= 1, got {self.max_length}, "
                f"{self.probe_length}, {self.off_rounds}."
            )
        if self.max_off_rounds < self.off_rounds:
            raise ValueError(f"max_off_rounds ({self.max_off_rounds}) must be >= off_rounds ({self.off_rounds}).")


@dataclass
class SpeculationController:
    """One request's draft-length decisions (see the module docstring).

    Call `next_length()` before each round and `observe(...)` after it.

    Args:
        costs (`SharedCosts`): the target's measured costs (shared, updated by this request too).
        proposer (`str`): whose draft cost applies (`prompt_lookup`, `draft_model`).
        rows (`int`): the request's rows (every block verifies one per row).
        load (`Callable[[], float]`, *optional*): how many other requests wait on this one's forwards now.
        options (`ControllerOptions`, *optional*): bounds.
        acceptance (`AcceptanceEstimate`, *optional*): the request's acceptance of proposed tokens (a fresh
            prior by default).
        continuation (`AcceptanceEstimate`, *optional*): how often the drafter proposes the next token
            asked of it (a fresh prior, 0.8, by default).
    """

    costs: SharedCosts
    proposer: str
    rows: int = 1
    load: Callable[[], float] | None = None
    options: ControllerOptions = field(default_factory=ControllerOptions)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    continuation: AcceptanceEstimate = field(default_factory=lambda: AcceptanceEstimate(prior_mean=0.8))
    probes: int = 0
    off_left: int = 0  # rounds of time off still to go
    off_period: int = 0  # the current time off (doubles after each failed probe)
    probing: bool = False  # the last length handed out was a probe
    drafted_last_round: bool = False

    def rate(
        self,
        k: int,
        verify: tuple[float, float],
        draft: tuple[float, float],
        others: float,
        plain: tuple[float, float] | None = None,
    ) -> float:
        """Expected tokens per second of a round drafting `k` tokens per row (`plain` prices `k = 0`)."""
        if k == 0:
            p0, p1 = plain if plain is not None else verify
            return self.rows / max(p0 + p1 * self.rows, 1e-9)
        v0, v1 = verify
        d0, d1 = draft
        p0, p1 = plain if plain is not None else verify
        c = self.continuation.mean
        drafted = sum(c**i for i in range(1, k + 1))  # N(k): expected drafts per row
        seconds = (
            d0
            + d1 * self.rows * drafted
            + c * v0
            + (1.0 - c) * (p0 + p1 * self.rows)
            + v1 * self.rows * (c + drafted)
            + others * v1 * self.rows * drafted
        )
        return self.rows * expected_tokens(c * self.acceptance.mean, k) / max(seconds, 1e-9)

    def best_length(self) -> int:
        """The `k` in `0..max_length` with the highest expected rate; 0 unless drafting beats plain by the margin."""
        verify, plain = self.costs.verify(), self.costs.plain()
        if verify is None and plain is None:  # nothing measured yet: the prior's shape, on a unit scale
            plain = (1.0, self.costs.verify_slope_prior)
        # A drafting round not measured yet is assumed to cost a plain one's line (it is then measured).
        verify = verify if verify is not None else plain
        plain = plain if plain is not None else verify
        assert verify is not None and plain is not None  # one of them was measured, or the prior set it
        draft = self.costs.draft(self.proposer, plain[0])
        others = max(float(self.load()), 0.0) if self.load is not None else 0.0
        best, best_rate = 0, self.rate(0, verify, draft, others, plain) * (1.0 + self.options.margin)
        for k in range(1, self.options.max_length + 1):
            rate = self.rate(k, verify, draft, others, plain)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def next_length(self) -> int:
        """The draft length of the coming round (0: plain decoding), with the time off and probes."""
        self.probing = False
        if self.off_left > 0:
            self.off_left -= 1
            return 0
        if self.off_period:  # the time off is over: a probe
            self.probing = True
            self.probes += 1
            return min(self.options.probe_length, self.options.max_length)
        k = self.best_length()
        if k == 0:  # this round is the first of the time off
            self.off_period = self.options.off_rounds
            self.off_left = self.off_period - 1
        return k

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
    ) -> None:
        """What a round did.

        Args:
            asked (`int`): the draft length asked of the drafter (0: it was not called).
            wanted (`list[int]`): per row, the draft length it asked for (0 for a finished row).
            drafted (`list[int]`), accepted (`list[int]`): per row, drafts verified and kept.
            draft_s (`float`): wall time of `propose`.
            verify_s (`float`): wall time of the verify forward and its acceptance.
            verify_tokens (`int`): tokens the verify forward ran for this request.
        """
        for k, n, m in zip(wanted, drafted, accepted, strict=True):
            self.continuation.observe(k if asked else 0, n)
            self.acceptance.observe(n, min(m, n))
        self.costs.observe_verify(verify_tokens, verify_s, drafted=any(drafted))
        if asked and self.drafted_last_round and not self.probing:
            self.costs.observe_draft(self.proposer, sum(drafted), draft_s)
        self.drafted_last_round = asked > 0
        if self.probing:
            if self.best_length() > 0:
                self.off_period = 0  # drafting pays again
            else:
                self.off_period = min(
                    max(self.off_period * 2, self._budgeted_off_rounds(draft_s + verify_s)),
                    self.options.max_off_rounds,
                )
                self.off_left = self.off_period

    def _budgeted_off_rounds(self, probe_seconds: float) -> int:
        """Plain rounds after which a probe's extra cost is at most `probe_budget` of the time off."""
        plain = self.costs.plain()
        if not self.options.probe_budget or plain is None:
            return 0
        plain_round = plain[0] + plain[1] * self.rows
        extra = max(probe_seconds - plain_round, 0.0)
        return int(math.ceil(extra / (self.options.probe_budget * max(plain_round, 1e-9))))
