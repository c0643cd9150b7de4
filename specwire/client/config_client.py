"""Clients of the config registry: `ConfigClient` (blocking) and `AsyncConfigClient` (asyncio).

Both take a config as our `GenerationConfig`, a `transformers.GenerationConfig` or a plain dict,
return `ConfigRecord`s, and raise `SpecwireRpcError` (with `.code()` and `.violations`) on failure.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from specwire.client.errors import Violation, raises_rpc_errors
from specwire.client.retrying import acall_with_retries, call_with_retries, check_retries
from specwire.config.v1 import config_service_pb2 as pb
from specwire.config.v1 import config_service_pb2_grpc as pb_grpc
from specwire.config.v1 import generation_config_pb2
from specwire.generation.config import GenerationConfig
from specwire.security.channels import secure_channel
from specwire.wire.generation_config import config_from_proto, dict_to_proto


@dataclass
class ConfigRecord:
    """One stored version of a named config."""

    name: str
    version: int
    config: GenerationConfig
    tags: list[str] = field(default_factory=list)
    warnings: list[Violation] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    latest_version: int = 0
    created_at: float = 0.0
    author: str = ""

    @classmethod
    def from_proto(cls, record: pb.ConfigRecord) -> ConfigRecord:
        return cls(
            name=record.name,
            version=record.version,
            config=config_from_proto(record.config),
            tags=list(record.tags),
            warnings=[Violation.from_proto(w) for w in record.warnings],
            labels=dict(record.labels),
            latest_version=record.latest_version,
            created_at=record.create_time.ToNanoseconds() / 1e9,
            author=record.author,
        )


@dataclass
class HistoryEntry:
    """One event of a config's history: a version written (`kind == "version"`; `deleted`, `deleted_at`,
    `deleted_by` once it is a tombstone) or a tag moved (`kind == "tag"`; `old_version` is None for a new
    tag, `new_version` None for a tag a delete removed)."""

    kind: str
    time: float
    author: str
    version: int | None = None
    deleted: bool = False
    deleted_at: float | None = None
    deleted_by: str = ""
    tag: str = ""
    old_version: int | None = None
    new_version: int | None = None

    @classmethod
    def from_proto(cls, entry: pb.ConfigHistoryEntry) -> HistoryEntry:
        time = entry.time.ToNanoseconds() / 1e9
        if entry.WhichOneof("event") == "version":
            v = entry.version
            deleted_at = v.delete_time.ToNanoseconds() / 1e9 if v.HasField("delete_time") else None
            return cls("version", time, entry.author, v.version, v.deleted, deleted_at, v.deleted_by)
        move = entry.tag_move
        return cls(
            "tag",
            time,
            entry.author,
            tag=move.tag,
            old_version=move.old_version if move.HasField("old_version") else None,
            new_version=move.new_version if move.HasField("new_version") else None,
        )


@dataclass
class ConfigHistory:
    """A config's history, newest first: `entries` in order, or split into `versions` and `tag_moves`."""

    name: str
    entries: list[HistoryEntry]

    @property
    def versions(self) -> list[HistoryEntry]:
        return [e for e in self.entries if e.kind == "version"]

    @property
    def tag_moves(self) -> list[HistoryEntry]:
        return [e for e in self.entries if e.kind == "tag"]


@dataclass
class ValidationResult:
    """What ValidateConfig said: `valid` and every violation (errors and warnings)."""

    valid: bool
    violations: list[Violation]


def config_to_wire(config: Any) -> generation_config_pb2.GenerationConfig:
    """Our GenerationConfig, a transformers GenerationConfig, a dict, or a proto, as the wire message."""
    if isinstance(config, generation_config_pb2.GenerationConfig):
        return config
    if config is None:
        return generation_config_pb2.GenerationConfig()
    if isinstance(config, dict):
        return dict_to_proto(GenerationConfig.from_dict(config).to_dict())
    if isinstance(config, GenerationConfig):
        return dict_to_proto(config.to_dict())
    if type(config).__name__ == "GenerationConfig" and hasattr(config, "to_diff_dict"):
        return dict_to_proto(GenerationConfig.from_transformers(config).to_dict())
    raise TypeError(
        f"config must be a specwire or transformers GenerationConfig or a dict, not {type(config).__name__}"
    )


class _Requests:
    """Request builders shared by the blocking and asyncio clients."""

    @staticmethod
    def create(name, config, labels=None, strict=False, allow_custom=False):
        return pb.CreateConfigRequest(
            name=name, config=config_to_wire(config), labels=labels or {}, strict=strict, allow_custom=allow_custom
        )

    @staticmethod
    def update(name, config, expected_version=None, labels=None, strict=False, allow_custom=False):
        return pb.UpdateConfigRequest(
            name=name,
            config=config_to_wire(config),
            expected_version=expected_version,
            labels=labels or {},
            strict=strict,
            allow_custom=allow_custom,
        )

    @staticmethod
    def import_from_hub(repo_id, revision="main", filename="generation_config.json", name=None, labels=None):
        return pb.ImportConfigRequest(
            name=name or "",
            hub=pb.HubSource(repo_id=repo_id, revision=revision, filename=filename),
            labels=labels or {},
        )

    @staticmethod
    def import_json(text, name, labels=None):
        return pb.ImportConfigRequest(name=name, json=text, labels=labels or {})


class ConfigClient:
    """Blocking client of `specwire.config.v1.ConfigService`.

    Args:
        address (`str`): the config service: any gRPC target (`host:port`, `dns:///name:port`,
            `ipv4:a.b.c.d:port,e.f.g.h:port`, ...).
        timeout (`float`, defaults to 30.0): per-call deadline in seconds.
        channel (`grpc.Channel`, *optional*): an existing channel to use instead of `address`.
        retries (`int`, defaults to 0): how many times a call the registry refused for load
            (RESOURCE_EXHAUSTED with a retry hint, before any work) is sent again after the hinted wait,
            within `timeout`. 0: never.
        token (`str`, *optional*): bearer token sent with every call (the reader token for reads, the admin
            token for writes); default `SPECWIRE_AUTH_TOKEN`; "" sends none.
        allow_insecure_token (`bool`, *optional*): send the token in plaintext to a non-loopback address
            (refused otherwise: set `SPECWIRE_TLS_CA_FILE`); default `SPECWIRE_ALLOW_INSECURE_TOKEN`.
        load_balancing (`str`, *optional*): `"round_robin"` (each call to the next ready address) or
            `"pick_first"` (every call to one address); default `round_robin` for `dns:///` targets and
            address lists, `pick_first` for one `host:port`.
    """

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout: float = 30.0,
        channel: grpc.Channel | None = None,
        retries: int = 0,
        *,
        token: str | None = None,
        allow_insecure_token: bool | None = None,
        load_balancing: str | None = None,
    ):
        self.retries = check_retries(retries)
        self._own_channel = channel is None
        self.channel = channel or secure_channel(
            address, token=token, allow_insecure_token=allow_insecure_token, load_balancing=load_balancing
        )
        self.stub = pb_grpc.ConfigServiceStub(self.channel)
        self.timeout = timeout

    def _call(self, method, request):
        """`method(request)` within the client's timeout, retried after load refusals (`retries`)."""
        return call_with_retries(lambda left: method(request, timeout=left), self.retries, self.timeout)

    def close(self) -> None:
        if self._own_channel:
            self.channel.close()

    def __enter__(self) -> ConfigClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @raises_rpc_errors
    def create(
        self,
        name: str,
        config: Any,
        labels: dict[str, str] | None = None,
        *,
        strict: bool = False,
        allow_custom: bool = False,
    ) -> ConfigRecord:
        """Store `config` as version 1 of `name`.

        Keys that are not GenerationConfig fields are stored with a warning (a typo, most likely);
        `allow_custom=True` stores them on purpose, `strict=True` refuses any warning.
        """
        request = _Requests.create(name, config, labels, strict, allow_custom)
        response = self._call(self.stub.CreateConfig, request)
        return ConfigRecord.from_proto(response.record)

    @raises_rpc_errors
    def get(self, ref: str) -> ConfigRecord:
        """Read `name` (latest), `name@VERSION` or `name:TAG`."""
        return ConfigRecord.from_proto(self._call(self.stub.GetConfig, pb.GetConfigRequest(ref=ref)).record)

    @raises_rpc_errors
    def update(
        self,
        name: str,
        config: Any,
        expected_version: int | None = None,
        labels: dict[str, str] | None = None,
        *,
        strict: bool = False,
        allow_custom: bool = False,
    ) -> ConfigRecord:
        """Store a new version; with `expected_version`, fail with ABORTED if someone else updated first."""
        request = _Requests.update(name, config, expected_version, labels, strict, allow_custom)
        response = self._call(self.stub.UpdateConfig, request)
        return ConfigRecord.from_proto(response.record)

    @raises_rpc_errors
    def list_page(self, prefix: str = "", page_size: int = 0, page_token: str = "") -> tuple[list[ConfigRecord], str]:
        """One page of the latest versions, by name, and the next page's token ("" on the last)."""
        request = pb.ListConfigsRequest(prefix=prefix, page_size=page_size, page_token=page_token)
        response = self._call(self.stub.ListConfigs, request)
        return [ConfigRecord.from_proto(r) for r in response.records], response.next_page_token

    def iter(self, prefix: str = "", page_size: int = 0) -> Iterator[ConfigRecord]:
        """Every latest version whose name starts with `prefix`, fetching page by page."""
        token = ""
        while True:
            records, token = self.list_page(prefix, page_size, token)
            yield from records
            if not token:
                return

    def list(self, prefix: str = "") -> list[ConfigRecord]:
        """All latest versions whose name starts with `prefix`, by name."""
        return list(self.iter(prefix))

    @raises_rpc_errors
    def delete(self, name: str, expected_version: int | None = None) -> int:
        """Delete `name` with all its versions; returns how many versions were deleted."""
        request = pb.DeleteConfigRequest(name=name, expected_version=expected_version)
        return self._call(self.stub.DeleteConfig, request).deleted_versions

    @raises_rpc_errors
    def set_tag(self, name: str, tag: str, version: int) -> ConfigRecord:
        """Point `name:tag` at `version`."""
        request = pb.SetTagRequest(name=name, tag=tag, version=version)
        return ConfigRecord.from_proto(self._call(self.stub.SetTag, request).record)

    @raises_rpc_errors
    def delete_tag(self, name: str, tag: str) -> int:
        """Remove `name:tag`; returns the version it pointed at (the removal stays in the history)."""
        request = pb.DeleteTagRequest(name=name, tag=tag)
        return self._call(self.stub.DeleteTag, request).version

    @raises_rpc_errors
    def validate(self, config: Any, strict: bool = False, *, allow_custom: bool = False) -> ValidationResult:
        """Check a config without storing it."""
        request = pb.ValidateConfigRequest(config=config_to_wire(config), strict=strict, allow_custom=allow_custom)
        response = self._call(self.stub.ValidateConfig, request)
        return ValidationResult(response.valid, [Violation.from_proto(v) for v in response.violations])

    @raises_rpc_errors
    def import_from_hub(
        self,
        repo_id: str,
        revision: str = "main",
        filename: str = "generation_config.json",
        name: str | None = None,
    ) -> ConfigRecord:
        """Import a Hub repo's generation_config.json (through huggingface_hub on the server)."""
        request = _Requests.import_from_hub(repo_id, revision, filename, name)
        return ConfigRecord.from_proto(self._call(self.stub.ImportConfig, request).record)

    @raises_rpc_errors
    def import_json(self, text: str, name: str, labels: dict[str, str] | None = None) -> ConfigRecord:
        """Import `generation_config.json` text as `name` (a new config or a new version)."""
        request = _Requests.import_json(text, name, labels)
        return ConfigRecord.from_proto(self._call(self.stub.ImportConfig, request).record)

    @raises_rpc_errors
    def export(self, ref: str) -> str:
        """`generation_config.json` text of a version, loadable by transformers."""
        return self._call(self.stub.ExportConfig, pb.ExportConfigRequest(ref=ref)).json

    @raises_rpc_errors
    def history_page(
        self, name: str, page_size: int = 0, page_token: str = ""
    ) -> tuple[builtins.list[HistoryEntry], str]:
        """One page of `name`'s history, newest first, and the next page's token ("" on the last)."""
        request = pb.ListConfigHistoryRequest(name=name, page_size=page_size, page_token=page_token)
        response = self._call(self.stub.ListConfigHistory, request)
        return [HistoryEntry.from_proto(e) for e in response.entries], response.next_page_token

    def history(self, name: str) -> ConfigHistory:
        """Every version (deleted ones included) and tag move of `name`, with who and when, newest first."""
        entries, token = self.history_page(name)
        while token:
            page, token = self.history_page(name, 0, token)
            entries += page
        return ConfigHistory(name, entries)


class AsyncConfigClient:
    """asyncio client of `specwire.config.v1.ConfigService`; same methods as `ConfigClient`, awaitable.

    Args:
        address (`str`): the config service: any gRPC target, as `ConfigClient`'s.
        timeout (`float`, defaults to 30.0): per-call deadline in seconds.
        retries (`int`, defaults to 0): as `ConfigClient`'s.
        token (`str`, *optional*): bearer token sent with every call; default `SPECWIRE_AUTH_TOKEN`.
        allow_insecure_token (`bool`, *optional*): see `ConfigClient`.
        load_balancing (`str`, *optional*): see `ConfigClient`.
    """

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout: float = 30.0,
        retries: int = 0,
        *,
        token: str | None = None,
        allow_insecure_token: bool | None = None,
        load_balancing: str | None = None,
    ):
        self.retries = check_retries(retries)
        self.channel = secure_channel(
            address,
            aio=True,
            token=token,
            allow_insecure_token=allow_insecure_token,
            load_balancing=load_balancing,
        )
        self.stub = pb_grpc.ConfigServiceStub(self.channel)
        self.timeout = timeout

    async def _call(self, method, request):
        return await acall_with_retries(lambda left: method(request, timeout=left), self.retries, self.timeout)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncConfigClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @raises_rpc_errors
    async def create(
        self,
        name: str,
        config: Any,
        labels: dict[str, str] | None = None,
        *,
        strict: bool = False,
        allow_custom: bool = False,
    ) -> ConfigRecord:
        request = _Requests.create(name, config, labels, strict, allow_custom)
        response = await self._call(self.stub.CreateConfig, request)
        return ConfigRecord.from_proto(response.record)

    @raises_rpc_errors
    async def get(self, ref: str) -> ConfigRecord:
        response = await self._call(self.stub.GetConfig, pb.GetConfigRequest(ref=ref))
        return ConfigRecord.from_proto(response.record)

    @raises_rpc_errors
    async def update(
        self,
        name: str,
        config: Any,
        expected_version: int | None = None,
        labels: dict[str, str] | None = None,
        *,
        strict: bool = False,
        allow_custom: bool = False,
    ) -> ConfigRecord:
        request = _Requests.update(name, config, expected_version, labels, strict, allow_custom)
        return ConfigRecord.from_proto((await self._call(self.stub.UpdateConfig, request)).record)

    @raises_rpc_errors
    async def list_page(
        self, prefix: str = "", page_size: int = 0, page_token: str = ""
    ) -> tuple[list[ConfigRecord], str]:
        request = pb.ListConfigsRequest(prefix=prefix, page_size=page_size, page_token=page_token)
        response = await self._call(self.stub.ListConfigs, request)
        return [ConfigRecord.from_proto(r) for r in response.records], response.next_page_token

    async def list(self, prefix: str = "") -> list[ConfigRecord]:
        records, token = await self.list_page(prefix)
        while token:
            page, token = await self.list_page(prefix, 0, token)
            records += page
        return records

    @raises_rpc_errors
    async def delete(self, name: str, expected_version: int | None = None) -> int:
        request = pb.DeleteConfigRequest(name=name, expected_version=expected_version)
        return (await self._call(self.stub.DeleteConfig, request)).deleted_versions

    @raises_rpc_errors
    async def set_tag(self, name: str, tag: str, version: int) -> ConfigRecord:
        request = pb.SetTagRequest(name=name, tag=tag, version=version)
        return ConfigRecord.from_proto((await self._call(self.stub.SetTag, request)).record)

    @raises_rpc_errors
    async def delete_tag(self, name: str, tag: str) -> int:
        request = pb.DeleteTagRequest(name=name, tag=tag)
        return (await self._call(self.stub.DeleteTag, request)).version

    @raises_rpc_errors
    async def validate(self, config: Any, strict: bool = False, *, allow_custom: bool = False) -> ValidationResult:
        request = pb.ValidateConfigRequest(config=config_to_wire(config), strict=strict, allow_custom=allow_custom)
        response = await self._call(self.stub.ValidateConfig, request)
        return ValidationResult(response.valid, [Violation.from_proto(v) for v in response.violations])

    @raises_rpc_errors
    async def import_from_hub(
        self,
        repo_id: str,
        revision: str = "main",
        filename: str = "generation_config.json",
        name: str | None = None,
    ) -> ConfigRecord:
        request = _Requests.import_from_hub(repo_id, revision, filename, name)
        return ConfigRecord.from_proto((await self._call(self.stub.ImportConfig, request)).record)

    @raises_rpc_errors
    async def import_json(self, text: str, name: str, labels: dict[str, str] | None = None) -> ConfigRecord:
        request = _Requests.import_json(text, name, labels)
        return ConfigRecord.from_proto((await self._call(self.stub.ImportConfig, request)).record)

    @raises_rpc_errors
    async def export(self, ref: str) -> str:
        return (await self._call(self.stub.ExportConfig, pb.ExportConfigRequest(ref=ref))).json

    @raises_rpc_errors
    async def history_page(
        self, name: str, page_size: int = 0, page_token: str = ""
    ) -> tuple[builtins.list[HistoryEntry], str]:
        request = pb.ListConfigHistoryRequest(name=name, page_size=page_size, page_token=page_token)
        response = await self._call(self.stub.ListConfigHistory, request)
        return [HistoryEntry.from_proto(e) for e in response.entries], response.next_page_token

    async def history(self, name: str) -> ConfigHistory:
        entries, token = await self.history_page(name)
        while token:
            page, token = await self.history_page(name, 0, token)
            entries += page
        return ConfigHistory(name, entries)
