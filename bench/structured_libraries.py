"""Compares the structured-output libraries on this CPU with SmolLM2's tokenizer (issue #22, item 1).

For llguidance, xgrammar and outlines-core: the tokenizer set-up, the compile time of a few JSON
schemas and a regex (each library's own cache cleared or bypassed, so every spec compiles cold), and
the per-token mask time while a matcher walks a valid output token by token (the work a decode step
adds). Run: `python bench/structured_libraries.py [--repeats N]`; it prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "qty": {"type": "integer", "minimum": 1},
                        "price": {"type": "number"},
                    },
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
                "minItems": 1,
            },
            "status": {"enum": ["open", "paid", "shipped"]},
            "note": {"type": ["string", "null"]},
        },
        "required": ["id", "items", "status", "note"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "location": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "public": {"type": "boolean"},
        },
        "required": ["title", "tags", "location", "public"],
        "additionalProperties": False,
    },
}
OUTPUTS = {
    "person": '{"name": "Ada Lovelace", "age": 36}',
    "order": '{"id": "ABC-1234", "items": [{"sku": "pen-blue", "qty": 3, "price": 1.5}, '
    '{"sku": "notebook", "qty": 1, "price": 4.25}], "status": "paid", "note": null}',
    "event": '{"title": "Release party", "tags": ["music", "food"], "location": {"city": "Lyon", '
    '"lat": 45.76, "lon": 4.84}, "public": true}',
}
REGEX = r"(\+33|0)[1-9]( ?[0-9]{2}){4}"
REGEX_OUTPUT = "+336 12 34 56 78"


def smollm2_tokenizer() -> Any:
    """The embedded model's tokenizer, from the converted folder specwire caches (converting once if needed)."""
    from transformers import AutoTokenizer

    from specwire.models.default import default_gguf_path
    from specwire.models.gguf_cache import converted_folder

    folder = converted_folder(default_gguf_path(), report=lambda _line: None, progress=False)
    if folder is None:
        raise SystemExit("could not convert the embedded GGUF; run `python -m specwire.models.gguf_cache` first")
    return AutoTokenizer.from_pretrained(str(folder))


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.lib = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.words = (vocab + 31) // 32

    def compile(self, kind: str, spec: str) -> Any:
        M = self.lib.LLMatcher
        grammar = M.grammar_from_json_schema(spec) if kind == "json" else M.grammar_from_regex(spec)
        matcher = M(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def start(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def mask(self, state: Any, out: torch.Tensor) -> None:
        state.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def advance(self, state: Any, token: int) -> None:
        assert state.consume_token(token), state.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        if kind == "json":
            return self.compiler.compile_json_schema(spec, any_whitespace=True)
        return self.compiler.compile_regex(spec)

    def start(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def mask(self, state: Any, out: torch.Tensor) -> None:
        state.fill_next_token_bitmask(out.view(1, -1), 0)

    def advance(self, state: Any, token: int) -> None:
        assert state.accept_token(token)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies spell tokens with it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    printable += list(range(ord("\xae"), ord("\xff") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.lib = outlines_core
        self.regex_of_schema = build_regex_from_schema
        # Byte-level BPE: map each token's printable form back to its bytes (GPT-2's byte table).
        decoder = {c: b for b, c in _bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        special = set(tokenizer.all_special_ids)
        for piece, index in tokenizer.get_vocab().items():
            if index in special:
                continue
            raw = bytes(decoder[c] for c in piece) if all(c in decoder for c in piece) else piece.encode()
            tokens.setdefault(raw, []).append(index)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)

    def compile(self, kind: str, spec: str) -> Any:
        regex = self.regex_of_schema(spec, r"[ ]?") if kind == "json" else spec
        return self.lib.Index(regex, self.vocabulary)

    def start(self, compiled: Any) -> Any:
        return self.lib.Guide(compiled)

    def mask(self, state: Any, out: torch.Tensor) -> None:
        state.write_mask_into(out.data_ptr(), out.numel(), out.element_size())

    def advance(self, state: Any, token: int) -> None:
        state.advance(token)


def measure(lib_cls: type, tokenizer: Any, vocab: int, repeats: int) -> list[dict[str, Any]]:
    lib, setup_s = timed(lib_cls, tokenizer, vocab)
    rows = [{"library": lib.name, "what": "tokenizer set-up", "compile_ms": setup_s * 1e3, "mask_us": None}]
    cases = [("json", json.dumps(SCHEMAS[n]), OUTPUTS[n], f"schema {n}") for n in SCHEMAS]
    cases.append(("regex", REGEX, REGEX_OUTPUT, "regex phone"))
    for kind, spec, output, label in cases:
        compiles = []
        for _ in range(repeats):
            compiled, seconds = timed(lib.compile, kind, spec)
            compiles.append(seconds)
        ids = tokenizer.encode(output, add_special_tokens=False)
        bitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        masks, firsts = [], []
        for _ in range(repeats):
            compiled, seconds = timed(lib.compile, kind, spec)
            state = lib.start(compiled)
            for position, token in enumerate(ids):
                _, mask_s = timed(lib.mask, state, bitmask)
                masks.append(mask_s)
                if position == 0:
                    firsts.append(seconds + mask_s)
                allowed = bool((int(bitmask[token // 32]) >> (token % 32)) & 1)
                assert allowed, f"{lib.name} {label}: token {token} of the valid output masked"
                lib.advance(state, token)
        rows.append(
            {
                "library": lib.name,
                "what": f"{label} ({len(ids)} tokens)",
                "compile_ms": statistics.median(compiles) * 1e3,
                "mask_us": statistics.median(masks) * 1e6,
                "mask_mean_us": statistics.fmean(masks) * 1e6,
                "first_ms": statistics.median(firsts) * 1e3,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--libraries", default="llguidance,xgrammar,outlines-core")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = smollm2_tokenizer()
    vocab = len(tokenizer)
    libraries = {c.name: c for c in (Llguidance, Xgrammar, OutlinesCore)}
    print(
        f"vocabulary: {vocab} tokens; median of {args.repeats} runs; mask = one row, bitmask into a preallocated buffer"
    )
    print("| library | what | compile (ms) | compile + first mask (ms) | mask per token, median / mean (us) |")
    print("|---|---|---|---|---|")
    for name in args.libraries.split(","):
        try:
            rows = measure(libraries[name], tokenizer, vocab, args.repeats)
        except Exception as error:  # noqa: BLE001 - a library failing is a result of the comparison
            print(f"| {name} | failed: {type(error).__name__}: {str(error)[:200]} | | | |")
            continue
        for row in rows:
            mask = "" if row["mask_us"] is None else f"{row['mask_us']:.0f} / {row['mask_mean_us']:.0f}"
            first = "" if row["mask_us"] is None else f"{row['first_ms']:.1f}"
            print(f"| {row['library']} | {row['what']} | {row['compile_ms']:.1f} | {first} | {mask} |")


if __name__ == "__main__":
    main()
