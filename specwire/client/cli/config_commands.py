"""`specwire config ...`: the config registry's commands (create, get, list, update, delete, tag, validate,
import, export, history, untag) and their parsers."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import Any

from .common import (
    ADDRESS_FORMS,
    DEFAULT_CONFIG_TIMEOUT_S,
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    add_command,
    add_load_balancing_option,
    add_retries_option,
    add_token_option,
    connected,
    parse_assignments,
    read_source,
)


def _config_from_args(args) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if getattr(args, "file", None):
        try:
            config.update(json.loads(read_source(args.file)))
        except ValueError as exc:
            raise UsageError(f"{args.file} is not a JSON object: {exc}") from None
    config.update(parse_assignments(getattr(args, "set", None)))
    return config


def _print_record(record, as_json: bool = False) -> None:
    if as_json:
        print(
            json.dumps(
                {
                    "name": record.name,
                    "version": record.version,
                    "latest_version": record.latest_version,
                    "author": record.author,
                    "created_at": _iso(record.created_at),
                    "tags": record.tags,
                    "labels": record.labels,
                    "config": record.config.to_dict(),
                    "warnings": [w.__dict__ for w in record.warnings],
                },
                indent=2,
            )
        )
        return
    tags = f"  tags: {', '.join(record.tags)}" if record.tags else ""
    author = f"  by {record.author}" if record.author else ""
    print(f"{record.name}@{record.version} (latest {record.latest_version}){tags}{author}")
    print(json.dumps(record.config.to_dict(), indent=2, sort_keys=True))
    for w in record.warnings:
        print(f"warning: {w.field}: {w.message}", file=sys.stderr)


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _print_history(history, as_json: bool = False) -> None:
    """A config's history newest first: a table (TIME, AUTHOR, EVENT), or JSON with `--as-json`."""
    if as_json:
        entries = []
        for e in history.entries:
            entry = {"kind": e.kind, "time": _iso(e.time), "author": e.author}
            if e.kind == "version":
                entry.update(
                    version=e.version, deleted=e.deleted, deleted_at=_iso(e.deleted_at), deleted_by=e.deleted_by
                )
            else:
                entry.update(tag=e.tag, old_version=e.old_version, new_version=e.new_version)
            entries.append(entry)
        print(json.dumps({"name": history.name, "entries": entries}, indent=2))
        return
    rows = []
    for e in history.entries:
        if e.kind == "version":
            event = f"version {e.version}"
            if e.deleted:
                event += f" (deleted {_iso(e.deleted_at)} by {e.deleted_by})"
        else:
            old = "-" if e.old_version is None else e.old_version
            new = "removed" if e.new_version is None else e.new_version
            event = f"tag {e.tag}: {old} -> {new}"
        rows.append((_iso(e.time) or "", e.author, event))
    width = max([len("AUTHOR")] + [len(r[1]) for r in rows])
    print(f"{'TIME':<20}  {'AUTHOR':<{width}}  EVENT")
    for time, author, event in rows:
        print(f"{time:<20}  {author:<{width}}  {event}")


def config_command(args) -> int:
    """Run one `specwire config` subcommand; the exit code."""
    from specwire.client import ConfigClient

    # The token is SPECWIRE_AUTH_TOKEN (not a flag: a command line is visible to every user of the machine).
    with connected(ConfigClient, args) as client:
        cmd = args.config_command
        if cmd == "create":
            record = client.create(
                args.name,
                _config_from_args(args),
                parse_assignments(args.label, "--label"),
                strict=args.strict,
                allow_custom=args.allow_custom,
            )
            _print_record(record, args.as_json)
        elif cmd == "get":
            _print_record(client.get(args.ref), args.as_json)
        elif cmd == "list":
            for record in client.iter(args.prefix):
                tags = f" [{', '.join(record.tags)}]" if record.tags else ""
                print(f"{record.name}@{record.version}{tags}")
        elif cmd == "update":
            record = client.update(
                args.name,
                _config_from_args(args),
                args.expected_version,
                strict=args.strict,
                allow_custom=args.allow_custom,
            )
            _print_record(record, args.as_json)
        elif cmd == "delete":
            print(f"deleted {client.delete(args.name, args.expected_version)} version(s) of {args.name}")
        elif cmd == "tag":
            _print_record(client.set_tag(args.name, args.tag, args.version), args.as_json)
        elif cmd == "untag":
            version = client.delete_tag(args.name, args.tag)
            print(f"removed {args.name}:{args.tag} (it pointed at version {version})")
        elif cmd == "validate":
            result = client.validate(_config_from_args(args), strict=args.strict, allow_custom=args.allow_custom)
            for v in result.violations:
                print(f"{v.severity}: {v.field} = {v.value}: {v.message}")
            print("valid" if result.valid else "invalid")
            return EXIT_OK if result.valid else EXIT_FAILED
        elif cmd == "import":
            if args.hub:
                record = client.import_from_hub(args.hub, args.revision, args.filename, args.name)
            else:
                if not args.file or not args.name:
                    raise UsageError("specwire config import needs --hub REPO, or --file FILE with --name NAME")
                record = client.import_json(read_source(args.file), args.name)
            _print_record(record, args.as_json)
        elif cmd == "export":
            print(client.export(args.ref))
        elif cmd == "history":
            _print_history(client.history(args.name), args.as_json)
    return EXIT_OK


def add_config_parser(sub: Any) -> None:
    """Register `specwire config` and its subcommands on the CLI's subparsers."""
    cfg = add_command(sub, "config", help="the config registry")
    cfg.add_argument("--address", default="127.0.0.1:50051", help=f"config service: {ADDRESS_FORMS}")
    cfg.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_CONFIG_TIMEOUT_S,
        help="deadline of each registry call in seconds, 0 for none",
    )
    add_retries_option(cfg)
    add_token_option(cfg)
    add_load_balancing_option(cfg)
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    p = add_command(cfg_sub, "create", help="store a new named config (version 1)")
    p.add_argument("name")
    _config_source(p)
    p.add_argument("--label", action="append", metavar="KEY=VALUE", help="a label stored with the config")
    _checks(p)
    _json_flag(p)
    p = add_command(cfg_sub, "get", help="show name, name@VERSION or name:TAG")
    p.add_argument("ref")
    _json_flag(p)
    p = add_command(cfg_sub, "list", help="list configs (latest versions)")
    p.add_argument("--prefix", default="", help="only names starting with this")
    p = add_command(cfg_sub, "update", help="store a new version")
    p.add_argument("name")
    _config_source(p)
    p.add_argument("--expected-version", type=int, default=None, help="fail unless the latest version is this one")
    _checks(p)
    _json_flag(p)
    p = add_command(
        cfg_sub,
        "delete",
        help="delete a config: its versions become tombstones, their numbers are never reused",
    )
    p.add_argument("name")
    p.add_argument("--expected-version", type=int, default=None, help="fail unless the latest version is this one")
    p = add_command(cfg_sub, "tag", help="point NAME:TAG at VERSION")
    p.add_argument("name")
    p.add_argument("tag")
    p.add_argument("version", type=int)
    _json_flag(p)
    p = add_command(cfg_sub, "untag", help="remove NAME:TAG (kept in the history)")
    p.add_argument("name")
    p.add_argument("tag")
    p = add_command(cfg_sub, "validate", help="check a config without storing it")
    _config_source(p)
    _checks(p)
    p = add_command(cfg_sub, "import", help="import a generation_config.json from the Hub or a file")
    p.add_argument("--hub", help="Hub repo id (offline: read from the local Hugging Face cache)")
    p.add_argument("--revision", default="main", help="Hub revision")
    p.add_argument("--filename", default="generation_config.json", help="file in the Hub repo")
    p.add_argument("--file", default=None, help="a local generation_config.json ('-' for stdin)")
    p.add_argument("--json", dest="file", default=None, help=argparse.SUPPRESS, action=_DeprecatedFile)
    p.add_argument("--name", default=None, help="registry name (default: the Hub repo's)")
    _json_flag(p)
    p = add_command(cfg_sub, "export", help="print a version as generation_config.json")
    p.add_argument("ref")
    p = add_command(
        cfg_sub, "history", help="versions (deleted ones too) and tag moves of NAME, with who and when, newest first"
    )
    p.add_argument("name")
    _json_flag(p)


def _config_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", default=None, help="a generation_config.json file ('-' for stdin)")
    # `--json` meant the input file here and the output format for `generate`; kept for one release.
    p.add_argument("--json", dest="file", default=None, help=argparse.SUPPRESS, action=_DeprecatedFile)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="field value (JSON or text)")


def _checks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strict", action="store_true", help="warnings count as errors (unknown keys included)")
    p.add_argument(
        "--allow-custom",
        action="store_true",
        help="keys that are not GenerationConfig fields are meant (transformers' custom entries): no warning",
    )


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--as-json", dest="as_json", action="store_true", help="print the record as JSON")


class _DeprecatedFile(argparse.Action):
    """`--json FILE`, the old spelling of `--file FILE`: warns, then stores the file."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            "warning: `specwire config ... --json FILE` is now --file FILE (--json goes in a later release)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)
