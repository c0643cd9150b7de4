"""The wire's `specwire.target.v1.Proposer` enum <-> the proposer names of `specwire.vocabulary`."""

from __future__ import annotations

from specwire.target.v1 import target_service_pb2 as pb
from specwire.vocabulary import DRAFT_LENGTH_SOURCES, PROPOSERS

# Proposer name -> `Proposer` enum value, by the enum's naming rule (`PROPOSER_<NAME>`). The zero value,
# `PROPOSER_UNSPECIFIED`, has no name: the target then picks the proposer.
PROPOSER_TO_PROTO: dict[str, pb.Proposer] = {name: pb.Proposer.Value(f"PROPOSER_{name.upper()}") for name in PROPOSERS}
PROPOSER_FROM_PROTO: dict[int, str] = {value: name for name, value in PROPOSER_TO_PROTO.items()}
# Who chose the draft lengths -> `DraftLengthSource` (`DRAFT_LENGTH_SOURCE_<NAME>`), and back.
DRAFT_LENGTH_SOURCE_TO_PROTO: dict[str, pb.DraftLengthSource] = {
    name: pb.DraftLengthSource.Value(f"DRAFT_LENGTH_SOURCE_{name.upper()}") for name in DRAFT_LENGTH_SOURCES
}
DRAFT_LENGTH_SOURCE_FROM_PROTO: dict[int, str] = {value: name for name, value in DRAFT_LENGTH_SOURCE_TO_PROTO.items()}
