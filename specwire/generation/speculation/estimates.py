"""The estimates the adaptive speculation controller (`speculation.controller`) decides from.

- `LinearCost`: seconds as a line in a size, least squares over forgotten observations, its slope pulled
  towards a prior;
- `SizedCost`: seconds by size, each size's own mean shrunk towards a `LinearCost` line (a verify forward's
  cost is not a line in its tokens);
- `AcceptanceEstimate`: a per-token probability (acceptance, continuation) as a forgetting Beta posterior;
- `RunLengths`: per block position, the chance that a draft is kept when the ones before it were.

Pure Python, no locks: `SharedCosts` guards the ones it shares.
"""

from __future__ import annotations

import math

__all__ = ["AcceptanceEstimate", "LinearCost", "RunLengths", "SizedCost"]


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


class SizedCost:
    """Seconds by size: each size's own mean (forgotten geometrically), shrunk towards a line through all sizes.

    A verify forward's cost is not a line in its tokens: on a CPU the matrix products switch kernels with
    the row count (SmolLM2-135M, one thread, after a 406-token prompt: 40 ms for 1 token, 60 for 2, 75
    for 3, 61 for 4, 72 for 6), so a block of 3 drafts costs less than one of 2. A size measured a few
    times is priced by its own mean; a size never measured by the line (`LinearCost`).

    Args:
        shrink (`float`, *optional*, defaults to 2.0): how many observations the line weighs against a
            size's own mean.
        decay (`float`, *optional*, defaults to 0.9): weight a size's past observations keep at each new
            one of that size.
    """

    def __init__(self, shrink: float = 2.0, decay: float = 0.9):
        self.shrink = shrink
        self.decay = decay
        self.line = LinearCost()
        self._sizes: dict[int, tuple[float, float]] = {}  # size -> (weight, weighted sum of seconds)

    def observe(self, size: int, seconds: float) -> None:
        self.line.observe(size, seconds)
        weight, total = self._sizes.get(size, (0.0, 0.0))
        self._sizes[size] = (weight * self.decay + 1.0, total * self.decay + seconds)

    def at(self, size: float, line: tuple[float, float]) -> float:
        """Seconds at `size` (a fractional size interpolates its two neighbours), given the fitted `line`."""
        low = int(math.floor(size))
        if size == low:
            return self._at(low, line)
        share = size - low
        return (1.0 - share) * self._at(low, line) + share * self._at(low + 1, line)

    def _at(self, size: int, line: tuple[float, float]) -> float:
        weight, total = self._sizes.get(size, (0.0, 0.0))
        return (total + self.shrink * (line[0] + line[1] * size)) / (weight + self.shrink)


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

    def observe_counts(self, successes: int, failures: int, per_token_decay: float | None = None) -> None:
        """Tokens checked one by one (hindsight): `successes` and `failures`, the evidence before them forgotten
        as `failures` chains would forget it, or (`per_token_decay`) by that factor per token (what the request's
        draft does now, rather than its whole history: its acceptance changes along an answer)."""
        if successes + failures <= 0:
            return
        if per_token_decay is None:
            forget = self.decay ** max(failures, 1)
        else:
            forget = per_token_decay ** (successes + failures)
        self.accepted = self.accepted * forget + successes
        self.rejected = self.rejected * forget + failures

    @property
    def mean(self) -> float:
        return (self.alpha0 + self.accepted) / (self.alpha0 + self.beta0 + self.accepted + self.rejected)


class RunLengths:
    """How far into a block the target keeps agreeing: per position `j`, the chance that draft `j` is accepted
    when drafts `1..j-1` were, from one request's blocks (forgotten geometrically), each position shrunk
    towards the request's overall acceptance (`chained`: towards the position before it).

    One acceptance for every position (a geometric run) fits a draft model, whose tokens are about equally
    likely to be kept wherever they are. A copy from the prompt (prompt lookup) is not like that: its first
    token is often wrong (the match was a coincidence) and, when it is right, the copy tends to go on to
    the end (the text is being repeated): a long block is worth much more than a geometric run with the
    same overall acceptance says, which made the controller pick short lookup blocks where 10 paid more.

    Args:
        positions (`int`): the longest block.
        shrink (`float`, *optional*, defaults to 3.0): observations the overall acceptance weighs at each position.
        decay (`float`, *optional*, defaults to 0.95): evidence kept at each observed block.
        chained (`bool`, *optional*, defaults to `False`): shrink each position towards the one before it
            instead of the overall acceptance (copies: what kept going keeps going). Not for a draft model:
            on the code edit it drafted blocks of 20 at 0.89x of plain decoding.
    """

    def __init__(self, positions: int, shrink: float = 3.0, decay: float = 0.95, chained: bool = False):
        self.chained = chained
        self.shrink = shrink
        self.decay = decay
        self.tried = [0.0] * positions  # per position: blocks that reached it (draft j verified, 1..j-1 kept)
        self.kept = [0.0] * positions  # of those, the blocks whose draft j was kept

    def observe(self, drafted: int, accepted: int) -> None:
        """A block of `drafted` tokens of which the first `accepted` were kept (no drafts: no evidence)."""
        if drafted <= 0:
            return
        self.tried = [t * self.decay for t in self.tried]
        self.kept = [k * self.decay for k in self.kept]
        for j in range(min(accepted + 1, drafted, len(self.tried))):
            self.tried[j] += 1.0
            self.kept[j] += 1.0 if j < accepted else 0.0

    def forget(self, factor: float) -> None:
        """Keep `factor` of the evidence (what the blocks said has aged: the time off went by)."""
        self.tried = [t * factor for t in self.tried]
        self.kept = [k * factor for k in self.kept]

    def survival(self, overall: float, k: int, first: float | None = None) -> list[float]:
        """`[S(1), .., S(k)]`, `S(j)` the chance that drafts `1..j` are all kept, given `overall` acceptance (and
        `first`, that of the first draft, when it differs: a draft model always proposes its first token)."""
        out, alive, hazard = [], 1.0, overall
        for j in range(k):
            tried, kept = (self.tried[j], self.kept[j]) if j < len(self.tried) else (0.0, 0.0)
            # Chained: shrunk towards the position before (the first towards `overall`): where the request's
            # blocks never reached, a copy that kept going is assumed to keep going, so longer blocks get tried.
            target = first if j == 0 and first is not None else (hazard if self.chained else overall)
            hazard = (kept + self.shrink * target) / (tried + self.shrink)
            alive *= hazard
            out.append(alive)
        return out
