"""10. Structured output (issue #22): JSON-schema requests on the target, with and without the mask.

- validity: `requests` chat prompts spread over four JSON schemas (100 in a full run); every output
  must parse and validate against its schema (a small validator for the keywords these schemas use);
- speed: tokens/s of the same prompts constrained and free (greedy, no speculation);
- speculation: a schema-copying prompt (a record to return with one change), constrained, with and
  without prompt lookup: same tokens, and prompt lookup should be faster;
- mask cost: every constrained output replayed here through specwire's own mask processor
  (`StructuredOutputLogitsProcessor`, the target's) on the model's vocabulary, per token, against the
  free decode step (1 / free tokens/s).

Targets (issue #22 item 4): the mask costs <= 10% of a free decode step; constrained + prompt lookup is
faster than constrained alone on the schema-copying prompt. `readme_table` is the README's table (also
printed at the end of the workload and written into results.md). Quick mode (`--quick`): one request per
schema, 64 new tokens at most, a smoke run of the same measurements.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from bench.progress import log
from bench.reference import Run
from bench.target import speculation_unavailable
from bench.workload_context import (
    PROMPT_LOOKUP_TOKENS,
    Context,
    SpeculationUnavailable,
    alternate,
    check_entry,
    workload_result,
)

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 60},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "price": {"type": "number", "minimum": 0},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        },
        "required": ["title", "price", "in_stock", "tags"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "city": {"type": "string", "maxLength": 30},
            "kind": {"enum": ["concert", "talk", "match", "fair"]},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["title", "city", "kind", "year"],
        "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 60},
            # An integer: a number in [0, 1] lets SmolLM2 write 0.9999... until max_new_tokens (a JSON
            # Schema cannot bound the digits of a number, so neither can the grammar).
            "confidence_percent": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence_percent"],
        "additionalProperties": False,
    },
}
SUBJECTS = {
    "person": ["a chef", "a pilot", "a painter", "a nurse", "a teacher"],
    "product": ["a lamp", "a backpack", "a kettle", "a bicycle", "a phone case"],
    "event": ["a jazz concert", "a science talk", "a football match", "a book fair", "a food festival"],
    "answer": ["the capital of Italy", "the boiling point of water", "the largest ocean", "2 + 2", "a color"],
}
COPY_RECORD = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}
COPY_PROMPT = (
    "Here is a record:\n"
    + json.dumps(COPY_RECORD, separators=(",", ":"))
    + "\nReturn the same record as JSON with the age increased by one."
)


def _valid(value: Any, schema: dict) -> bool:
    """`value` against the keywords the schemas above use (type, properties, required, enum, bounds...)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or not set(schema["required"]) <= set(value):
            return False
        if schema.get("additionalProperties") is False and not set(value) <= set(schema["properties"]):
            return False
        return all(_valid(value[key], schema["properties"][key]) for key in value)
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema.get("maxItems", len(value))
            and all(_valid(item, schema["items"]) for item in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind in ("integer", "number"):
        types = (int,) if kind == "integer" else (int, float)
        if not isinstance(value, types) or isinstance(value, bool):
            return False
        return schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return False


def parses_and_validates(text: str, schema: dict) -> bool:
    try:
        return _valid(json.loads(text), schema)
    except ValueError:
        return False


PHRASINGS = [
    "Describe {subject} as a JSON object with the fields {fields}.",
    "Invent {subject} and return it as JSON with {fields}.",
    "Write a JSON record ({fields}) for {subject}.",
    "Give me {subject} in JSON: {fields}.",
    "Return one JSON object about {subject}, with {fields}.",
]


def _requests(count: int) -> list[tuple[str, str]]:
    """(schema name, prompt text), round-robin over the schemas; 25 distinct prompts per schema."""
    names = list(SCHEMAS)
    out = []
    for i in range(count):
        name = names[i % len(names)]
        k = i // len(names)
        subjects = SUBJECTS[name]
        phrasing = PHRASINGS[(k // len(subjects)) % len(PHRASINGS)]
        fields = ", ".join(SCHEMAS[name]["properties"])
        out.append((name, phrasing.format(subject=subjects[k % len(subjects)], fields=fields)))
    return out


def _mask_cost_us(ctx: Context, outputs: list[tuple[str, list[int], int]]) -> float | None:
    """Mean microseconds per token of the target's mask processor, replaying the constrained outputs."""
    from specwire.generation.planning import resolved_eos_token_ids

    loaded = ctx.reference.loaded
    eos = resolved_eos_token_ids(loaded.generation_config) or [loaded.tokenizer.eos_token_id]
    scores = torch.zeros(1, loaded.vocab_size)
    # The target runs a request's processors on its request thread with one torch thread; so does this
    # replay (with the process's threads, it would measure OpenMP waking workers on a busy machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spent, tokens = _replay(outputs, loaded, eos, scores)
    finally:
        torch.set_num_threads(threads)
    return spent / tokens * 1e6 if tokens else None


def _replay(
    outputs: list[tuple[str, list[int], int]], loaded: Any, eos: list[int], scores: torch.Tensor
) -> tuple[float, int]:
    """Seconds spent in the mask processor and tokens masked, over every output."""
    from specwire.generation.structured import (
        StructuredOutput,
        StructuredOutputLogitsProcessor,
        compile_structured_output,
    )

    spent, tokens = 0.0, 0
    for name, sequence, prompt_length in outputs:
        spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))
        processor = StructuredOutputLogitsProcessor(
            compile_structured_output(spec, loaded.tokenizer, loaded.vocab_size, eos), prompt_length
        )
        for end in range(prompt_length, len(sequence)):
            ids = torch.tensor([sequence[:end]])
            started = time.perf_counter()
            processor(ids, scores)
            spent += time.perf_counter() - started
            tokens += 1
    return spent, tokens


def structured(ctx: Context) -> dict:
    """10. JSON-schema requests: validity, tokens/s with and without the mask and with prompt lookup."""
    count = len(SCHEMAS) if ctx.quick else 100
    max_new = 64 if ctx.quick else max(ctx.max_new_tokens, 96)
    client = ctx.specwire.client
    base = {"max_new_tokens": max_new, "proposer": "none", "do_sample": False}
    encode = ctx.reference.encode  # the chat template when the tokenizer has one, as the service applies it
    valid, outputs, constrained, free = 0, [], [], []
    failures: list[dict] = []
    for i, (name, prompt) in enumerate(_requests(count)):
        started = time.perf_counter()
        ids = [encode(prompt)]
        out = client.generate(ids, structured_output={"json_schema": SCHEMAS[name]}, **base)
        seconds = time.perf_counter() - started
        new = out.sequences.shape[1] - out.prompt_length
        constrained.append(Run(seconds, new, out.sequences[0].tolist()))
        outputs.append((name, out.sequences[0].tolist(), out.prompt_length))
        if parses_and_validates(out.text[0], SCHEMAS[name]):
            valid += 1
        else:
            failures.append({"schema": name, "finish_reason": out.finish_reasons[0], "text": out.text[0]})
        if i < (2 if ctx.quick else 2 * len(SCHEMAS)):  # free text on a subset: same prompts, same lengths
            started = time.perf_counter()
            out = client.generate(ids, min_new_tokens=new, **{**base, "max_new_tokens": new})
            free.append(Run(time.perf_counter() - started, out.sequences.shape[1] - out.prompt_length, []))
    log(f"  structured: {valid}/{count} outputs parse and validate against their schema")

    copy_args = {**base, "structured_output": {"json_schema": SCHEMAS["person"]}}
    plain_sequence: list[list[int]] = []

    def copy_run(**extra) -> Run:
        started = time.perf_counter()
        out = client.generate([encode(COPY_PROMPT)], **{**copy_args, **extra})
        if extra:
            why = speculation_unavailable(out)
            if why:
                raise SpeculationUnavailable(why)
        sequence = out.sequences[0].tolist()
        if not extra:
            plain_sequence[:] = [sequence]
        return Run(time.perf_counter() - started, out.sequences.shape[1] - out.prompt_length, sequence)

    runs, unavailable = alternate(
        ctx,
        {
            "constrained_copy": copy_run,
            "constrained_copy_prompt_lookup": lambda: copy_run(
                proposer="prompt_lookup", prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS
            ),
        },
        "structured",
    )
    same = bool(plain_sequence) and all(
        run.sequence == plain_sequence[0] for run in runs["constrained_copy_prompt_lookup"]
    )
    mask_us = _mask_cost_us(ctx, outputs)
    free_tps = sorted(run.tokens_per_second for run in free)[len(free) // 2] if free else None
    step_us = 1e6 / free_tps if free_tps else None
    result = workload_result(
        "Structured output, JSON schemas",
        {"requests": count, "schemas": list(SCHEMAS), "max_new_tokens": max_new, "greedy": True},
        0,
        {"constrained": constrained, "free": free, **runs},
        unavailable,
        [
            check_entry(
                "every JSON-schema output parses and validates against its schema",
                valid == count,
                f"{valid}/{count}",
            ),
            check_entry("constrained + prompt lookup gives constrained greedy's tokens", same, "schema-copying prompt"),
        ],
        valid=valid,
        requests=count,
        failures=failures,
        mask_us_per_token=mask_us,
        free_step_us=step_us,
        mask_overhead=None if mask_us is None or step_us is None else mask_us / step_us,
    )
    result["notes"] = [
        f"mask: {mask_us:.0f} us per token (the target's processor replayed in the benchmark process) against a "
        f"free decode step of {step_us / 1000:.1f} ms"
        if mask_us is not None and step_us is not None
        else "mask cost not measured"
    ]
    for line in readme_table(result):
        log(f"  {line}")
    return result


def readme_table(st: dict) -> list[str]:
    """The README's table of a `structured` result (Markdown lines), the two targets with their verdicts."""
    from bench.report import _fmt, _num
    from bench.stats import lookup, ratio

    s = st.get("series") or {}
    overhead = st.get("mask_overhead")
    tps = "tokens_per_second"
    speedup = ratio(lookup(s, "constrained_copy_prompt_lookup", tps), lookup(s, "constrained_copy", tps))

    def verdict(ok: bool | None) -> str:
        return {True: "met", False: "NOT met", None: "not measured"}[ok]

    return [
        "| measurement | value |",
        "|---|---|",
        f"| outputs that parse and validate against their schema | {st.get('valid')}/{st.get('requests')} "
        f"({len(SCHEMAS)} schemas) |",
        f"| tokens/s constrained | {_fmt(lookup(s, 'constrained', 'tokens_per_second'))} |",
        f"| tokens/s free (same prompts and lengths) | {_fmt(lookup(s, 'free', 'tokens_per_second'))} |",
        f"| tokens/s constrained, schema-copying prompt | {_fmt(lookup(s, 'constrained_copy', 'tokens_per_second'))} |",
        "| tokens/s constrained + prompt lookup, same prompt | "
        f"{_fmt(lookup(s, 'constrained_copy_prompt_lookup', 'tokens_per_second'))} |",
        f"| mask per token (us) | {_num(st.get('mask_us_per_token'), 0)} |",
        f"| mask / free decode step (target <= 10 %) | {_num(None if overhead is None else 100 * overhead, 2, ' %')}"
        f" ({verdict(None if overhead is None else overhead <= 0.1)}) |",
        f"| constrained + prompt lookup / constrained (target > 1x) | {_num(speedup, 2, 'x')}"
        f" ({verdict(None if speedup is None else speedup > 1.0)}) |",
    ]
