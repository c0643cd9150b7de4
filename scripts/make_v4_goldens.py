"""Writes the golden outputs of the v4 decoding modes (tests/parity/goldens/v4_*.json).

transformers 4.55.4 is the last release with group beam search, constrained beam search, contrastive
search and DoLa in its core. This script:

1. builds the tests' tiny Llama with the CURRENT transformers (tests/tiny_models.py, same seed), so the
   old release loads exactly the weights the tests build;
2. creates a throwaway venv (default /tmp/specwire-v4-goldens) with transformers==4.55.4 and
   torch==2.13.0 (CPU), unless it already exists;
3. runs every case of `CASES` through 4.55.4's `generate()` there (scripts/v4_goldens_worker.py) and
   writes one JSON file per mode: token ids, a summary of the processed scores (best entries per step
   and row), beam indices and sequence scores.

The suite (tests/parity/test_v4_goldens.py) compares specwire against the committed files, so CI
never installs the old release. Run it again after changing `CASES` or tests/tiny_models.py:

    PYTHONPATH=$PWD python scripts/make_v4_goldens.py [--venv DIR] [--mode group_beam_search ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "tests" / "parity" / "goldens"
PINS = ("transformers==4.55.4", "torch==2.13.0")

# The tiny model of tests/tiny_models.py.build_tiny_llama with these arguments.
MODEL = {"seed": 0, "num_hidden_layers": 2, "hidden_size": 32}

# `{"frequent": i}` is the i-th most frequent token of the model's greedy output (the worker resolves
# it): the tiny model rarely emits its real EOS id, so hypotheses end on these instead.
_EOS = {"frequent": 2}
_GROUP = {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "pad_token_id": 0}

_CONSTRAINED = {"num_beams": 4, "pad_token_id": 0}

CASES: dict[str, list[dict]] = {
    "constrained_beam_search": [
        {
            "name": "phrasal",
            "prompt": "single",
            "kwargs": {**_CONSTRAINED, "max_new_tokens": 8, "force_words_ids": [[70, 71]]},
        },
        {
            "name": "disjunctive",
            "prompt": "single",
            "kwargs": {**_CONSTRAINED, "max_new_tokens": 8, "force_words_ids": [[[80, 81], [82], [80, 83, 84]]]},
        },
        {
            "name": "several_constraints_eos",
            "prompt": "single",
            "kwargs": {
                **_CONSTRAINED,
                "max_new_tokens": 12,
                "force_words_ids": [[70], [[90, 91], [92]], [60, 61, 62]],
                "eos_token_id": _EOS,
            },
        },
        {
            "name": "num_return_sequences",
            "prompt": "single",
            "kwargs": {
                "num_beams": 5,
                "max_new_tokens": 9,
                "num_return_sequences": 3,
                "force_words_ids": [[75, 76], [[77], [78, 79]]],
                "eos_token_id": [_EOS, {"frequent": 4}],
                "pad_token_id": 0,
            },
        },
        {
            "name": "left_padded_batch",
            "prompt": "batch",
            "kwargs": {
                **_CONSTRAINED,
                "max_new_tokens": 10,
                "num_return_sequences": 2,
                "force_words_ids": [[72, 73], [[85], [86, 87]]],
                "eos_token_id": _EOS,
                "repetition_penalty": 1.3,
            },
        },
        {
            "name": "early_stopping_length_penalty",
            "prompt": "batch",
            "kwargs": {
                **_CONSTRAINED,
                "max_new_tokens": 12,
                "force_words_ids": [[{"frequent": 3}, 74]],
                "eos_token_id": {"frequent": 1},
                "early_stopping": True,
                "length_penalty": 0.5,
            },
        },
        {
            "name": "frequent_word_never",
            "prompt": "single",
            "kwargs": {
                **_CONSTRAINED,
                "max_new_tokens": 10,
                "force_words_ids": [[{"frequent": 0}, {"frequent": 1}]],
                "eos_token_id": _EOS,
                "early_stopping": "never",
            },
        },
    ],
    "group_beam_search": [
        {"name": "two_groups", "prompt": "single", "kwargs": {**_GROUP, "max_new_tokens": 8}},
        {
            "name": "all_returned",
            "prompt": "single",
            "kwargs": {**_GROUP, "max_new_tokens": 6, "num_return_sequences": 4},
        },
        {
            "name": "three_groups_eos_list",
            "prompt": "single",
            "kwargs": {
                "num_beams": 6,
                "num_beam_groups": 3,
                "diversity_penalty": 0.5,
                "max_new_tokens": 10,
                "num_return_sequences": 3,
                "eos_token_id": [_EOS, {"frequent": 4}],
                "pad_token_id": 0,
            },
        },
        {
            "name": "one_beam_per_group",
            "prompt": "single",
            "kwargs": {
                "num_beams": 3,
                "num_beam_groups": 3,
                "diversity_penalty": 2.0,
                "max_new_tokens": 7,
                "num_return_sequences": 3,
                "eos_token_id": _EOS,
                "pad_token_id": 0,
            },
        },
        {
            "name": "early_stopping_length_penalty",
            "prompt": "single",
            "kwargs": {
                **_GROUP,
                "max_new_tokens": 12,
                "eos_token_id": _EOS,
                "early_stopping": True,
                "length_penalty": 0.5,
                "num_return_sequences": 2,
            },
        },
        {
            "name": "never_stop_early",
            "prompt": "single",
            "kwargs": {
                **_GROUP,
                "max_new_tokens": 9,
                "eos_token_id": {"frequent": 1},
                "early_stopping": "never",
                "length_penalty": 1.5,
                "num_return_sequences": 2,
            },
        },
        {
            "name": "penalties",
            "prompt": "single",
            "kwargs": {
                **_GROUP,
                "max_new_tokens": 8,
                "repetition_penalty": 1.3,
                "no_repeat_ngram_size": 2,
                "min_new_tokens": 3,
                "eos_token_id": _EOS,
            },
        },
        {
            "name": "batch_left_padding",
            "prompt": "batch",
            "kwargs": {**_GROUP, "max_new_tokens": 8, "num_return_sequences": 2, "eos_token_id": _EOS},
        },
    ],
    "contrastive_search": [
        {
            "name": "alpha_0_6_top_4",
            "prompt": "single",
            "kwargs": {"penalty_alpha": 0.6, "top_k": 4, "max_new_tokens": 12},
        },
        {
            "name": "alpha_0_3_top_8_penalties",
            "prompt": "single",
            "kwargs": {
                "penalty_alpha": 0.3,
                "top_k": 8,
                "max_new_tokens": 10,
                "repetition_penalty": 1.2,
                "no_repeat_ngram_size": 3,
            },
        },
        {
            "name": "eos_list_min_new_tokens",
            "prompt": "single",
            "kwargs": {
                "penalty_alpha": 0.5,
                "top_k": 3,
                "max_new_tokens": 15,
                "min_new_tokens": 2,
                "eos_token_id": [_EOS, {"frequent": 4}],
                "pad_token_id": 0,
            },
        },
        {
            "name": "alpha_1_top_2",
            "prompt": "single",
            "kwargs": {"penalty_alpha": 1.0, "top_k": 2, "max_new_tokens": 8},
        },
        {
            "name": "batch_left_padding",
            "prompt": "batch",
            "kwargs": {"penalty_alpha": 0.6, "top_k": 5, "max_new_tokens": 10, "eos_token_id": _EOS, "pad_token_id": 0},
        },
    ],
    "dola_generation": [
        {
            "name": "low_repetition_penalty",
            "prompt": "single",
            "kwargs": {"dola_layers": "low", "repetition_penalty": 1.2, "max_new_tokens": 10},
        },
        {"name": "high_no_penalty", "prompt": "single", "kwargs": {"dola_layers": "high", "max_new_tokens": 8}},
        {
            "name": "layer_list_eos_list",
            "prompt": "single",
            "kwargs": {
                "dola_layers": [0, 1],
                "repetition_penalty": 1.3,
                "max_new_tokens": 12,
                "eos_token_id": [_EOS, {"frequent": 4}],
                "pad_token_id": 0,
            },
        },
        {
            "name": "layer_list_past_the_last_layer",
            "prompt": "single",
            "kwargs": {"dola_layers": [0, 1, 5], "repetition_penalty": 1.2, "max_new_tokens": 8},
        },
        {
            "name": "sampling_seeded",
            "prompt": "single",
            "kwargs": {
                "dola_layers": "low",
                "do_sample": True,
                "top_k": 20,
                "temperature": 0.8,
                "repetition_penalty": 1.2,
                "max_new_tokens": 10,
                "seed": 7,
            },
        },
        {
            "name": "batch_left_padding",
            "prompt": "batch",
            "kwargs": {
                "dola_layers": "high",
                "repetition_penalty": 1.2,
                "max_new_tokens": 10,
                "eos_token_id": _EOS,
                "pad_token_id": 0,
            },
        },
    ],
}

PROMPTS = {"single": ["The quick brown"], "batch": ["The quick brown", "def add(a, b):\n    return", "Hello"]}


def _venv(folder: Path) -> Path:
    python = folder / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", default="/tmp/specwire-v4-goldens", help="the throwaway venv (reused if present)")
    parser.add_argument("--mode", action="append", choices=sorted(CASES), help="modes to write (default: all)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from tests.tiny_models import build_tiny_llama

    python = _venv(Path(args.venv))
    GOLDENS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "tiny", **MODEL)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        prompts = {}
        for name, texts in PROMPTS.items():
            encoded = tokenizer(texts, return_tensors="pt", padding=True)
            prompts[name] = {
                "input_ids": encoded.input_ids.tolist(),
                "attention_mask": encoded.attention_mask.tolist(),
            }
        for mode in args.mode or sorted(CASES):
            spec = {"model_dir": str(model_dir), "model": MODEL, "prompts": prompts, "cases": CASES[mode]}
            spec_path, out_path = Path(tmp) / "spec.json", GOLDENS / f"v4_{mode}.json"
            spec_path.write_text(json.dumps(spec))
            worker = ROOT / "scripts" / "v4_goldens_worker.py"
            subprocess.run([str(python), str(worker), str(spec_path), str(out_path)], check=True)
            print(f"wrote {out_path.relative_to(ROOT)} ({out_path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
