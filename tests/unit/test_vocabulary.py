"""One vocabulary on every side: the names of `specwire.vocabulary` match the wire's enums, the
stopping criteria's codes and what the services, the client and `specwire stats` use."""

from __future__ import annotations

import ast
from pathlib import Path

from specwire import vocabulary as v
from specwire.common.v1 import common_pb2
from specwire.target.v1 import target_service_pb2
from specwire.wire.common import FINISH_REASON_FROM_PROTO, FINISH_REASON_TO_PROTO
from specwire.wire.proposers import PROPOSER_FROM_PROTO, PROPOSER_TO_PROTO

ROOT = Path(__file__).resolve().parents[2]


def test_every_proposer_has_its_wire_value_and_back():
    wire = {name for name in target_service_pb2.Proposer.keys() if name != "PROPOSER_UNSPECIFIED"}
    assert {f"PROPOSER_{name.upper()}" for name in v.PROPOSERS} == wire
    for name in v.PROPOSERS:
        assert PROPOSER_FROM_PROTO[PROPOSER_TO_PROTO[name]] == name
    assert target_service_pb2.PROPOSER_UNSPECIFIED not in PROPOSER_FROM_PROTO


def test_every_finish_reason_has_its_wire_value_and_back():
    wire = {name for name in common_pb2.FinishReason.keys() if name != "FINISH_REASON_UNSPECIFIED"}
    names = (*v.FINISH_REASONS, v.FINISH_CANCELLED)
    assert {f"FINISH_REASON_{name.upper()}" for name in names} == wire
    for name in names:
        assert FINISH_REASON_FROM_PROTO[FINISH_REASON_TO_PROTO[name]] == name
    assert common_pb2.FINISH_REASON_UNSPECIFIED not in FINISH_REASON_FROM_PROTO


def test_finish_reason_codes_are_the_wire_numbers_and_name_the_reasons():
    for code in v.FinishReason:
        wire_name = "FINISH_REASON_UNSPECIFIED" if code is v.FinishReason.NONE else f"FINISH_REASON_{code.name}"
        assert common_pb2.FinishReason.Value(wire_name) == int(code)
    assert set(v.FINISH_REASON_NAMES) == set(v.FinishReason) - {v.FinishReason.NONE}
    assert sorted(v.FINISH_REASON_NAMES.values()) == sorted(v.FINISH_REASONS)
    for code, name in v.FINISH_REASON_NAMES.items():
        assert FINISH_REASON_TO_PROTO[name] == int(code)


def test_vocabulary_needs_only_the_standard_library():
    tree = ast.parse((ROOT / "specwire" / "vocabulary.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported <= {"__future__", "collections", "enum", "types", "typing"}, imported


def _string_constants(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_metric_and_proposer_names_are_spelled_only_in_the_vocabulary():
    """The exporter, the client's `stats` reader and the proposer choices import the names instead of
    repeating them (a renamed metric used to need the same edit in two places)."""
    metrics = {value for name, value in vars(v).items() if name.startswith("METRIC_")}
    proposers = set(v.PROPOSERS) - {v.PROPOSER_NONE}  # "none" is also a model name ("--model none")
    users = [
        "specwire/target_service/observability.py",
        "specwire/target_service/drafting.py",
        "specwire/target_service/service.py",
        "specwire/target_service/__main__.py",
        "specwire/client/stats.py",
        "specwire/client/cli/generate.py",
        "specwire/client/cli/local_stack.py",
        "specwire/client/target_client.py",
    ]
    for user in users:
        repeated = _string_constants(ROOT / user) & (metrics | proposers)
        assert not repeated, f"{user} spells {sorted(repeated)}: import them from specwire.vocabulary"
