"""`specwire.config.v1.ConfigService`: the registry of named, versioned GenerationConfigs.

Strict on write: a config transformers would refuse is rejected with INVALID_ARGUMENT and one
field violation per problem; transformers' "minor issues" are stored as warnings and returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from specwire.config.v1 import config_service_pb2 as pb
from specwire.config.v1 import config_service_pb2_grpc as pb_grpc
from specwire.config_service.refs import ConfigRef, check_name, check_tag
from specwire.config_service.storage import (
    HistoryEntry,
    RegistryStore,
    StoredConfig,
    decode_history_token,
    decode_page_token,
)
from specwire.errors import FieldProblem, InvalidArgument, NotFound, Unavailable
from specwire.generation.config import GenerationConfig, raise_for_errors, unknown_keys
from specwire.pools import eager_thread_pool
from specwire.security.identity import current_caller
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
# A generation config is a few hundred bytes; the caps leave room for long bias/bad-word lists and
# stop strings while keeping parsing and validation of one request in the milliseconds.
DEFAULT_MAX_CONFIG_BYTES = 256 * 1024
DEFAULT_MAX_EXTRA_BYTES = 16 * 1024


def parse_config(values: dict[str, Any], field: str = "config") -> GenerationConfig:
    """A dict as our GenerationConfig, with bad shapes reported as INVALID_ARGUMENT on `field`."""
    try:
        return GenerationConfig.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument.for_field(field, values, f"not a valid GenerationConfig: {exc}") from exc


def config_violations(config: GenerationConfig, strict: bool = False, allow_custom: bool = False) -> list[Any]:
    """transformers' validation, plus a warning per unknown key unless custom entries are meant."""
    violations = config.validate() + ([] if allow_custom else unknown_keys(config))
    if strict:
        violations = [dataclasses.replace(v, severity="error") for v in violations]
    return violations


def checked_config(
    config: GenerationConfig, field: str = "config", strict: bool = False, allow_custom: bool = False
) -> list[dict[str, Any]]:
    """Validate; raise INVALID_ARGUMENT on errors, return the warnings as storable dicts."""
    violations = config_violations(config, strict, allow_custom)
    raise_for_errors(violations, field_prefix=f"{field}.", summary="invalid GenerationConfig")
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


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def record_to_proto(record: StoredConfig) -> pb.ConfigRecord:
    created = _timestamp(record.created_at)
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
        author=record.author,
    )


def history_entry_to_proto(entry: HistoryEntry) -> pb.ConfigHistoryEntry:
    message = pb.ConfigHistoryEntry(time=_timestamp(entry.at), author=entry.author)
    if entry.kind == "version":
        message.version.version = entry.version or 0
        if entry.deleted_at is not None:
            message.version.deleted = True
            message.version.delete_time.CopyFrom(_timestamp(entry.deleted_at))
            message.version.deleted_by = entry.deleted_by or ""
    else:
        message.tag_move.tag = entry.tag
        if entry.old_version is not None:
            message.tag_move.old_version = entry.old_version
        if entry.new_version is not None:
            message.tag_move.new_version = entry.new_version
    return message


def _page_size(page_size: int) -> int:
    if page_size < 0 or page_size > MAX_PAGE_SIZE:
        raise InvalidArgument.for_field("page_size", page_size, f"use 1-{MAX_PAGE_SIZE}, or 0 for {DEFAULT_PAGE_SIZE}")
    return page_size or DEFAULT_PAGE_SIZE


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    for key in labels:
        if not key or len(key) > 128:
            raise InvalidArgument.for_field("labels", key, "label keys are 1-128 characters")
    return dict(labels)


class ConfigServicer(pb_grpc.ConfigServiceServicer):
    """The ConfigService RPCs over a registry store.

    Every write records its author: `current_caller()` is read in the RPC's coroutine, where the
    server's authorization set it (a context variable does not reach the storage threads).

    Args:
        store (`RegistryStore`): the registry's database (SQLite or PostgreSQL).
        max_config_bytes (`int`, defaults to 256 KiB): size of one config (its wire form, or the JSON text
            of ImportConfig); a bigger one is refused with INVALID_ARGUMENT before it is parsed
            (`--max-config-bytes`).
        max_extra_bytes (`int`, defaults to 16 KiB): size of a config's `extra` (custom entries)
            (`--max-extra-bytes`).
        workers (`int`, defaults to 2): threads that parse and validate configs off the event loop.
    """

    def __init__(
        self,
        store: RegistryStore,
        max_config_bytes: int = DEFAULT_MAX_CONFIG_BYTES,
        max_extra_bytes: int = DEFAULT_MAX_EXTRA_BYTES,
        workers: int = 2,
    ):
        self.store = store
        self.max_config_bytes = max_config_bytes
        self.max_extra_bytes = max_extra_bytes
        # Parsing and validating a config costs CPU in proportion to its lists: a pool of its own keeps it
        # off the event loop (health checks, other calls) without queueing behind SQLite calls.
        self.checker = eager_thread_pool(workers, "specwire-config-check")
        # SQLite calls are short but blocking: off the event loop, on threads of their own (asyncio's
        # default executor grows a thread at a time under load, which reads as a leak in the soak).
        self.storage_calls = eager_thread_pool(2, "specwire-config-db")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.storage_calls, fn, *args)

    async def _check(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.checker, fn, *args)

    def _check_size(self, message: Any, field: str = "config") -> None:
        """Refuse an oversized config before parsing it (`ByteSize` is computed by protobuf, not us)."""
        size = message.ByteSize()
        if size > self.max_config_bytes:
            raise InvalidArgument.for_field(
                field,
                f"{size} bytes",
                f"a config holds at most {self.max_config_bytes} bytes on this registry (--max-config-bytes): "
                "shorten its lists (bad_words_ids, sequence_bias, stop_strings) or its extra entries",
            )
        if message.HasField("extra") and message.extra.ByteSize() > self.max_extra_bytes:
            raise InvalidArgument.for_field(
                f"{field}.extra",
                f"{message.extra.ByteSize()} bytes",
                f"custom entries hold at most {self.max_extra_bytes} bytes on this registry (--max-extra-bytes)",
            )

    def _check_extra(self, config: GenerationConfig, field: str = "config") -> None:
        size = len(json.dumps(config.extra, default=str)) if config.extra else 0
        if size > self.max_extra_bytes:
            raise InvalidArgument.for_field(
                f"{field}.extra",
                f"{size} bytes",
                f"custom entries hold at most {self.max_extra_bytes} bytes on this registry (--max-extra-bytes)",
            )

    def _parsed(
        self, message: Any, field: str = "config", strict: bool = False, allow_custom: bool = False
    ) -> tuple[GenerationConfig, list[dict[str, Any]]]:
        """Parse and validate (blocking: runs on `self.checker`)."""
        config = _config_from_request(message, field)
        return config, checked_config(config, field, strict, allow_custom)

    def _parsed_values(self, values: dict[str, Any]) -> tuple[GenerationConfig, list[dict[str, Any]]]:
        config = parse_config(values)
        self._check_extra(config)
        return config, checked_config(config)

    def _validated(self, message: Any, strict: bool, allow_custom: bool) -> list[Any]:
        return config_violations(_config_from_request(message), strict, allow_custom)

    @handles_errors
    async def CreateConfig(self, request: pb.CreateConfigRequest, context) -> pb.CreateConfigResponse:
        name = check_name(request.name)
        self._check_size(request.config)
        config, warnings = await self._check(
            self._parsed, request.config, "config", request.strict, request.allow_custom
        )
        author = current_caller()
        record = await self._run(
            self.store.create, name, config.to_dict(), _check_labels(request.labels), warnings, author
        )
        log.info("created %s@%d (by %s)", name, record.version, author)
        return pb.CreateConfigResponse(record=record_to_proto(record))

    @handles_errors
    async def GetConfig(self, request: pb.GetConfigRequest, context) -> pb.GetConfigResponse:
        ref = ConfigRef.parse(request.ref)
        record = await self._run(self.store.get, ref.name, ref.version, ref.tag)
        return pb.GetConfigResponse(record=record_to_proto(record))

    @handles_errors
    async def UpdateConfig(self, request: pb.UpdateConfigRequest, context) -> pb.UpdateConfigResponse:
        name = check_name(request.name)
        self._check_size(request.config)
        config, warnings = await self._check(
            self._parsed, request.config, "config", request.strict, request.allow_custom
        )
        expected = request.expected_version if request.HasField("expected_version") else None
        labels = _check_labels(request.labels) if request.labels else None
        author = current_caller()
        record = await self._run(self.store.add_version, name, config.to_dict(), labels, warnings, expected, author)
        log.info("updated %s -> version %d (by %s)", name, record.version, author)
        return pb.UpdateConfigResponse(record=record_to_proto(record))

    @handles_errors
    async def ListConfigs(self, request: pb.ListConfigsRequest, context) -> pb.ListConfigsResponse:
        page_size = _page_size(request.page_size)
        after = decode_page_token(request.page_token) if request.page_token else ""
        records, next_token = await self._run(self.store.list, request.prefix, page_size, after)
        return pb.ListConfigsResponse(records=[record_to_proto(r) for r in records], next_page_token=next_token)

    @handles_errors
    async def DeleteConfig(self, request: pb.DeleteConfigRequest, context) -> pb.DeleteConfigResponse:
        name = check_name(request.name)
        expected = request.expected_version if request.HasField("expected_version") else None
        author = current_caller()
        count = await self._run(self.store.delete, name, expected, author)
        log.info("deleted %s (%d versions, by %s)", name, count, author)
        return pb.DeleteConfigResponse(deleted_versions=count)

    @handles_errors
    async def SetTag(self, request: pb.SetTagRequest, context) -> pb.SetTagResponse:
        name = check_name(request.name)
        tag = check_tag(request.tag)
        if request.version < 1:
            raise InvalidArgument.for_field("version", request.version, "versions start at 1")
        author = current_caller()
        record = await self._run(self.store.set_tag, name, tag, request.version, author)
        log.info("tagged %s:%s -> version %d (by %s)", name, tag, request.version, author)
        return pb.SetTagResponse(record=record_to_proto(record))

    @handles_errors
    async def DeleteTag(self, request: pb.DeleteTagRequest, context) -> pb.DeleteTagResponse:
        name = check_name(request.name)
        tag = check_tag(request.tag)
        author = current_caller()
        version = await self._run(self.store.delete_tag, name, tag, author)
        log.info("untagged %s:%s (was version %d, by %s)", name, tag, version, author)
        return pb.DeleteTagResponse(version=version)

    @handles_errors
    async def ValidateConfig(self, request: pb.ValidateConfigRequest, context) -> pb.ValidateConfigResponse:
        self._check_size(request.config)
        violations = await self._check(self._validated, request.config, request.strict, request.allow_custom)
        return pb.ValidateConfigResponse(
            valid=not any(v.severity == "error" for v in violations),
            violations=[violation_to_proto(v, prefix="config.") for v in violations],
        )

    @handles_errors
    async def ImportConfig(self, request: pb.ImportConfigRequest, context) -> pb.ImportConfigResponse:
        source = request.WhichOneof("source")
        if source == "hub":
            text = await self._run(read_hub_file, request.hub.repo_id, request.hub.revision, request.hub.filename)
            default_name = request.hub.repo_id.replace("/", "--")
        elif source == "json":
            text, default_name = request.json, ""
        else:
            raise InvalidArgument.for_field("source", None, "set either `hub` (repo_id, revision, filename) or `json`")
        if len(text) > self.max_config_bytes:  # before parsing: the size of the work is the size of the text
            raise InvalidArgument.for_field(
                source,
                f"{len(text)} characters",
                f"a config holds at most {self.max_config_bytes} bytes on this registry (--max-config-bytes)",
            )
        values = parse_json_document(text, source)  # malformed or over-deep JSON: INVALID_ARGUMENT
        if not isinstance(values, dict):
            raise InvalidArgument.for_field(source, text[:200], "a generation_config.json holds a JSON object")
        name = check_name(request.name or default_name)
        config, warnings = await self._check(self._parsed_values, values)
        config_to_proto_or_invalid(config, source)  # stored configs must be readable over the wire
        labels = _check_labels(request.labels)
        author = current_caller()
        # A new version of a live name; else a new config (after a delete, its numbering continues).
        try:
            record = await self._run(
                self.store.add_version, name, config.to_dict(), labels or None, warnings, None, author
            )
        except NotFound:
            record = await self._run(self.store.create, name, config.to_dict(), labels, warnings, author)
        log.info("imported %s@%d from %s", name, record.version, source)
        return pb.ImportConfigResponse(record=record_to_proto(record))

    @handles_errors
    async def ExportConfig(self, request: pb.ExportConfigRequest, context) -> pb.ExportConfigResponse:
        ref = ConfigRef.parse(request.ref)
        record = await self._run(self.store.get, ref.name, ref.version, ref.tag)
        text = GenerationConfig.from_dict(record.config).to_json_string()
        return pb.ExportConfigResponse(json=text, name=record.name, version=record.version)

    @handles_errors
    async def ListConfigHistory(self, request: pb.ListConfigHistoryRequest, context) -> pb.ListConfigHistoryResponse:
        name = check_name(request.name)
        page_size = _page_size(request.page_size)
        after = decode_history_token(request.page_token) if request.page_token else None
        entries, next_token = await self._run(self.store.history, name, page_size, after)
        return pb.ListConfigHistoryResponse(
            entries=[history_entry_to_proto(e) for e in entries], next_page_token=next_token
        )


def read_hub_file(repo_id: str, revision: str = "", filename: str = "") -> str:
    """Read a file of a Hub repo through huggingface_hub (its cache serves it with HF_HUB_OFFLINE=1)."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import hf_hub_download

    if not repo_id:
        raise InvalidArgument.for_field("hub.repo_id", repo_id, "name a Hub repo, e.g. 'HuggingFaceTB/SmolLM2-135M'")
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
