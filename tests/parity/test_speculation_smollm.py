"""Speculation on the embedded SmolLM2 through the real services: prompt lookup on a code-editing
prompt and the `default-int8` draft model both give exactly plain greedy's tokens, with
acceptance statistics that add up."""

from __future__ import annotations

import pytest
import torch

from specwire.client import TargetClient
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy, check_draft_model
from tests.servers import threaded_server

CODE = '''def moving_average(values, window):
    """Return the moving averages of `values` over `window` items."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages


def summarize(values, window=3):
    averages = moving_average(values, window)
    return {
        "count": len(values),
        "window": window,
        "first": averages[0] if averages else None,
        "last": averages[-1] if averages else None,
    }
'''
PROMPT = (
    "Rename the function `moving_average` to `rolling_mean` everywhere in this code and return the whole file:"
    f"\n\n```python\n{CODE}```"
)


def _check_stats(stats, proposer):
    assert stats.proposer == proposer and stats.fallback_reason == ""
    assert stats.rounds > 0 and 0 < stats.accepted_tokens <= stats.drafted_tokens
    assert sum(stats.accepted_by_position) == stats.accepted_tokens
    assert all(a >= b for a, b in zip(stats.accepted_by_position, stats.accepted_by_position[1:], strict=False))
    assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.drafted_tokens)


@pytest.mark.smollm
def test_prompt_lookup_on_code_editing_equals_plain_greedy(smollm):
    with threaded_server(lambda: build_target_server(smollm)) as server:
        with TargetClient(server.address) as client:
            kwargs = dict(text=PROMPT, apply_chat_template=True, max_new_tokens=96)
            plain = client.generate(**kwargs)
            spec = client.generate(prompt_lookup_num_tokens=10, **kwargs)
    assert torch.equal(spec.sequences, plain.sequences)
    assert spec.text == plain.text
    _check_stats(spec.speculation, "prompt_lookup")
    # The answer copies the snippet, so most drafted tokens are accepted.
    assert spec.speculation.acceptance_rate > 0.3
    # transformers' own prompt lookup gives the same tokens too.
    rendered = smollm.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = smollm.tokenizer(rendered, add_special_tokens=False, return_tensors="pt").input_ids
    want = smollm.model.generate(ids, max_new_tokens=96, do_sample=False, prompt_lookup_num_tokens=10)
    assert torch.equal(spec.sequences, want)


@pytest.mark.smollm
def test_int8_draft_model_equals_plain_greedy(smollm, smollm_int8):
    with threaded_server(lambda: build_draft_server(smollm_int8)) as draft:
        policy = DraftPolicy(draft.address, round_timeout_s=60.0)
        with threaded_server(lambda: build_target_server(smollm, drafting=policy)) as server:
            with TargetClient(server.address) as client:
                kwargs = dict(
                    text=["What is the capital of France?", "Name three primary colors."],
                    apply_chat_template=True,
                    max_new_tokens=32,
                )
                plain = client.generate(**kwargs)
                spec = client.generate(proposer="draft_model", num_assistant_tokens=5, **kwargs)
    assert torch.equal(spec.sequences, plain.sequences)
    _check_stats(spec.speculation, "draft_model")


@pytest.mark.smollm
def test_colocated_int8_draft_model_equals_plain_greedy(smollm, smollm_int8):
    """`target-service --draft-model default-int8`: the same draft in the target's process, no draft service."""
    check_draft_model(smollm, smollm_int8)  # same tokenizer: accepted at start
    policy = DraftPolicy(draft_model=smollm_int8)
    with threaded_server(lambda: build_target_server(smollm, drafting=policy)) as server:
        with TargetClient(server.address) as client:
            kwargs = dict(
                text=["What is the capital of France?", "Name three primary colors."],
                apply_chat_template=True,
                max_new_tokens=32,
            )
            plain = client.generate(**kwargs)
            spec = client.generate(proposer="draft_model", num_assistant_tokens=5, **kwargs)
    assert torch.equal(spec.sequences, plain.sequences)
    _check_stats(spec.speculation, "draft_model")
    assert spec.speculation.draft_seconds > 0
    assert policy.open_streams == 0
