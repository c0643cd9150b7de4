"""Registry names, tags and references (`name`, `name@VERSION`, `name:TAG`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from specwire.errors import InvalidArgument

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
TAG_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,63}$")
RESERVED_TAGS = {"latest"}


def check_name(name: str, field: str = "name") -> str:
    if not NAME_RE.match(name or ""):
        raise InvalidArgument.for_field(
            field,
            name,
            "a config name is 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (e.g. 'chat-default')",
        )
    return name


def check_tag(tag: str, field: str = "tag") -> str:
    if not TAG_RE.match(tag or "") or tag in RESERVED_TAGS:
        raise InvalidArgument.for_field(
            field,
            tag,
            "a tag is 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter, "
            "and not 'latest' (e.g. 'prod')",
        )
    return tag


@dataclass(frozen=True)
class ConfigRef:
    """A parsed reference: a name plus at most one of a version and a tag."""

    name: str
    version: int | None = None
    tag: str | None = None

    @classmethod
    def parse(cls, ref: str, field: str = "ref") -> ConfigRef:
        """Parse `name`, `name@VERSION` or `name:TAG` (`name:latest` is the latest version)."""
        if "@" in ref:
            name, _, version = ref.partition("@")
            if not version.isdigit() or int(version) < 1:
                raise InvalidArgument.for_field(
                    field, ref, "the version after '@' is a whole number >= 1, e.g. 'chat@3'"
                )
            return cls(check_name(name, field), version=int(version))
        if ":" in ref:
            name, _, tag = ref.partition(":")
            if tag == "latest":
                return cls(check_name(name, field))
            return cls(check_name(name, field), tag=check_tag(tag, field))
        return cls(check_name(ref, field))
