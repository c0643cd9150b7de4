"""Per-request draft-length state: how many tokens to draft next round, and when a draft stops early.

Mirrors transformers 5.23 `AssistedCandidateGenerator` (`candidate_generator.py`):

- `num_assistant_tokens` (default 20) with `num_assistant_tokens_schedule` (default `"constant"`):
  `"heuristic"` and `"heuristic_transient"` add 2 after a round in which every drafted token was
  accepted and otherwise set `max(1, num_assistant_tokens - 1)`.
- Each round drafts at most `min(num_assistant_tokens, max_length - cur_len - 1)` tokens, leaving
  room for the target's bonus token; and at least `max(min(that, min_length - cur_len), 0)`.
- `assistant_confidence_threshold` (default 0.4) stops a draft block as soon as the draft's own
  probability of the token it just drafted is below the threshold (`ConfidenceCriteria`).

Deviation, on purpose: transformers writes a `"heuristic"` schedule's final value back to the
shared assistant model's `generation_config` after each `generate()` call, so it carries over to
later calls, and to every other user of that assistant. In a server that would make one request's
draft length depend on whichever requests ran before it. specwire keeps all of this state in one
`DraftSchedule` per request, created when the request starts and dropped when it ends, so
`"heuristic"` and `"heuristic_transient"` behave the same: both adapt within one request and start
from the configured value in the next.

Not implemented: transformers also re-tunes the confidence threshold online from an ROC curve,
but only when scikit-learn is installed; the pinned reference environment has no scikit-learn, so
the threshold stays fixed, as it does there.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "DEFAULT_ASSISTANT_CONFIDENCE_THRESHOLD",
    "DEFAULT_NUM_ASSISTANT_TOKENS",
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "ConfidenceStop",
    "DraftSchedule",
]

SCHEDULES = ("constant", "heuristic", "heuristic_transient")
# transformers 5.23 global defaults (`GenerationConfig._get_default_generation_params`).
DEFAULT_NUM_ASSISTANT_TOKENS = 20
DEFAULT_SCHEDULE = "constant"
DEFAULT_ASSISTANT_CONFIDENCE_THRESHOLD = 0.4


class DraftSchedule:
    """How many tokens one request drafts per round, adapted after each verification.

    Args:
        num_assistant_tokens (`int`, *optional*, defaults to 20):
            Draft length of the first round. `0` never drafts under `"constant"`.
        schedule (`str`, *optional*, defaults to `"constant"`):
            One of `"constant"` (never changes), `"heuristic"` or `"heuristic_transient"` (+2 after
            a fully accepted round, else `max(1, value - 1)`; both per request, see the module doc).
    """

    def __init__(self, num_assistant_tokens: int = DEFAULT_NUM_ASSISTANT_TOKENS, schedule: str = DEFAULT_SCHEDULE):
        if isinstance(num_assistant_tokens, bool) or not isinstance(num_assistant_tokens, int):
            raise ValueError(
                f"`num_assistant_tokens` has to be an integer, got {num_assistant_tokens!r}; "
                "for example `num_assistant_tokens=20`."
            )
        if num_assistant_tokens < 0:
            raise ValueError(
                f"`num_assistant_tokens` has to be a non-negative integer, but is {num_assistant_tokens}; "
                "use 0 to never draft or a positive draft length such as 20."
            )
        if schedule not in SCHEDULES:
            raise ValueError(
                f"`num_assistant_tokens_schedule` has to be one of {', '.join(repr(s) for s in SCHEDULES)}, "
                f"but is {schedule!r}."
            )
        self.initial = num_assistant_tokens
        self.schedule = schedule
        self.num_assistant_tokens = num_assistant_tokens

    @classmethod
    def from_config(cls, config: Any) -> DraftSchedule:
        """Build a request's schedule from a generation config (any object with the transformers fields).

        Args:
            config: a `GenerationConfig` (specwire's or transformers'); unset (`None`) or missing
                `num_assistant_tokens` / `num_assistant_tokens_schedule` take transformers' defaults.
        """
        num = getattr(config, "num_assistant_tokens", None)
        schedule = getattr(config, "num_assistant_tokens_schedule", None)
        return cls(
            DEFAULT_NUM_ASSISTANT_TOKENS if num is None else num,
            DEFAULT_SCHEDULE if schedule is None else schedule,
        )

    def draft_bounds(self, cur_len: int, max_length: int, min_length: int | None = None) -> tuple[int, int]:
        """`(min_new_tokens, max_new_tokens)` for the next draft, as `AssistedCandidateGenerator` has them.

        Args:
            cur_len (`int`): the request's current length (prompt + generated tokens).
            max_length (`int`): the target's `max_length`; one slot stays free for the bonus token.
            min_length (`int`, *optional*): the target's `min_length` (unset = 0).

        Returns:
            `tuple(int, int)`: the draft must produce at least / at most this many tokens; a maximum
            of 0 means "do not draft this round" (plain decoding step).
        """
        max_new = max(0, min(self.num_assistant_tokens, max_length - cur_len - 1))
        min_new = max(min(max_new, (min_length or 0) - cur_len), 0)
        return min_new, max_new

    def num_draft_tokens(self, cur_len: int, max_length: int) -> int:
        """Next round's draft length: `min(num_assistant_tokens, max_length - cur_len - 1)`, at least 0."""
        return self.draft_bounds(cur_len, max_length)[1]

    def update(self, num_accepted: int, num_drafted: int) -> None:
        """Adapt the draft length after a verification round.

        Args:
            num_accepted (`int`): draft tokens the target accepted (after cropping at stops).
            num_drafted (`int`): draft tokens actually proposed this round (the draft may stop
                early), transformers' `len(scores[0]) - 1`. A round with no draft at all counts as
                fully accepted (0 == 0), exactly as in transformers.
        """
        if num_accepted < 0 or num_accepted > num_drafted:
            raise ValueError(f"`num_accepted` must lie in [0, num_drafted={num_drafted}], got {num_accepted}.")
        if self.schedule == "constant":
            return
        if num_accepted == num_drafted:
            self.num_assistant_tokens += 2
        else:
            self.num_assistant_tokens = max(1, self.num_assistant_tokens - 1)

    def reset(self) -> None:
        """Return to the configured draft length (start of a new request)."""
        self.num_assistant_tokens = self.initial

    def __repr__(self) -> str:
        return (
            f"DraftSchedule(num_assistant_tokens={self.num_assistant_tokens}, schedule={self.schedule!r}, "
            f"initial={self.initial})"
        )


class ConfidenceStop:
    """transformers' `ConfidenceCriteria`: stop drafting once the draft doubts its own last token.

    After the draft appends token `x` with processed scores `s`, drafting stops (with `x` kept) if
    `softmax(s)[x] < threshold`. A threshold of `None` or `<= 0` disables the rule, as in
    transformers (which only adds the criterion for `threshold > 0`).

    Args:
        threshold (`float`, or a sequence of `float | None` per row, *optional*, defaults to 0.4):
            The draft config's `assistant_confidence_threshold`; per row when a draft batch mixes
            requests.
    """

    def __init__(
        self,
        threshold: float
        | list[float | None]
        | tuple[float | None, ...]
        | None = DEFAULT_ASSISTANT_CONFIDENCE_THRESHOLD,
    ):
        values = threshold if isinstance(threshold, (list, tuple)) else [threshold]
        for value in values:
            # Any real number is accepted, as transformers does: <= 0 disables, >= 1 stops after every token.
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(
                    f"`assistant_confidence_threshold` has to be a float (0.4 by default, 0 to disable) "
                    f"or None, got {value!r}."
                )
        self.threshold = threshold

    @classmethod
    def from_config(cls, config: Any) -> ConfidenceStop:
        """Build from a generation config; an unset threshold takes transformers' default 0.4."""
        threshold = getattr(config, "assistant_confidence_threshold", None)
        return cls(DEFAULT_ASSISTANT_CONFIDENCE_THRESHOLD if threshold is None else threshold)

    @property
    def enabled(self) -> bool:
        """Whether the rule can fire for any row."""
        values = self.threshold if isinstance(self.threshold, (list, tuple)) else [self.threshold]
        return any(value is not None and value > 0 for value in values)

    def __call__(self, tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Whether each row's draft stops after the token it just drafted.

        Args:
            tokens (`torch.LongTensor` of shape `(rows,)`): the token each row just drafted.
            scores (`torch.FloatTensor` of shape `(rows, vocab)`): the draft's processed scores
                for that step (what it sampled or took the argmax from).

        Returns:
            `torch.BoolTensor` of shape `(rows,)`: True where the draft should stop.
        """
        rows = tokens.shape[0]
        if isinstance(self.threshold, (list, tuple)):
            if len(self.threshold) != rows:
                raise ValueError(f"Got {len(self.threshold)} thresholds for {rows} rows.")
            values = [0.0 if value is None else float(value) for value in self.threshold]
        else:
            values = [0.0 if self.threshold is None else float(self.threshold)] * rows
        probs = scores.softmax(dim=-1).gather(-1, tokens.view(rows, 1)).squeeze(-1)  # [rows]
        # Compare in float64: transformers compares the Python float of the probability with the
        # Python float threshold, and a float32 threshold could round across the probability.
        thresholds = torch.tensor(values, dtype=torch.float64, device=probs.device)  # [rows]
        # A disabled row (threshold None or <= 0) never fires: no probability is below it.
        return probs.double() < thresholds
