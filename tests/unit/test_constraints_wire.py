"""`constraints` on the wire: typed `Constraint` messages (phrasal / disjunctive), read back as plain data."""

from __future__ import annotations

import pytest

from specwire.config.v1 import generation_config_pb2 as pb
from specwire.generation.config import GenerationConfig
from specwire.wire.generation_config import WireFormatError, config_from_proto, config_to_proto, dict_from_proto

CONSTRAINTS = [{"type": "phrasal", "token_ids": [5, 6]}, {"type": "disjunctive", "token_ids": [[1], [2, 3]]}]


def test_constraints_travel_as_typed_messages():
    message = config_to_proto(GenerationConfig(num_beams=2, constraints=CONSTRAINTS))
    assert message.HasField("typed_constraints") and not message.HasField("constraints")
    first, second = message.typed_constraints.items
    assert list(first.phrasal.ids) == [5, 6]
    assert [list(s.ids) for s in second.disjunctive.sequences] == [[1], [2, 3]]
    assert config_from_proto(message).constraints == CONSTRAINTS


def test_the_short_form_reads_back_in_transformers_names():
    message = config_to_proto(GenerationConfig(num_beams=2, constraints=[{"phrasal": [7]}, {"disjunctive": [[8]]}]))
    assert message.HasField("typed_constraints")
    assert config_from_proto(message).constraints == [
        {"type": "phrasal", "token_ids": [7]},
        {"type": "disjunctive", "token_ids": [[8]]},
    ]


def test_data_that_is_no_constraint_travels_as_json_for_validation_to_refuse():
    message = config_to_proto(GenerationConfig(num_beams=2, constraints=[{"kind": "phrasal"}]))
    assert message.HasField("constraints") and not message.HasField("typed_constraints")
    assert config_from_proto(message).constraints == [{"kind": "phrasal"}]


def test_both_forms_at_once_are_refused():
    message = pb.GenerationConfig()
    message.typed_constraints.items.add().phrasal.ids.append(5)
    message.constraints.extend([{"phrasal": [6]}])
    with pytest.raises(WireFormatError) as caught:
        dict_from_proto(message)
    assert caught.value.field == "typed_constraints"
