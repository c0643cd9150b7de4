"""Property-based requests against one real target service: bad input never gets INTERNAL.

Hypothesis draws `GenerateRequest`s across the GenerationConfig space (every wire field, valid and
invalid values: negatives, int32 extremes, NaN and infinities, empty and nested lists, unknown enum
values, free-form dicts) and the request's wire shapes (token ids in and out of the vocabulary,
attention masks of the wrong length, all zero or not 0/1, ragged and mixed prompts, text prompts,
negative prompts, registry references valid and invalid, overrides, proposers including unknown
ones, stop strings). Every answer must be a result or a status other than INTERNAL/UNKNOWN; an
INVALID_ARGUMENT must name a field; and after each example the server must still be healthy (health
SERVING and a small greedy request answered).

The config service gets the same treatment: generation_config.json-like documents through
ImportConfig and drawn configs through CreateConfig/UpdateConfig; whatever is stored must read back.

Bounded for CI: `SPECWIRE_FUZZ_EXAMPLES` examples (default 200), derandomized so every run draws the
same requests. Run more locally with e.g. `SPECWIRE_FUZZ_EXAMPLES=2000 SPECWIRE_FUZZ_SEED=7`.

Sizes that are legal but expensive (thousands of beams, lengths near 2**31) are left to the
service's request limits and their own tests: here beams and returned sequences stay small, and a
drawn length above 64 tokens comes with `max_time` so one example can't run for minutes.
"""

from __future__ import annotations

import math
import os
import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specwire.client import ConfigClient, SpecwireRpcError
from specwire.config.v1 import generation_config_pb2 as gc_pb
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.models import load_model
from specwire.target.v1 import target_service_pb2 as pb
from specwire.target.v1 import target_service_pb2_grpc as pb_grpc
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.wire.generation_config import config_from_proto
from tests.servers import threaded_server

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("SPECWIRE_FUZZ_EXAMPLES", "200"))
SEED = os.environ.get("SPECWIRE_FUZZ_SEED")
# Every example's call gets this long; a hang is a failure (DEADLINE_EXCEEDED is not accepted).
CALL_TIMEOUT_S = 30.0
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
# Statuses a bad or unlucky request may get. INTERNAL and UNKNOWN (a handler bug) never are.
ACCEPTED_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}
GOOD_PROMPT = [5, 6, 7, 8]
# A message that names its field starts with it: `config.top_k=0: ...`, `prompts[1].attention_mask=...`.
FIELD_IN_MESSAGE = re.compile(r"^[A-Za-z_][\w.\[\]]*=")


# ------------------------------------------------------------------------------------------ the stack


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, loaded):
    """A config service holding `fuzz-base`, and a batched target service wired to it."""
    db = tmp_path_factory.mktemp("fuzz-registry") / "r.db"
    with threaded_server(lambda: build_config_server(str(db))) as config_server:
        with ConfigClient(config_server.address) as registry:
            registry.create("fuzz-base", {"max_new_tokens": 4, "do_sample": False})
        with threaded_server(lambda: build_target_server(loaded, config_server.address)) as target_server:
            yield target_server


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.address) as ch:
        yield ch


# ------------------------------------------------------------------------------------------ strategies

VOCAB = 378  # the tiny model's vocabulary (checked against the server in the test)


def token_ids():
    return st.one_of(
        st.integers(0, VOCAB - 1),
        st.integers(0, VOCAB - 1),
        st.sampled_from([VOCAB, VOCAB + 1, INT32_MAX, -1, INT32_MIN]),
    )


def id_lists(min_size=0, max_size=4):
    return st.lists(token_ids(), min_size=min_size, max_size=max_size)


INT32 = st.one_of(st.integers(-2, 10), st.sampled_from([0, -1, 64, 1000, INT32_MAX, INT32_MIN]))
SMALL_COUNT = st.one_of(st.integers(-2, 4), st.sampled_from([0, -1, INT32_MIN]))  # beams, sequences
LENGTH = st.one_of(st.integers(-1, 8), st.sampled_from([0, -1, 65, 300, INT32_MAX, INT32_MIN]))
DOUBLE = st.one_of(
    st.floats(-2.0, 3.0, allow_nan=False),
    st.sampled_from([0.0, 1.0, -1.0, 0.5, 1e-9, 1e308, -1e308, math.nan, math.inf, -math.inf]),
)
STRING = st.sampled_from(["", "static", "dynamic", "heuristic", "constant", "bogus", "mtp", "\u0000", "x" * 300])
JSON_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
)
JSON = st.recursive(
    JSON_SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)
STOP_STRING = st.one_of(
    st.text(max_size=6), st.sampled_from(["", " ", "fox", "\n", "中文", "\ufffd", "</s>", "x" * 200])
)
WATERMARKS = st.one_of(
    st.just({"greenlist_ratio": 0.25, "bias": 2.0, "seeding_scheme": "lefthash"}),
    st.just({"ngram_len": 2, "keys": [1, 2, 3]}),  # SynthID
    st.just({"greenlist_ratio": 2.0}),
    st.just({"seeding_scheme": "selfhash", "context_width": 2}),
    st.dictionaries(
        st.sampled_from(["greenlist_ratio", "bias", "hashing_key", "ngram_len", "keys", "zz"]), JSON, max_size=3
    ),
)

# Message-typed fields: how to fill each from a drawn value.
MESSAGE_STRATEGIES = {
    "stop_strings": st.one_of(
        STOP_STRING, st.lists(STOP_STRING, max_size=4), st.lists(STOP_STRING, min_size=50, max_size=300)
    ),
    "forced_eos_token_id": st.one_of(token_ids(), id_lists()),
    "eos_token_id": st.one_of(token_ids(), id_lists()),
    "decoder_start_token_id": st.one_of(token_ids(), id_lists()),
    "suppress_tokens": id_lists(max_size=5),
    "begin_suppress_tokens": id_lists(max_size=5),
    "bad_words_ids": st.lists(id_lists(max_size=3), max_size=3),
    "sequence_bias": st.lists(st.tuples(id_lists(max_size=3), DOUBLE), max_size=3),
    "exponential_decay_length_penalty": st.tuples(INT32, DOUBLE),
    "watermarking_config": WATERMARKS,
    "cache_config": st.dictionaries(st.text(max_size=6), JSON, max_size=3),
    "compile_config": st.dictionaries(
        st.sampled_from(["fullgraph", "dynamic", "backend", "mode", "x"]), JSON, max_size=2
    ),
    "continuous_batching_config": st.dictionaries(st.text(max_size=6), JSON, max_size=2),
    "dola_layers": st.one_of(
        st.sampled_from(["low", "high", "mid"]), st.lists(st.integers(-2, 40), max_size=3), st.integers(-2, 5)
    ),
    "constraints": st.lists(JSON, max_size=2),
    "force_words_ids": st.lists(st.lists(id_lists(max_size=2), max_size=2), max_size=2),
    "typed_constraints": st.lists(
        st.one_of(
            st.tuples(st.just("phrasal"), id_lists(max_size=3)),
            st.tuples(st.just("disjunctive"), st.lists(id_lists(max_size=2), max_size=2)),
        ),
        max_size=2,
    ),
    "extra": st.dictionaries(
        st.one_of(st.text(max_size=8), st.sampled_from(["top_k", "max_new_tokens", "assistant_model", "streamer"])),
        JSON,
        max_size=3,
    ),
}
SMALL_FIELDS = {"num_beams", "num_return_sequences"}
LENGTH_FIELDS = {"max_length", "max_new_tokens", "min_length", "min_new_tokens", "max_cache_len"}


def _scalar_strategy(field):
    if field.name in SMALL_FIELDS:
        return SMALL_COUNT
    if field.name in LENGTH_FIELDS:
        return LENGTH
    kind = field.type
    if kind == field.TYPE_INT32:
        return INT32
    if kind == field.TYPE_INT64:  # seed
        return st.one_of(st.integers(-5, 5), st.sampled_from([2**63 - 1, -(2**63), 2**40]))
    if kind == field.TYPE_DOUBLE:
        return DOUBLE
    if kind == field.TYPE_BOOL:
        return st.booleans()
    if kind == field.TYPE_STRING:
        return STRING
    if kind == field.TYPE_ENUM:  # early_stopping, with an unknown value too
        return st.sampled_from([0, 1, 2, 3, 42])
    raise AssertionError(f"no strategy for {field.name}")


FIELD_STRATEGIES = {
    f.name: MESSAGE_STRATEGIES[f.name] if f.type == f.TYPE_MESSAGE else _scalar_strategy(f)
    for f in gc_pb.GenerationConfig.DESCRIPTOR.fields
}


# Values transformers accepts, so that requests get past validation into the decoding loop, where
# feature interactions (beams x penalties x stop strings x guidance x speculation ...) run.
VALID_IDS = st.integers(3, VOCAB - 1)
VALID_STRATEGIES = {
    "do_sample": st.booleans(),
    "num_beams": st.integers(1, 3),
    "num_return_sequences": st.integers(1, 2),
    "max_new_tokens": st.integers(1, 6),
    "min_new_tokens": st.integers(0, 4),
    "temperature": st.floats(0.2, 2.0),
    "top_k": st.integers(0, 60),
    "top_p": st.floats(0.05, 1.0),
    "min_p": st.floats(0.0, 0.5),
    "typical_p": st.floats(0.1, 1.0),
    "epsilon_cutoff": st.floats(0.0, 0.2),
    "eta_cutoff": st.floats(0.0, 0.2),
    "top_h": st.floats(0.1, 1.0),
    "repetition_penalty": st.floats(0.5, 2.0),
    "encoder_repetition_penalty": st.floats(0.5, 2.0),
    "no_repeat_ngram_size": st.integers(0, 3),
    "encoder_no_repeat_ngram_size": st.integers(0, 3),
    "length_penalty": st.floats(-1.0, 2.0),
    "early_stopping": st.sampled_from([1, 2, 3]),
    "bad_words_ids": st.lists(st.lists(VALID_IDS, min_size=1, max_size=2), min_size=1, max_size=3),
    "sequence_bias": st.lists(
        st.tuples(st.lists(VALID_IDS, min_size=1, max_size=2), st.floats(-5, 5)), min_size=1, max_size=3
    ),
    "suppress_tokens": st.lists(VALID_IDS, max_size=3),
    "begin_suppress_tokens": st.lists(VALID_IDS, max_size=3),
    "forced_bos_token_id": VALID_IDS,
    "forced_eos_token_id": VALID_IDS,
    "exponential_decay_length_penalty": st.tuples(st.integers(0, 4), st.floats(1.0, 1.5)),
    "renormalize_logits": st.booleans(),
    "remove_invalid_values": st.booleans(),
    "guidance_scale": st.sampled_from([1.0, 1.5, 3.0]),
    "watermarking_config": st.just({"greenlist_ratio": 0.25, "bias": 2.0, "seeding_scheme": "lefthash"}),
    "stop_strings": st.one_of(
        st.text("abcdefox ", min_size=1, max_size=3), st.lists(STOP_STRING, min_size=1, max_size=5)
    ),
    "output_scores": st.booleans(),
    "output_logits": st.booleans(),
    "return_dict_in_generate": st.booleans(),
    "use_cache": st.booleans(),
    "seed": st.integers(0, 5),
    "max_time": st.floats(0.5, 5.0),
    "prompt_lookup_num_tokens": st.integers(1, 5),
    "max_matching_ngram_size": st.integers(1, 3),
    "num_assistant_tokens": st.integers(1, 6),
    "num_assistant_tokens_schedule": st.sampled_from(["constant", "heuristic", "heuristic_transient"]),
    "assistant_confidence_threshold": st.floats(0.0, 1.0),
    "prefill_chunk_size": st.integers(1, 4),
    "eos_token_id": st.one_of(st.just(2), st.lists(VALID_IDS, min_size=1, max_size=2)),
    "pad_token_id": st.sampled_from([0, 2]),
}


def config_values(max_fields=4, strategies=None):
    """A few GenerationConfig fields with drawn values (the rest unset)."""
    strategies = FIELD_STRATEGIES if strategies is None else strategies
    names = st.lists(st.sampled_from(sorted(strategies)), max_size=max_fields, unique=True)
    return names.flatmap(lambda chosen: st.fixed_dictionaries({n: strategies[n] for n in chosen}))


def fill_config(message: gc_pb.GenerationConfig, values: dict) -> None:
    """Set drawn values on the wire message the way a client could, whatever they mean."""
    for name, value in values.items():
        if name == "stop_strings":
            if isinstance(value, str):
                message.stop_strings.text = value
            else:
                message.stop_strings.texts.values.extend(value)
                message.stop_strings.SetInParent()
        elif name in ("forced_eos_token_id", "eos_token_id", "decoder_start_token_id"):
            target = getattr(message, name)
            if isinstance(value, int):
                target.id = value
            else:
                target.ids.ids.extend(value)
                target.ids.SetInParent()
        elif name in ("suppress_tokens", "begin_suppress_tokens"):
            getattr(message, name).ids.extend(value)
            getattr(message, name).SetInParent()
        elif name == "bad_words_ids":
            for row in value:
                message.bad_words_ids.sequences.add().ids.extend(row)
            message.bad_words_ids.SetInParent()
        elif name == "sequence_bias":
            for ids, bias in value:
                entry = message.sequence_bias.entries.add()
                entry.sequence.extend(ids)
                entry.bias = bias
            message.sequence_bias.SetInParent()
        elif name == "exponential_decay_length_penalty":
            message.exponential_decay_length_penalty.start_index = value[0]
            message.exponential_decay_length_penalty.decay_factor = value[1]
        elif name in ("watermarking_config", "cache_config", "compile_config", "continuous_batching_config", "extra"):
            getattr(message, name).update(value)
            getattr(message, name).SetInParent()
        elif name == "dola_layers":
            if isinstance(value, str):
                message.dola_layers.string_value = value
            elif isinstance(value, int):
                message.dola_layers.number_value = value
            else:
                message.dola_layers.list_value.extend(value)
        elif name in ("constraints", "force_words_ids"):
            getattr(message, name).extend(value)
            getattr(message, name).SetInParent()
        elif name == "typed_constraints":
            for kind, ids in value:
                item = message.typed_constraints.items.add()
                if kind == "phrasal":
                    item.phrasal.ids.extend(ids)
                    item.phrasal.SetInParent()
                else:
                    for row in ids:
                        item.disjunctive.sequences.add().ids.extend(row)
                    item.disjunctive.SetInParent()
            message.typed_constraints.SetInParent()
        else:
            setattr(message, name, value)


MASKS = st.one_of(
    st.just("none"),
    st.just("ones"),
    st.just("left-pad"),
    st.just("zeros"),
    st.just("short"),
    st.lists(st.sampled_from([0, 1, 2, -1]), min_size=1, max_size=6),
)


@st.composite
def prompts(draw, max_size=3, wild=True):
    """Prompts as the wire carries them: token ids (with a mask) or text, possibly mixed or empty.

    With `wild=False`, 1 to `max_size` well-formed prompts of one kind (so the request can reach the
    decoding loop); otherwise anything the wire can carry.
    """
    out = []
    count = draw(st.integers(0, max_size) if wild else st.integers(1, max_size))
    text_prompts = draw(st.integers(0, 4)) == 0
    for _ in range(count):
        prompt = pb.Prompt()
        if (draw(st.integers(0, 4)) == 0) if wild else text_prompts:
            prompt.text = draw(st.one_of(st.text(max_size=12), st.sampled_from(["Hello world", "The quick brown fox"])))
        else:
            if wild:
                ids = draw(st.one_of(id_lists(min_size=1, max_size=8), id_lists(max_size=0)))
            else:
                ids = draw(st.lists(VALID_IDS, min_size=1, max_size=8))
            prompt.token_ids.ids.extend(ids)
            prompt.token_ids.SetInParent()
            mask = draw(MASKS if wild else st.sampled_from(["none", "ones", "left-pad"]))
            n = len(ids)
            if mask == "ones":
                prompt.attention_mask.extend([1] * n)
            elif mask == "left-pad" and n > 1:
                prompt.attention_mask.extend([0] + [1] * (n - 1))
            elif mask == "zeros":
                prompt.attention_mask.extend([0] * n)
            elif mask == "short":
                prompt.attention_mask.extend([1] * max(n - 1, 0))
            elif isinstance(mask, list):
                prompt.attention_mask.extend(mask)
        out.append(prompt)
    return out


CONFIG_REFS = st.sampled_from(
    ["fuzz-base", "fuzz-base@1", "fuzz-base@9", "fuzz-base:prod", "missing", "Bad Name!", "", "a" * 300]
)


@st.composite
def requests(draw):
    request = pb.GenerateRequest()
    # Half the requests draw from the whole space (mostly refused early), half from valid prompts and
    # values, which reach the decoding loop and its feature interactions.
    wild = draw(st.booleans())
    request.prompts.extend(draw(prompts(wild=wild)))
    source = draw(st.sampled_from(["none", "inline", "ref"]))
    strategies = FIELD_STRATEGIES if wild else VALID_STRATEGIES
    drawn: dict = {}
    if source == "inline":
        values = draw(config_values(max_fields=6, strategies=strategies))
        fill_config(request.config, values)
        request.config.SetInParent()
        drawn.update(values)
    elif source == "ref":
        request.config_ref = draw(CONFIG_REFS)
    overrides = draw(config_values(max_fields=4, strategies=strategies))
    fill_config(request.overrides, overrides)
    drawn.update(overrides)
    # Lengths the request limits will cap (not this branch's subject): bound the work with max_time.
    if any(
        isinstance(drawn.get(n), int) and drawn[n] > 64
        for n in ("max_new_tokens", "max_length", "min_new_tokens", "min_length")
    ):
        request.overrides.max_time = 1.0
    if draw(st.booleans()) and not request.overrides.HasField("max_new_tokens"):
        request.overrides.max_new_tokens = 3  # short generations, so more examples fit the time budget
    negative = draw(st.one_of(st.none(), prompts(max_size=1, wild=wild)))
    if negative:
        request.negative_prompt.CopyFrom(negative[0])
    request.apply_chat_template = draw(st.booleans()) if wild else False  # the tiny tokenizer has none
    request.proposer = draw(st.sampled_from([0, 1, 2, 3, 9]))  # 9: an enum value this server doesn't know
    request.request_id = draw(st.sampled_from(["", "fuzz", "x" * 200]))
    return request, draw(st.booleans())


# ------------------------------------------------------------------------------------------ checks


def call(stub, request: pb.GenerateRequest, stream: bool):
    """The answer to `request`: the response, or the `SpecwireRpcError` it failed with."""
    try:
        if stream:
            streamed = pb.GenerateStreamRequest()
            streamed.ParseFromString(request.SerializeToString())  # the same fields, the same numbers
            return list(stub.GenerateStream(streamed, timeout=CALL_TIMEOUT_S))
        return stub.Generate(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        return SpecwireRpcError.from_rpc_error(error)


def assert_healthy(channel, stub) -> None:
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    request = pb.GenerateRequest(prompts=[pb.Prompt(token_ids={"ids": GOOD_PROMPT})])
    request.overrides.max_new_tokens = 2
    request.overrides.do_sample = False
    response = stub.Generate(request, timeout=CALL_TIMEOUT_S)
    assert len(response.sequences) == 1 and len(response.sequences[0].token_ids) == len(GOOD_PROMPT) + 2


def check_answer(request, answer) -> None:
    if not isinstance(answer, SpecwireRpcError):
        return
    assert answer.code() in ACCEPTED_CODES, f"{answer.code().name}: {answer.message}\nrequest:\n{request}"
    if answer.code() == grpc.StatusCode.INVALID_ARGUMENT:
        named = any(v.field for v in answer.violations) or FIELD_IN_MESSAGE.match(answer.message)
        assert named, f"INVALID_ARGUMENT names no field: {answer.message!r}\nrequest:\n{request}"


_settings = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    print_blob=True,
)


def test_fuzz_vocabulary_matches_the_tiny_model(loaded):
    assert loaded.vocab_size == VOCAB  # the strategies' in/out-of-range ids are drawn around it


@_settings
@given(drawn=requests())
def test_fuzzed_requests_never_get_internal_and_leave_the_server_healthy(channel, drawn):
    request, stream = drawn
    stub = pb_grpc.TargetServiceStub(channel)
    answer = call(stub, request, stream)
    # `pytest --hypothesis-show-statistics` shows how many examples reached generation.
    hypothesis.event(answer.code().name if isinstance(answer, SpecwireRpcError) else "result")
    check_answer(request, answer)
    assert_healthy(channel, stub)


if SEED is not None:
    test_fuzzed_requests_never_get_internal_and_leave_the_server_healthy = hypothesis.seed(int(SEED))(
        test_fuzzed_requests_never_get_internal_and_leave_the_server_healthy
    )


# ------------------------------------------------------------------------------------------ ImportConfig

FIELD_NAMES_FOR_JSON = sorted(FIELD_STRATEGIES) + ["transformers_version", "_from_model_config", "unknown_key"]
JSON_LITERALS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-0", "1" * 30, '"\\ud800"', "null"])


@st.composite
def json_documents(draw):
    """generation_config.json-like text: known and unknown keys with any JSON (and JSON-ish) values."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.one_of(st.text(max_size=20), st.sampled_from(["[]", "1", '"x"', "{", "[" * 50 + "]" * 50])))
    keys = draw(st.lists(st.sampled_from(FIELD_NAMES_FOR_JSON), max_size=5, unique=True))
    parts = []
    for key in keys:
        if draw(st.booleans()):
            value = draw(JSON_LITERALS)
        else:
            import json as _json

            value = _json.dumps(draw(st.one_of(JSON, st.integers(-(2**70), 2**70))))
        parts.append(f'"{key}": {value}')
    return "{" + ", ".join(parts) + "}"


@pytest.fixture(scope="module")
def registry_address(tmp_path_factory):
    db = tmp_path_factory.mktemp("fuzz-import") / "r.db"
    with threaded_server(lambda: build_config_server(str(db))) as server:
        yield server.address


@_settings
@given(text=json_documents())
def test_fuzzed_import_config_never_gets_internal(registry_address, text):
    with ConfigClient(registry_address) as registry:
        try:
            record = registry.import_json(text, name="fuzzed")
        except SpecwireRpcError as error:
            hypothesis.event(error.code().name)
            check_answer(text, error)
        else:
            hypothesis.event("stored")
            # What was stored reads back (and exports) without a bug either.
            registry.get(f"fuzzed@{record.version}")


@_settings
@given(values=config_values(max_fields=6))
def test_fuzzed_create_config_never_gets_internal(registry_address, values):
    from specwire.config.v1 import config_service_pb2 as config_pb
    from specwire.config.v1 import config_service_pb2_grpc as config_grpc

    request = config_pb.CreateConfigRequest(name="created")
    fill_config(request.config, values)
    with grpc.insecure_channel(registry_address) as ch:
        stub = config_grpc.ConfigServiceStub(ch)
        try:
            stub.UpdateConfig(config_pb.UpdateConfigRequest(name="created", config=request.config), timeout=10)
            stored = stub.GetConfig(config_pb.GetConfigRequest(ref="created"), timeout=10)
            hypothesis.event("stored")
            config_from_proto(stored.record.config)  # what a target reads back
        except grpc.RpcError as error:
            answer = SpecwireRpcError.from_rpc_error(error)
            if answer.code() == grpc.StatusCode.NOT_FOUND:  # the first example: create it instead
                try:
                    stub.CreateConfig(request, timeout=10)
                except grpc.RpcError as create_error:
                    answer = SpecwireRpcError.from_rpc_error(create_error)
            hypothesis.event(answer.code().name)
            check_answer(request, answer)
