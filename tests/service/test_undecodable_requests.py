"""Requests protobuf cannot parse (a Struct nested past its depth limit, bytes that are no message) get
INVALID_ARGUMENT naming the request and the fix, not gRPC's UNKNOWN, on real servers; the server keeps
answering afterwards."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import struct_pb2

from specwire.common.v1 import common_pb2
from specwire.config.v1 import config_service_pb2 as config_pb
from specwire.config.v1 import config_service_pb2_grpc as config_grpc
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.draft.v1 import draft_service_pb2 as draft_pb
from specwire.draft.v1 import draft_service_pb2_grpc as draft_grpc
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.models import load_model
from specwire.target.v1 import target_service_pb2 as target_pb
from specwire.target.v1 import target_service_pb2_grpc as target_grpc
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.wire.generation_config import dict_to_proto
from tests.servers import threaded_server


def deep_struct(levels: int) -> struct_pb2.Struct:
    """{"k": {"k": ... {"leaf": 1}}} nested `levels` dicts deep: 3 protobuf message levels per dict."""
    root = struct_pb2.Struct()
    current = root
    for _ in range(levels):
        current = current.fields["k"].struct_value
    current.fields["leaf"].number_value = 1
    return root


def expect_unparsable(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=30)
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "request" in error.details() and "could not be parsed" in error.details(), error.details()
    return error


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    db = tmp_path_factory.mktemp("registry") / "r.db"
    loaded = load_model(str(tiny_model_dir), progress=False)
    with threaded_server(lambda: build_config_server(str(db))) as config_server:
        with threaded_server(lambda: build_target_server(loaded, config_server.address)) as target_server:
            yield config_server, target_server


def test_generate_with_a_too_deep_struct_is_invalid_argument_and_the_server_keeps_serving(stack):
    with grpc.insecure_channel(stack[1].address) as channel:
        stub = target_grpc.TargetServiceStub(channel)
        prompt = [target_pb.Prompt(token_ids=common_pb2.TokenSequence(ids=[5, 6, 7]))]
        request = target_pb.GenerateRequest(prompts=prompt)
        request.overrides.extra.CopyFrom(deep_struct(60))
        error = expect_unparsable(stub.Generate, request)
        assert "flatten deeply nested values in extra/Struct fields" in error.details()
        assert "GenerateRequest" in error.details()
        # The streaming RPC (unary request, streamed response) is guarded the same way.
        stream_request = target_pb.GenerateStreamRequest(prompts=prompt)
        stream_request.overrides.extra.CopyFrom(deep_struct(60))
        expect_unparsable(lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout)), stream_request)
        # Bytes that are no GenerateRequest at all: same code, the other fix.
        raw = channel.unary_unary(
            "/specwire.target.v1.TargetService/Generate",
            request_serializer=lambda data: data,
            response_deserializer=target_pb.GenerateResponse.FromString,
        )
        error = expect_unparsable(raw, b"\xff\xff\xff")
        assert "generated stubs" in error.details()
        # A shallow Struct parses and reaches the handler's own validation (an unknown override key).
        request = target_pb.GenerateRequest(prompts=prompt)
        request.overrides.extra.CopyFrom(deep_struct(5))
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "overrides.k" in info.value.details() and "could not be parsed" not in info.value.details()
        # The server still answers normally after the refusals.
        request = target_pb.GenerateRequest(prompts=prompt, overrides=dict_to_proto({"max_new_tokens": 2}))
        response = stub.Generate(request, timeout=60)
        assert len(response.sequences) == 1


def test_create_config_with_a_too_deep_struct_is_invalid_argument(stack):
    with grpc.insecure_channel(stack[0].address) as channel:
        stub = config_grpc.ConfigServiceStub(channel)
        request = config_pb.CreateConfigRequest(name="deep", config=dict_to_proto({"max_new_tokens": 4}))
        request.config.extra.CopyFrom(deep_struct(60))
        error = expect_unparsable(stub.CreateConfig, request)
        assert "CreateConfigRequest" in error.details()
        # Nothing was stored, and a normal create works afterwards.
        request = config_pb.CreateConfigRequest(name="normal", config=dict_to_proto({"max_new_tokens": 4}))
        assert stub.CreateConfig(request, timeout=30).record.name == "normal"
        names = [r.name for r in stub.ListConfigs(config_pb.ListConfigsRequest(), timeout=30).records]
        assert names == ["normal"]


def test_draft_stream_with_a_too_deep_struct_is_invalid_argument(tiny_draft_dir):
    draft_loaded = load_model(str(tiny_draft_dir), progress=False)
    with threaded_server(lambda: build_draft_server(draft_loaded)) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = draft_grpc.DraftServiceStub(channel)
            start = draft_pb.DraftStart(
                rows=[common_pb2.TokenSequence(ids=[5, 6, 7, 5, 6])],
                method=draft_pb.DRAFT_METHOD_PROMPT_LOOKUP,
                config=dict_to_proto({"eos_token_id": 2}),
                num_tokens=2,
                vocab_size=378,
            )
            bad = draft_pb.DraftRequest(start=start)
            bad.start.config.extra.CopyFrom(deep_struct(60))
            error = expect_unparsable(lambda r, timeout: list(stub.Draft(iter(r), timeout=timeout)), [bad])
            assert "DraftRequest" in error.details()
            # A good stream still gets its proposal.
            responses = stub.Draft(iter([draft_pb.DraftRequest(start=start)]), timeout=30)
            assert len(list(responses)) == 1
