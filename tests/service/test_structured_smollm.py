"""Structured output on the embedded SmolLM2 through real target servers: JSON that validates against
its schema (a pydantic model), a regex, a choice and a grammar, run concurrently on the batched
scheduler with different specs and equal to the sequential server's answers; beam search keeps every
returned beam in the grammar; prompt lookup on a schema-copying prompt gives plain constrained
decoding's tokens."""

from __future__ import annotations

import json
import re
import threading

import pydantic
import pytest
import torch

from specwire.client import TargetClient
from specwire.target_service.__main__ import build_server
from tests.servers import threaded_server

pytestmark = pytest.mark.smollm


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=120)
    city: str = pydantic.Field(max_length=30)


DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CITIES = ["Paris", "London", "Berlin", "Madrid"]
# A Lark grammar (llguidance's dialect) and the regex that says the same thing, to check the outputs.
SUM_GRAMMAR = 'start: NUMBER "+" NUMBER "=" NUMBER\nNUMBER: /[0-9]{1,3}/\n'
SUM = r"[0-9]{1,3}\+[0-9]{1,3}=[0-9]{1,3}"
CASES = [
    ("Describe a fictional person as JSON with a name, an age and a city.", {"json_schema": Person}),
    ("On which date did the Apollo 11 crew land on the Moon? Answer with the date.", {"regex": DATE}),
    ("What is the capital of France?", {"choice": CITIES}),
    ("Write an addition of two small numbers and its result, like 2+2=4.", {"grammar": SUM_GRAMMAR}),
]


def check(spec, text):
    kind, value = next(iter(spec.items()))
    if kind == "json_schema":
        Person.model_validate_json(text)
    elif kind == "regex":
        assert re.fullmatch(value, text), text
    elif kind == "grammar":
        assert re.fullmatch(SUM, text), text
    else:
        assert text in value, text


def test_json_regex_and_choice_batched_with_different_specs(smollm):
    kw = dict(apply_chat_template=True, max_new_tokens=64, proposer="none")
    with threaded_server(lambda: build_server(smollm, scheduler="sequential")) as sequential:
        with TargetClient(sequential.address) as client:
            want = [client.generate(text=prompt, structured_output=spec, **kw) for prompt, spec in CASES]
    for (_, spec), out in zip(CASES, want, strict=True):
        assert out.finish_reasons == ["eos"], out
        check(spec, out.text[0])
    with threaded_server(lambda: build_server(smollm, scheduler="batched")) as batched:
        got, errors, start = [None] * len(CASES), [], threading.Barrier(len(CASES))

        def worker(i):
            try:
                with TargetClient(batched.address) as client:
                    start.wait(30)
                    got[i] = client.generate(text=CASES[i][0], structured_output=CASES[i][1], **kw)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(CASES))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    assert not errors, errors
    for ours, theirs in zip(got, want, strict=True):
        assert torch.equal(ours.sequences, theirs.sequences), (ours.text, theirs.text)


def test_beam_search_keeps_every_returned_beam_in_the_grammar(smollm):
    prompt, spec = CASES[-1]
    with threaded_server(lambda: build_server(smollm)) as server:
        with TargetClient(server.address) as client:
            out = client.generate(
                text=prompt,
                structured_output=spec,
                apply_chat_template=True,
                max_new_tokens=16,
                num_beams=3,
                num_return_sequences=3,
            )
    assert len(out.text) == 3 and len(set(out.text)) == 3, out.text
    for text in out.text:
        check(spec, text)


def test_prompt_lookup_on_a_schema_copying_prompt_equals_plain_constrained_decoding(smollm):
    record = {"name": "Ada Lovelace", "age": 36, "city": "London"}
    prompt = (
        "Here is a record:\n" + json.dumps(record) + "\nReturn the same record as JSON, with the age increased by one."
    )
    kw = dict(text=prompt, apply_chat_template=True, max_new_tokens=64, structured_output={"json_schema": Person})
    with threaded_server(lambda: build_server(smollm)) as server:
        with TargetClient(server.address) as client:
            plain = client.generate(proposer="none", **kw)
            fast = client.generate(prompt_lookup_num_tokens=8, **kw)
    assert plain.finish_reasons == ["eos"]
    Person.model_validate_json(plain.text[0])
    assert fast.speculation.proposer == "prompt_lookup" and not fast.speculation.fallback_reason
    assert fast.speculation.accepted_tokens > 0
    assert torch.equal(fast.sequences, plain.sequences)
