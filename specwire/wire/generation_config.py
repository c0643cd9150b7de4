"""GenerationConfig <-> `specwire.config.v1.GenerationConfig` proto.

The conversion is driven by the proto descriptor, so adding a field to the .proto (with the
transformers name) is all it takes: each field's wire type decides how it maps to the
`generation_config.json` value (optional scalar, enum, id-or-list, list messages, JSON-like Struct).

Free-form dicts (`watermarking_config`, `cache_config`, `compile_config`, `extra`, ...) travel as
`google.protobuf.Struct`, whose numbers are doubles: integral numbers come back as `int`, so a
`bias` of `2.0` reads back as `2` (equal in Python and in JSON loaders, noted for exactness).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2
from google.protobuf.descriptor import FieldDescriptor

from specwire.config.v1 import generation_config_pb2 as pb
from specwire.errors import InvalidArgument
from specwire.generation.config import GenerationConfig
from specwire.generation.config.constraint_data import constraint_parts

_EARLY_STOPPING_TO_VALUE: dict[int, bool | str] = {
    pb.EARLY_STOPPING_TRUE: True,
    pb.EARLY_STOPPING_FALSE: False,
    pb.EARLY_STOPPING_NEVER: "never",
}


class WireFormatError(ValueError):
    """A config value that the wire format cannot carry (e.g. an id list with a non-integer)."""

    def __init__(self, field: str, value: Any, message: str):
        super().__init__(f"{field}={value!r}: {message}")
        self.field = field
        self.value = value
        self.message = message


def _json_number(value: Any) -> Any:
    """Struct numbers are doubles: give integral ones back as ints, recursively."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_json_number(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_number(v) for k, v in value.items()}
    return value


def json_value(value: struct_pb2.Value) -> Any:
    """A Struct `Value` as Python, integral numbers as ints. Unlike `json_format.MessageToDict`, NaN and
    infinities come back as floats instead of raising (a stored config holding one must stay readable)."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        return _json_number(value.number_value)
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return {key: json_value(item) for key, item in value.struct_value.fields.items()}
    if kind == "list_value":
        return [json_value(item) for item in value.list_value.values]
    return None  # null_value, or no kind set


def _message_to_value(field: FieldDescriptor, msg: Any) -> Any:
    kind = field.message_type.full_name
    if kind == "specwire.common.v1.TokenIdOrList":
        return msg.id if msg.WhichOneof("value") == "id" else list(msg.ids.ids)
    if kind == "specwire.common.v1.StringOrList":
        return msg.text if msg.WhichOneof("value") == "text" else list(msg.texts.values)
    if kind == "specwire.common.v1.TokenIdList":
        return list(msg.ids)
    if kind == "specwire.common.v1.TokenSequenceList":
        return [list(s.ids) for s in msg.sequences]
    if kind == "specwire.config.v1.SequenceBiasList":
        return [[list(e.sequence), e.bias] for e in msg.entries]
    if kind == "specwire.config.v1.ExponentialDecayLengthPenalty":
        return [msg.start_index, msg.decay_factor]
    if kind == "google.protobuf.Struct":
        return {key: json_value(value) for key, value in msg.fields.items()}
    if kind == "google.protobuf.ListValue":
        return [json_value(value) for value in msg.values]
    if kind == "google.protobuf.Value":
        return json_value(msg)
    raise TypeError(f"no wire mapping for message field {field.name} ({kind})")


def _int_list(field: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise WireFormatError(field, value, "expected a list of integer token ids")
    return list(value)


def _fill_message(field: FieldDescriptor, target: Any, value: Any) -> None:
    name = field.name
    kind = field.message_type.full_name
    if kind == "specwire.common.v1.TokenIdOrList":
        if isinstance(value, int) and not isinstance(value, bool):
            target.id = value
        else:
            target.ids.ids.extend(_int_list(name, value))
    elif kind == "specwire.common.v1.StringOrList":
        if isinstance(value, str):
            target.text = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            target.texts.values.extend(value)
        else:
            raise WireFormatError(name, value, "expected a string or a list of strings")
    elif kind == "specwire.common.v1.TokenIdList":
        target.ids.extend(_int_list(name, value))
        target.SetInParent()
    elif kind == "specwire.common.v1.TokenSequenceList":
        if not isinstance(value, (list, tuple)):
            raise WireFormatError(name, value, "expected a list of token-id lists")
        for row in value:
            target.sequences.add().ids.extend(_int_list(name, row))
        target.SetInParent()
    elif kind == "specwire.config.v1.SequenceBiasList":
        items = value.items() if isinstance(value, dict) else value
        try:
            for sequence, bias in items:
                entry = target.entries.add()
                entry.sequence.extend(_int_list(name, sequence))
                entry.bias = float(bias)
        except (TypeError, ValueError, OverflowError) as exc:
            raise WireFormatError(name, value, "expected [[token ids], bias] pairs") from exc
        target.SetInParent()
    elif kind == "specwire.config.v1.ExponentialDecayLengthPenalty":
        try:
            start, factor = value
            target.start_index = int(start)
            target.decay_factor = float(factor)
        except (TypeError, ValueError, OverflowError) as exc:
            raise WireFormatError(name, value, "expected (start_index, decay_factor)") from exc
    elif kind == "google.protobuf.Struct":
        if not isinstance(value, dict):
            raise WireFormatError(name, value, "expected a JSON object")
        target.update(value)
    elif kind == "google.protobuf.ListValue":
        if not isinstance(value, (list, tuple)):
            raise WireFormatError(name, value, "expected a JSON list")
        target.extend(value)
    elif kind == "google.protobuf.Value":
        target.CopyFrom(json_format.ParseDict(value, struct_pb2.Value()))
    else:
        raise TypeError(f"no wire mapping for message field {name} ({kind})")


def dict_from_proto(message: pb.GenerationConfig) -> dict[str, Any]:
    """The set fields of a proto config as a `generation_config.json`-style dict."""
    out: dict[str, Any] = {}
    typed = message.DESCRIPTOR.fields_by_name
    for field, value in message.ListFields():
        if field.name == "extra":
            extra = _message_to_value(field, value)
            # `extra` carries keys the message has no field for. A typed field's name there would slip
            # past its wire type (a list for `top_k`, an id past int32), and the config could not be
            # sent back: `dict_to_proto` never writes those keys to `extra`.
            for key in extra:
                if key in typed and key != "extra":  # a JSON key "extra" is an extra key like any other
                    raise WireFormatError(
                        f"extra.{key}", extra[key], f"`{key}` has its own field: set it there, not in `extra`"
                    )
            out.update(extra)
        elif field.type == FieldDescriptor.TYPE_ENUM:
            if field.name != "early_stopping":
                raise TypeError(f"no wire mapping for enum field {field.name}")
            if value not in _EARLY_STOPPING_TO_VALUE:
                # An enum value this build doesn't know (a newer client, or a hand-built message).
                raise WireFormatError(
                    field.name,
                    value,
                    "unknown EarlyStopping value; use EARLY_STOPPING_TRUE, EARLY_STOPPING_FALSE or "
                    "EARLY_STOPPING_NEVER",
                )
            out[field.name] = _EARLY_STOPPING_TO_VALUE[value]
        elif field.name == "typed_constraints":
            if message.HasField("constraints"):
                raise WireFormatError(
                    "typed_constraints", None, "set constraints or typed_constraints, not both (they are one field)"
                )
            out["constraints"] = [_constraint_value(item) for item in value.items]
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            out[field.name] = _message_to_value(field, value)
        else:
            out[field.name] = value
    return out


def _constraint_value(item: Any) -> dict[str, Any]:
    """A typed `Constraint` as the plain data `GenerationConfig.constraints` holds."""
    if item.WhichOneof("kind") == "disjunctive":
        return {"type": "disjunctive", "token_ids": [list(s.ids) for s in item.disjunctive.sequences]}
    return {"type": "phrasal", "token_ids": list(item.phrasal.ids)}


def _typed_constraints(value: Any) -> pb.ConstraintList | None:
    """`constraints` as typed messages, or `None` when one item is not a well-formed constraint (it then
    travels as JSON, and validation refuses it with the field and the fix)."""
    if not isinstance(value, (list, tuple)) or not value:  # [] keeps its presence as JSON
        return None
    typed = pb.ConstraintList()
    for item in value:
        parts = constraint_parts(item)
        ids = parts[1] if parts else None
        try:
            if parts and parts[0] == "phrasal":
                typed.items.add().phrasal.ids.extend(_int_list("constraints", ids))
            elif parts:
                sequences = typed.items.add().disjunctive
                for row in ids if isinstance(ids, (list, tuple)) else [None]:
                    sequences.sequences.add().ids.extend(_int_list("constraints", row))
            else:
                return None
        except (WireFormatError, ValueError, OverflowError):
            return None
    return typed


def dict_to_proto(values: dict[str, Any]) -> pb.GenerationConfig:
    """A `generation_config.json`-style dict as a proto; unknown keys go to `extra`."""
    message = pb.GenerationConfig()
    fields = pb.GenerationConfig.DESCRIPTOR.fields_by_name
    extra: dict[str, Any] = {}
    for name, value in values.items():
        field = fields.get(name)
        if field is None or name == "extra":
            extra[name] = value
            continue
        if value is None:
            continue
        if name == "constraints" and (typed := _typed_constraints(value)) is not None:
            message.typed_constraints.CopyFrom(typed)
            continue
        if field.type == FieldDescriptor.TYPE_ENUM:
            if value is True:
                message.early_stopping = pb.EARLY_STOPPING_TRUE
            elif value is False:
                message.early_stopping = pb.EARLY_STOPPING_FALSE
            elif value == "never":
                message.early_stopping = pb.EARLY_STOPPING_NEVER
            else:
                raise WireFormatError(name, value, 'early_stopping must be True, False or "never"')
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            _fill_message(field, getattr(message, name), value)
        else:
            try:
                setattr(message, name, value)
            except (TypeError, ValueError, OverflowError) as exc:
                raise WireFormatError(name, value, f"expected a {_SCALAR_NAMES.get(field.type, 'scalar')}") from exc
    if extra:
        message.extra.update(extra)
    return message


_SCALAR_NAMES = {
    FieldDescriptor.TYPE_BOOL: "boolean",
    FieldDescriptor.TYPE_INT32: "32-bit integer",
    FieldDescriptor.TYPE_INT64: "64-bit integer",
    FieldDescriptor.TYPE_DOUBLE: "number",
    FieldDescriptor.TYPE_STRING: "string",
}


def config_to_proto(config: GenerationConfig) -> pb.GenerationConfig:
    """Our GenerationConfig as the wire message (set fields only)."""
    return dict_to_proto(config.to_dict())


def config_to_proto_or_invalid(config: GenerationConfig, field: str) -> pb.GenerationConfig:
    """`config_to_proto`, with a value the wire can't carry reported as INVALID_ARGUMENT on `field.<name>`.

    A config read from JSON (ImportConfig) can hold values transformers' validation lets through but the
    proto can't represent (an id past int32, a list where a number goes); refusing them before storing
    keeps every stored config readable (GetConfig, the target's references).
    """
    try:
        return config_to_proto(config)
    except WireFormatError as exc:
        raise InvalidArgument.for_field(
            f"{field}.{exc.field}", exc.value, f"{exc.message}: the wire format can't carry it; fix or drop it"
        ) from exc
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument.for_field(field, None, f"the wire format can't carry this config: {exc}") from exc


def config_from_proto(message: pb.GenerationConfig) -> GenerationConfig:
    """The wire message as our GenerationConfig (unset stays unset)."""
    return GenerationConfig.from_dict(dict_from_proto(message))
