"""The soak's request kinds: what each sends, how often, and which statuses it may get (one table).

Every request ends one of three ways:
- `finished`: the RPC returned OK (a unary result, or a stream's final message);
- `expected_status`: it got a status from `EXPECTED[kind]`, its kind's documented set (bad input
  gets INVALID_ARGUMENT, an unknown reference NOT_FOUND, over-limit requests INVALID_ARGUMENT or
  RESOURCE_EXHAUSTED, an expired deadline DEADLINE_EXCEEDED, a stream the client itself cancels
  CANCELLED);
- `unexpected`: anything else, INTERNAL always included. These are the soak's failures.

Two statuses are documented for every kind, so they count as `expected_status` anywhere:
RESOURCE_EXHAUSTED (over capacity, with a retry hint: load shedding, counted so a run that sheds
much shows it) and, for kinds that name a registry config, UNAVAILABLE while the config service is
down (the request overlapped a restart window, see `bench.soak.faults`). A draft service that is
down is not an excuse: the target falls back to plain decoding, so draft-model requests must finish.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.prompts import CHAT_PROMPT, CODE_EDIT_PROMPT

OK = "OK"
# The client breaking out of a stream is its own cancellation, not a server status.
CLIENT_CANCELLED = "CANCELLED"
SHED = "RESOURCE_EXHAUSTED"
CONFIG_DOWN = "UNAVAILABLE"
OVER_LIMIT = frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"})

# kind -> the statuses it may end with. OK means the request is meant to finish.
EXPECTED: dict[str, frozenset[str]] = {
    "greedy": frozenset({OK}),
    "greedy_stream": frozenset({OK}),
    "sampling_seeded": frozenset({OK}),
    "sampling_stream": frozenset({OK}),
    "beam_search": frozenset({OK}),
    "prompt_lookup": frozenset({OK}),
    "prompt_lookup_stream": frozenset({OK}),
    "draft_model": frozenset({OK}),
    "draft_model_stream": frozenset({OK}),
    "config_ref": frozenset({OK}),
    # Cancelled by the client after two deltas; OK if the stream ended before that.
    "stream_cancelled": frozenset({CLIENT_CANCELLED, OK}),
    # A deadline far shorter than the work; OK if the machine happened to be fast enough.
    "deadline_expired": frozenset({"DEADLINE_EXCEEDED", OK}),
    "bad_token_id": frozenset({"INVALID_ARGUMENT"}),
    "bad_config_value": frozenset({"INVALID_ARGUMENT"}),
    "unknown_config_ref": frozenset({"NOT_FOUND"}),
    "over_limit_prompt": OVER_LIMIT,
    "over_limit_new_tokens": OVER_LIMIT,
    "over_limit_rows": OVER_LIMIT,
    "over_limit_output": OVER_LIMIT,
}
# Kinds whose requests name a registry config (UNAVAILABLE is theirs while the registry restarts).
USES_REGISTRY = frozenset({"config_ref", "unknown_config_ref"})

# Relative frequency of each kind in the mix: mostly real work, a steady trickle of hostile input.
WEIGHTS: dict[str, float] = {
    "greedy": 8,
    "greedy_stream": 5,
    "sampling_seeded": 6,
    "sampling_stream": 3,
    "beam_search": 4,
    "prompt_lookup": 5,
    "prompt_lookup_stream": 3,
    "draft_model": 5,
    "draft_model_stream": 3,
    "config_ref": 5,
    "stream_cancelled": 6,
    "deadline_expired": 3,
    "bad_token_id": 2,
    "bad_config_value": 3,
    "unknown_config_ref": 2,
    "over_limit_prompt": 1,
    "over_limit_new_tokens": 1,
    "over_limit_rows": 1,
    "over_limit_output": 1,
}
assert set(WEIGHTS) == set(EXPECTED)

# Registry configs created at start; config_ref requests name them by tag, version and latest.
REGISTRY_CONFIGS = {
    "soak-greedy": {"do_sample": False, "max_new_tokens": 16},
    "soak-sample": {"do_sample": True, "top_k": 40, "temperature": 0.8, "max_new_tokens": 16},
}
REGISTRY_REFS = ["soak-greedy:prod", "soak-sample:prod", "soak-greedy@1", "soak-sample"]
PROMPTS = [
    CHAT_PROMPT,
    CODE_EDIT_PROMPT,
    "Write a short poem about the sea.",
    "List three prime numbers and explain why they are prime.",
]
# Prompt lookup's input-grounded prompt where the model has room for it, else a short one that repeats.
SHORT_CODE_PROMPT = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n"


def classify(kind: str, code: str, overlapped_config_down: bool) -> str:
    """`finished`, `expected_status` or `unexpected` for a request of `kind` that ended with `code`."""
    if code == OK and OK in EXPECTED[kind]:
        return "finished"
    if code in EXPECTED[kind] or code == SHED:
        return "expected_status"
    if code == CONFIG_DOWN and kind in USES_REGISTRY and overlapped_config_down:
        return "expected_status"
    return "unexpected"


@dataclass
class ModelFacts:
    """What the request builders need to know about the served model (from GetModelInfo)."""

    vocab_size: int
    max_position_embeddings: int
    # The target's `--max-output-bytes` from GetModelInfo's limits; 0 where it reports none.
    max_output_bytes: int = 0


def fitting_prompts(facts: ModelFacts) -> list[str]:
    """The prompts that leave room for generation in the model's context: at most a quarter of it in
    characters (a token is rarely shorter than a character), so normal requests never meet
    --max-model-len, also on tiny test models with a 256-position context."""
    return [p for p in PROMPTS if len(p) <= facts.max_position_embeddings // 4] or [PROMPTS[2]]


@dataclass
class Caller:
    """One client thread's state: its client, random generator and the timeouts to use."""

    client: Any  # client.TargetClient
    rng: random.Random
    facts: ModelFacts
    max_new_tokens: int
    timeout: float
    hostile_timeout: float
    note: dict = field(default_factory=dict)  # filled by a request function: what to record besides the code

    def prompt(self) -> str:
        return self.rng.choice(fitting_prompts(self.facts))

    def code_prompt(self) -> str:
        return CODE_EDIT_PROMPT if CODE_EDIT_PROMPT in fitting_prompts(self.facts) else SHORT_CODE_PROMPT

    def call(self, timeout: float | None = None, **kwargs):
        """A unary Generate with the given deadline (raises `SpecwireRpcError` on a status)."""
        self.client.timeout = self.timeout if timeout is None else timeout
        return self.client.generate(**kwargs)

    def stream(self, cancel_after: int | None = None, timeout: float | None = None, **kwargs) -> str:
        """A GenerateStream read to its end (or cancelled by us after `cancel_after` deltas)."""
        self.client.timeout = self.timeout if timeout is None else timeout
        deltas = 0
        final = None
        stream = self.client.stream(**kwargs)
        try:
            for item in stream:
                if hasattr(item, "row"):
                    deltas += 1
                    if cancel_after is not None and deltas >= cancel_after:
                        return CLIENT_CANCELLED
                else:
                    final = item
        finally:
            stream.close()  # cancels the RPC on the server when we leave early
        self.note["deltas"] = deltas
        if final is None:
            raise RuntimeError(f"stream ended after {deltas} deltas without a final message")
        self._note_output(final)
        return OK

    def _note_output(self, output) -> None:
        self.note["fallback"] = bool(output.speculation.fallback_reason)

    def finished(self, output) -> str:
        self._note_output(output)
        return OK


def _greedy(c: Caller) -> str:
    return c.finished(c.call(text=c.prompt(), do_sample=False, max_new_tokens=c.max_new_tokens))


def _greedy_stream(c: Caller) -> str:
    return c.stream(text=c.prompt(), do_sample=False, max_new_tokens=c.max_new_tokens)


def _sampling_kwargs(c: Caller) -> dict:
    return {
        "do_sample": True,
        "seed": c.rng.randrange(2**31),
        "temperature": c.rng.choice([0.7, 0.9, 1.0]),
        "top_k": 50,
        "top_p": 0.95,
        "num_return_sequences": c.rng.choice([1, 1, 2]),
        "max_new_tokens": c.max_new_tokens,
    }


def _sampling_seeded(c: Caller) -> str:
    return c.finished(c.call(text=c.prompt(), **_sampling_kwargs(c)))


def _sampling_stream(c: Caller) -> str:
    return c.stream(text=c.prompt(), **_sampling_kwargs(c))


def _beam_search(c: Caller) -> str:
    beams = c.rng.randint(2, 4)
    return c.finished(
        c.call(
            text=c.prompt(),
            do_sample=False,
            num_beams=beams,
            num_return_sequences=c.rng.randint(1, beams),
            max_new_tokens=max(4, c.max_new_tokens // 2),
        )
    )


def _prompt_lookup(c: Caller) -> str:
    return c.finished(
        c.call(text=c.code_prompt(), do_sample=False, max_new_tokens=c.max_new_tokens, proposer="prompt_lookup")
    )


def _prompt_lookup_stream(c: Caller) -> str:
    return c.stream(text=c.code_prompt(), do_sample=False, max_new_tokens=c.max_new_tokens, proposer="prompt_lookup")


def _draft_kwargs(c: Caller) -> dict:
    sampled = c.rng.random() < 0.3
    extra = {"do_sample": True, "seed": c.rng.randrange(2**31)} if sampled else {"do_sample": False}
    return {"max_new_tokens": c.max_new_tokens, "proposer": "draft_model", **extra}


def _draft_model(c: Caller) -> str:
    return c.finished(c.call(text=c.prompt(), **_draft_kwargs(c)))


def _draft_model_stream(c: Caller) -> str:
    return c.stream(text=c.prompt(), **_draft_kwargs(c))


def _config_ref(c: Caller) -> str:
    ref = c.rng.choice(REGISTRY_REFS)
    c.note["ref"] = ref
    return c.finished(c.call(text=c.prompt(), generation_config=ref))


def _stream_cancelled(c: Caller) -> str:
    # Every proposer: the leak the issue found was in draft-model streams closed early.
    proposer = c.rng.choice(["none", "prompt_lookup", "draft_model"])
    c.note["proposer"] = proposer
    # min_new_tokens: an early EOS must not end the stream before the client cancels it.
    length = 4 * c.max_new_tokens
    return c.stream(
        cancel_after=2,
        text=c.prompt(),
        do_sample=False,
        max_new_tokens=length,
        min_new_tokens=length,
        proposer=proposer,
    )


def _deadline_expired(c: Caller) -> str:
    proposer = c.rng.choice(["none", "draft_model"])
    c.note["proposer"] = proposer
    length = 8 * c.max_new_tokens
    kwargs = {
        "text": c.prompt(),
        "do_sample": False,
        "max_new_tokens": length,
        "min_new_tokens": length,
        "proposer": proposer,
    }
    if c.rng.random() < 0.5:
        return c.stream(timeout=c.rng.uniform(0.05, 0.5), **kwargs)
    return c.finished(c.call(timeout=c.rng.uniform(0.05, 0.5), **kwargs))


def _bad_token_id(c: Caller) -> str:
    bad = c.rng.choice([c.facts.vocab_size + 7, -3, 2**31 - 1])
    c.note["token_id"] = bad
    return c.finished(c.call(timeout=c.hostile_timeout, input_ids=[[5, 6, bad, 7]], max_new_tokens=4))


def _bad_config_values(facts: ModelFacts) -> list[dict]:
    return [
        {"do_sample": True, "temperature": -1.0},
        {"do_sample": True, "top_p": -0.5},
        {"num_beams": 2, "num_return_sequences": 3},
        {"repetition_penalty": -2.0},
        {"max_new_tokens": -5},
        {"bad_words_ids": [[facts.vocab_size + 10]]},
        {"stop_strings": [f"stop{i}" for i in range(1000)]},
    ]


def _bad_config_value(c: Caller) -> str:
    values = c.rng.choice(_bad_config_values(c.facts))
    c.note["config"] = sorted(values)
    return c.finished(c.call(timeout=c.hostile_timeout, text=c.prompt(), **{"max_new_tokens": 4, **values}))


def _unknown_config_ref(c: Caller) -> str:
    ref = c.rng.choice(["soak-missing", "soak-greedy:no-such-tag", "soak-greedy@999"])
    c.note["ref"] = ref
    return c.finished(c.call(timeout=c.hostile_timeout, text=c.prompt(), generation_config=ref))


def _over_limit_prompt(c: Caller) -> str:
    # Longer than the model's positions, one new token: --max-model-len must refuse it before any work.
    length = c.facts.max_position_embeddings + 16
    return c.finished(c.call(timeout=c.hostile_timeout, input_ids=[[11] * length], max_new_tokens=1))


def _over_limit_new_tokens(c: Caller) -> str:
    value = c.rng.choice([2**31 - 1, 10 * c.facts.max_position_embeddings])
    c.note["max_new_tokens"] = value
    return c.finished(c.call(timeout=c.hostile_timeout, text=c.prompt(), do_sample=False, max_new_tokens=value))


def _over_limit_rows(c: Caller) -> str:
    values = c.rng.choice(
        [
            {"num_beams": 2000, "do_sample": False},
            {"num_return_sequences": 5000, "do_sample": True},
            {"num_beams": 64, "num_return_sequences": 64, "do_sample": False},
        ]
    )
    c.note["config"] = sorted(values)
    return c.finished(c.call(timeout=c.hostile_timeout, text=c.prompt(), max_new_tokens=2, **values))


def over_limit_output_kwargs(facts: ModelFacts) -> dict | None:
    """Scores and logits of 16 rows at twice the target's output budget, within the model's length.

    None when the target reports no budget (without one the request would really be computed, gigabytes
    on a real model) or when the model is too small to exceed it within its length (tiny test models).
    """
    rows = 16
    if not facts.max_output_bytes:
        return None
    steps = -(-2 * facts.max_output_bytes // (rows * facts.vocab_size * 4 * 2))
    if steps + 64 > facts.max_position_embeddings:
        return None
    return {
        "do_sample": True,
        "num_return_sequences": rows,
        "max_new_tokens": int(steps),
        "min_new_tokens": int(steps),
        "output_scores": True,
        "output_logits": True,
        "return_dict_in_generate": True,
    }


def _over_limit_output(c: Caller) -> str:
    kwargs = over_limit_output_kwargs(c.facts)
    assert kwargs is not None, "over_limit_output is left out of the mix for this model"
    return c.finished(c.call(timeout=c.hostile_timeout, text="Hi", **kwargs))


RUNNERS: dict[str, Callable[[Caller], str]] = {
    "greedy": _greedy,
    "greedy_stream": _greedy_stream,
    "sampling_seeded": _sampling_seeded,
    "sampling_stream": _sampling_stream,
    "beam_search": _beam_search,
    "prompt_lookup": _prompt_lookup,
    "prompt_lookup_stream": _prompt_lookup_stream,
    "draft_model": _draft_model,
    "draft_model_stream": _draft_model_stream,
    "config_ref": _config_ref,
    "stream_cancelled": _stream_cancelled,
    "deadline_expired": _deadline_expired,
    "bad_token_id": _bad_token_id,
    "bad_config_value": _bad_config_value,
    "unknown_config_ref": _unknown_config_ref,
    "over_limit_prompt": _over_limit_prompt,
    "over_limit_new_tokens": _over_limit_new_tokens,
    "over_limit_rows": _over_limit_rows,
    "over_limit_output": _over_limit_output,
}
assert set(RUNNERS) == set(EXPECTED)


def mix(facts: ModelFacts, skip: set[str]) -> tuple[dict[str, float], dict[str, str]]:
    """The kinds to run with their weights, and the kinds left out with why."""
    left_out = {kind: "--skip" for kind in skip}
    if "over_limit_output" not in skip and over_limit_output_kwargs(facts) is None:
        left_out["over_limit_output"] = (
            "the target reports no max_output_bytes limit"
            if not facts.max_output_bytes
            else f"the model is too small (vocab {facts.vocab_size}, {facts.max_position_embeddings} positions) "
            f"for scores over the {facts.max_output_bytes}-byte budget within its length"
        )
    return {kind: weight for kind, weight in WEIGHTS.items() if kind not in left_out}, left_out
