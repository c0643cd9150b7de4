"""Structured output over the wire: real target servers (sequential and batched) on loopback with the
tiny Llama, the client's `structured_output=` forms, outputs that match their spec and end with EOS,
speculation giving the tokens of plain constrained decoding, batches of requests with different specs,
and the library's errors as INVALID_ARGUMENT before any model work."""

from __future__ import annotations

import json
import re
import threading

import grpc
import pydantic
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specwire.client import SpecwireRpcError, TargetClient
from specwire.models import load_model
from specwire.target_service.__main__ import build_server
from tests.servers import threaded_server

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


class Point(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false

    x: int
    label: str = pydantic.Field(max_length=4)


REGEX = r"[ab]{2,4}-[0-9]{2}"
GRAMMAR = 'start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[0-9]/\n'
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = ["The quick brown", "def add(a, b):"]


def check(kind, text):
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99, text
    elif kind == "pydantic":
        Point.model_validate_json(text)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "grammar":
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", text), text
    else:
        assert text in CHOICES, text


SPECS = {
    "json_schema": {"json_schema": SCHEMA},
    "pydantic": {"json_schema": Point},
    "regex": {"regex": REGEX},
    "grammar": {"grammar": GRAMMAR},
    "choice": {"choice": CHOICES},
}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def sequential(loaded):
    with threaded_server(lambda: build_server(loaded, scheduler="sequential")) as server:
        yield server


@pytest.fixture(scope="module")
def batched(loaded):
    with threaded_server(lambda: build_server(loaded, scheduler="batched")) as server:
        yield server


def batcher_of(server):
    return server.server.bindings[0].servicer.engine.batcher


@pytest.mark.parametrize("kind", SPECS)
def test_each_kind_matches_its_spec_and_ends_with_eos(sequential, kind):
    with TargetClient(sequential.address) as client:
        out = client.generate(text=PROMPTS, max_new_tokens=40, structured_output=SPECS[kind], proposer="none")
    for text, reason in zip(out.text, out.finish_reasons, strict=True):
        assert reason == "eos", (reason, text)
        check(kind, text)


def test_speculation_gives_the_tokens_of_plain_constrained_decoding(sequential):
    with TargetClient(sequential.address) as client:
        plain = client.generate(
            text=PROMPTS[:1], max_new_tokens=40, structured_output=SPECS["json_schema"], proposer="none"
        )
        # A prompt that holds the answer: prompt lookup drafts it, the grammar cuts what it forbids.
        prompt = [PROMPTS[0] + " " + plain.text[0] + " " + plain.text[0]]
        plain = client.generate(text=prompt, max_new_tokens=40, structured_output=SPECS["json_schema"], proposer="none")
        fast = client.generate(
            text=prompt, max_new_tokens=40, structured_output=SPECS["json_schema"], prompt_lookup_num_tokens=4
        )
    assert fast.speculation.proposer == "prompt_lookup" and not fast.speculation.fallback_reason
    assert fast.speculation.accepted_tokens > 0
    assert torch.equal(fast.sequences, plain.sequences) and fast.finish_reasons == plain.finish_reasons


def test_beam_search_over_the_wire(sequential):
    with TargetClient(sequential.address) as client:
        out = client.generate(
            text=PROMPTS, max_new_tokens=20, num_beams=3, num_return_sequences=2, structured_output=SPECS["regex"]
        )
    assert len(out.text) == 4
    for text in out.text:
        check("regex", text)


def test_batched_requests_with_different_specs_get_their_sequential_results(sequential, batched):
    cases = [(kind, SPECS[kind]) for kind in SPECS] + [("free", None)]
    kw = dict(max_new_tokens=30, proposer="none")
    with TargetClient(sequential.address) as client:
        want = [client.generate(text=PROMPTS, structured_output=spec, **kw).sequences for _, spec in cases]
    batcher = batcher_of(batched)
    before = batcher.stats()
    got, errors, start = [None] * len(cases), [], threading.Barrier(len(cases))

    def worker(i):
        try:
            with TargetClient(batched.address) as client:
                start.wait(30)
                got[i] = client.generate(text=PROMPTS, structured_output=cases[i][1], **kw).sequences
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    for (kind, _), ours, theirs in zip(cases, got, want, strict=True):
        assert torch.equal(ours, theirs), kind
    after = batcher.stats()
    # They ran in the slot cache, sharing forwards, not in the sequential lane.
    assert after.lane_forwards == before.lane_forwards
    assert after.shared_forwards > before.shared_forwards


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"json_schema": {"type": "nonsense"}}, "nonsense"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"regex": "(ab"}, "unclosed group"),
        ({"grammar": "start: foo"}, "unknown name"),
        ({"choice": []}, "at least one choice"),
    ],
)
@pytest.mark.parametrize("server", ["sequential", "batched"])
def test_invalid_specs_are_invalid_argument_with_the_library_message(request, server, spec, words):
    address = request.getfixturevalue(server).address
    with TargetClient(address) as client:
        with pytest.raises(SpecwireRpcError) as info:
            client.generate(text=PROMPTS[:1], max_new_tokens=4, structured_output=spec)
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert words in error.message, error.message
    assert error.violations and error.violations[0].field == f"structured_output.{next(iter(spec))}"


def test_an_empty_structured_output_message_is_refused(sequential):
    from specwire.client.target_client import build_request
    from specwire.target.v1 import target_service_pb2 as pb

    request = build_request(pb.GenerateRequest, text=PROMPTS[:1], max_new_tokens=4)
    request.structured_output.SetInParent()
    with grpc.insecure_channel(sequential.address) as channel:
        stub = __import__("specwire.target.v1.target_service_pb2_grpc", fromlist=["x"]).TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output" in info.value.details()


@pytest.mark.parametrize(
    "value", [{"json_schema": {}, "regex": "a"}, {"yaml": "x"}, {"choice": "yes"}, {"regex": 3}, {"json_schema": 3}]
)
def test_the_client_refuses_malformed_arguments(value):
    from specwire.client.structured_output import structured_output_to_proto

    with pytest.raises(ValueError):
        structured_output_to_proto(value)


def test_cli_json_schema_regex_choice_and_a_library_error(sequential, tmp_path, capsys):
    from specwire.client.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    base = ["generate", "Hello", "--address", sequential.address, "--no-chat", "--json", "--proposer", "none"]
    for option, kind in [(["--json-schema", str(schema)], "json_schema"), (["--regex", REGEX], "regex")]:
        assert main([*base, *option, "--set", "max_new_tokens=40"]) == 0
        output = json.loads(capsys.readouterr().out)
        assert output["finish_reasons"] == ["eos"]
        check(kind, output["text"][0])
    assert main([*base, "--choice", "yes", "--choice", "no", "--choice", "maybe so"]) == 0
    check("choice", json.loads(capsys.readouterr().out)["text"][0])
    assert main([*base, "--regex", "(ab"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert main([*base, "--json-schema", str(tmp_path / "missing.json")]) != 0
    assert "--json-schema" in capsys.readouterr().err


def test_streaming_a_choice(batched):
    with TargetClient(batched.address) as client:
        items = list(client.stream(text=PROMPTS[:1], max_new_tokens=20, structured_output={"choice": CHOICES}))
    final = items[-1]
    streamed = "".join(item.text for item in items[:-1])
    assert final.finish_reasons == ["eos"] and final.text[0] in CHOICES and streamed == final.text[0]


_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
_SPECS = st.one_of(
    st.builds(lambda t: {"json_schema": t}, _TEXT),
    st.builds(
        lambda d: {"json_schema": d},
        st.dictionaries(
            st.sampled_from(
                ["type", "enum", "pattern", "items", "properties", "minimum", "maxLength", "anyOf", "$ref"]
            ),
            st.one_of(_TEXT, st.integers(), st.lists(_TEXT, max_size=3)),
            max_size=3,
        ),
    ),
    st.builds(lambda t: {"regex": t}, _TEXT),
    st.builds(lambda t: {"grammar": t}, _TEXT),
    st.builds(lambda t: {"grammar": "start: " + t}, _TEXT),
    st.builds(lambda c: {"choice": c}, st.lists(_TEXT, max_size=4)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spec=_SPECS,
    options=st.sampled_from([{}, {"do_sample": True, "seed": 1}, {"num_beams": 2}, {"prompt_lookup_num_tokens": 3}]),
)
def test_fuzzed_specs_never_answer_internal(batched, spec, options):
    with TargetClient(batched.address) as client:
        try:
            out = client.generate(text=PROMPTS[:1], max_new_tokens=3, structured_output=spec, **options)
        except SpecwireRpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert error.violations and error.violations[0].field.startswith("structured_output"), error
        except ValueError:  # the client's own check (e.g. a non-string choice)
            pass
        else:
            assert len(out.text) == 1
