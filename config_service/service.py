"""`specwire.config.v1.ConfigService`: the registry of named, versioned GenerationConfigs.

Strict on write: a config transformers would refuse is rejected with INVALID_ARGUMENT and one
field violation per problem; transformers' "minor issues" are stored as warnings and returned.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from config_service.refs import ConfigRef, check_name, check_tag
from config_service.storage import ConfigStore, StoredConfig, decode_page_token
from specwire.config.v1 import config_service_pb2 as pb
from specwire.config.v1 import config_service_pb2_grpc as pb_grpc
from specwire.errors import FieldProblem, InvalidArgument, NotFound, Unavailable
from specwire.generation.config import GenerationConfig
from specwire.serving import handles_errors
from specwire.wire.common import violation_to_proto
from specwire.wire.generation_config import (
    WireFormatError,
    config_to_proto,
    config_to_proto_or_invalid,
    dict_from_proto,
)
from specwire.wire.json_documents import parse_json_document

log = logging.getLogger("specwire.config_service")

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100


def parse_config(values: dict[str, Any], field: str = "config") -> GenerationConfig:
    """A dict as our GenerationConfig, with bad shapes reported as INVALID_ARGUMENT on `field`."""
    try:
        return GenerationConfig.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument.for_field(field, values, f"not a valid GenerationConfig: {exc}") from exc


def checked_config(
    config: GenerationConfig, field: str = "config", strict: bool = False
) -> list[dict[str, Any]]:
    """Validate; raise INVALID_ARGUMENT on errors, return the warnings as storable dicts."""
    violations = config.validate(strict=strict)
    errors = [v for v in violations if v.severity == "error"]
    if errors:
        problems = [FieldProblem(f"{field}.{v.field}", v.value, v.message) for v in errors]
        summary = "; ".join(f"{p.field}={p.value!r}: {p.message}" for p in problems)
        raise InvalidArgument(f"invalid GenerationConfig: {summary}", problems)
    return [
        {"field": f"{field}.{v.field}", "value": v.value, "message": v.message, "severity": "warning"}
        for v in violations
        if v.severity == "warning"
    ]


def _config_from_request(message: Any, field: str = "config") -> GenerationConfig:
    try:
        return parse_config(dict_from_proto(message), field)
    except WireFormatError as exc:
        raise InvalidArgument.for_field(f"{field}.{exc.field}", exc.value, exc.message) from exc


def record_to_proto(record: StoredConfig) -> pb.ConfigRecord:
    created = Timestamp()
    created.FromNanoseconds(int(record.created_at * 1e9))
    warnings = [violation_to_proto(FieldProblem(**w)) for w in record.warnings]
    return pb.ConfigRecord(
        name=record.name,
        version=record.version,
        config=config_to_proto(GenerationConfig.from_dict(record.config)),
        labels=record.labels,
        tags=record.tags,
        warnings=warnings,
        create_time=created,
        latest_version=record.latest_version,
    )


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    for key in labels:
        if not key or len(key) > 128:
            raise InvalidArgument.for_field("labels", key, "label keys are 1-128 characters")
    return dict(labels)


class ConfigServicer(pb_grpc.ConfigServiceServicer):
    """The ConfigService RPCs over a `ConfigStore`.

    Args:
        store (`ConfigStore`): the SQLite registry.
    """

    def __init__(self, store: ConfigStore):
        self.store = store

    async def _run(self, fn, *args):
        # SQLite calls are short but blocking: keep them off the event loop.
        return await asyncio.to_thread(fn, *args)

    @handles_errors
    async def CreateConfig(self, request: pb.CreateConfigRequest, context) -> pb.CreateConfigResponse:
        name = check_name(request.name)
        config = _config_from_request(request.config)
        warnings = checked_config(config)
        record = await self._run(
            self.store.create, name, config.to_dict(), _check_labels(request.labels), warnings
        )
        log.info("created %s@1", name)
        return pb.CreateConfigResponse(record=record_to_proto(record))

    @handles_errors
    async def GetConfig(self, request: pb.GetConfigRequest, context) -> pb.GetConfigResponse:
        ref = ConfigRef.parse(request.ref)
        record = await self._run(self.store.get, ref.name, ref.version, ref.tag)
        return pb.GetConfigResponse(record=record_to_proto(record))

    @handles_errors
    async def UpdateConfig(self, request: pb.UpdateConfigRequest, context) -> pb.UpdateConfigResponse:
        name = check_name(request.name)
        config = _config_from_request(request.config)
        warnings = checked_config(config)
        expected = request.expected_version if request.HasField("expected_version") else None
        labels = _check_labels(request.labels) if request.labels else None
        record = await self._run(self.store.add_version, name, config.to_dict(), labels, warnings, expected)
        log.info("updated %s -> version %d", name, record.version)
        return pb.UpdateConfigResponse(record=record_to_proto(record))

    @handles_errors
    async def ListConfigs(self, request: pb.ListConfigsRequest, context) -> pb.ListConfigsResponse:
        if request.page_size < 0 or request.page_size > MAX_PAGE_SIZE:
            raise InvalidArgument.for_field(
                "page_size", request.page_size, f"use 1-{MAX_PAGE_SIZE}, or 0 for {DEFAULT_PAGE_SIZE}"
            )
        after = decode_page_token(request.page_token) if request.page_token else ""
        records, next_token = await self._run(
            self.store.list, request.prefix, request.page_size or DEFAULT_PAGE_SIZE, after
        )
        return pb.ListConfigsResponse(
            records=[record_to_proto(r) for r in records], next_page_token=next_token
        )

    @handles_errors
    async def DeleteConfig(self, request: pb.DeleteConfigRequest, context) -> pb.DeleteConfigResponse:
        name = check_name(request.name)
        expected = request.expected_version if request.HasField("expected_version") else None
        count = await self._run(self.store.delete, name, expected)
        log.info("deleted %s (%d versions)", name, count)
        return pb.DeleteConfigResponse(deleted_versions=count)

    @handles_errors
    async def SetTag(self, request: pb.SetTagRequest, context) -> pb.SetTagResponse:
        name = check_name(request.name)
        tag = check_tag(request.tag)
        if request.version < 1:
            raise InvalidArgument.for_field("version", request.version, "versions start at 1")
        record = await self._run(self.store.set_tag, name, tag, request.version)
        return pb.SetTagResponse(record=record_to_proto(record))

    @handles_errors
    async def ValidateConfig(self, request: pb.ValidateConfigRequest, context) -> pb.ValidateConfigResponse:
        config = _config_from_request(request.config)
        violations = config.validate(strict=request.strict)
        return pb.ValidateConfigResponse(
            valid=not any(v.severity == "error" for v in violations),
            violations=[violation_to_proto(v, prefix="config.") for v in violations],
        )

    @handles_errors
    async def ImportConfig(self, request: pb.ImportConfigRequest, context) -> pb.ImportConfigResponse:
        source = request.WhichOneof("source")
        if source == "hub":
            text = await self._run(
                read_hub_file, request.hub.repo_id, request.hub.revision, request.hub.filename
            )
            default_name = request.hub.repo_id.replace("/", "--")
        elif source == "json":
            text, default_name = request.json, ""
        else:
            raise InvalidArgument.for_field(
                "source", None, "set either `hub` (repo_id, revision, filename) or `json`"
            )
        values = parse_json_document(text, source)  # malformed or over-deep JSON: INVALID_ARGUMENT
        if not isinstance(values, dict):
            raise InvalidArgument.for_field(
                source, text[:200], "a generation_config.json holds a JSON object"
            )
        name = check_name(request.name or default_name)
        config = parse_config(values)
        warnings = checked_config(config)
        config_to_proto_or_invalid(config, source)  # stored configs must be readable over the wire
        labels = _check_labels(request.labels)
        try:
            record = await self._run(self.store.add_version, name, config.to_dict(), labels or None, warnings)
        except NotFound:
            record = await self._run(self.store.create, name, config.to_dict(), labels, warnings)
        log.info("imported %s@%d from %s", name, record.version, source)
        return pb.ImportConfigResponse(record=record_to_proto(record))

    @handles_errors
    async def ExportConfig(self, request: pb.ExportConfigRequest, context) -> pb.ExportConfigResponse:
        ref = ConfigRef.parse(request.ref)
        record = await self._run(self.store.get, ref.name, ref.version, ref.tag)
        text = GenerationConfig.from_dict(record.config).to_json_string()
        return pb.ExportConfigResponse(json=text, name=record.name, version=record.version)


def read_hub_file(repo_id: str, revision: str = "", filename: str = "") -> str:
    """Read a file of a Hub repo through huggingface_hub (its cache serves it with HF_HUB_OFFLINE=1)."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import hf_hub_download

    if not repo_id:
        raise InvalidArgument.for_field(
            "hub.repo_id", repo_id, "name a Hub repo, e.g. 'HuggingFaceTB/SmolLM2-135M'"
        )
    filename = filename or "generation_config.json"
    try:
        path = hf_hub_download(repo_id, filename, revision=revision or "main")
    except hub_errors.HFValidationError as exc:
        raise InvalidArgument.for_field("hub.repo_id", repo_id, f"not a valid repo id: {exc}") from exc
    # Checked first: in huggingface_hub a cache miss is also an EntryNotFoundError.
    except hub_errors.LocalEntryNotFoundError as exc:
        raise Unavailable(
            f"{repo_id}@{revision or 'main'}/{filename} is not in the local Hub cache and the Hub cannot be "
            f"reached (HF_HUB_OFFLINE or no network): {exc}"
        ) from exc
    except (
        hub_errors.RepositoryNotFoundError,
        hub_errors.RevisionNotFoundError,
        hub_errors.EntryNotFoundError,
    ) as exc:
        raise NotFound(f"{repo_id}@{revision or 'main'}/{filename} not found on the Hub: {exc}") from exc
    with open(path, encoding="utf-8") as f:
        return f.read()
