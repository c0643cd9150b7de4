"""Runs the v4 golden cases under transformers 4.55.4 (inside the throwaway venv of make_v4_goldens.py).

It imports only torch and transformers, so it runs against the old release; the test suite never
imports it. Input: a JSON file with the model folder and the cases; output: the same cases with
transformers' outputs added.

Usage: python v4_goldens_worker.py CASES_JSON OUT_JSON
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
import transformers
from transformers import AutoModelForCausalLM

# Per step and row the scores keep their `TOP` best entries and the count of finite ones: enough to
# fail on any change of the processed scores, and small enough to commit.
TOP = 8


def _frequent(model, prompts, mask) -> list[int]:
    """Tokens the model emits most under greedy decoding: EOS ids that really end hypotheses."""
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    counts = Counter(out[:, prompts.shape[1] :].flatten().tolist())
    return [token for token, _ in counts.most_common(8)]


def _scores_summary(scores) -> list:
    summary = []
    for step in scores:
        rows = []
        for row in step.float():
            finite = torch.isfinite(row)
            values, ids = torch.topk(row, TOP)
            rows.append({"ids": ids.tolist(), "values": values.tolist(), "finite": int(finite.sum())})
        summary.append(rows)
    return summary


def _checksum(model) -> float:
    """Sum of |weights|: the test checks it to know it built the same tiny model."""
    with torch.no_grad():
        return float(sum(p.double().abs().sum() for p in model.parameters()))


def _resolve(kwargs: dict, frequent: list[int]) -> dict:
    """`{"frequent": i}` stands for the i-th most frequent greedy token (EOS ids, bad words...)."""

    def one(value):
        if isinstance(value, dict) and set(value) == {"frequent"}:
            return frequent[value["frequent"]]
        if isinstance(value, list):
            return [one(v) for v in value]
        return value

    return {name: one(value) for name, value in kwargs.items()}


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    torch.use_deterministic_algorithms(True)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"]).eval()
    prompts = {name: torch.tensor(p["input_ids"]) for name, p in spec["prompts"].items()}
    masks = {name: torch.tensor(p["attention_mask"]) for name, p in spec["prompts"].items()}
    frequent = _frequent(model, prompts["batch"], masks["batch"])
    cases = []
    for case in spec["cases"]:
        kwargs = _resolve(case["kwargs"], frequent)
        # specwire's `seed` draws as transformers does after `torch.manual_seed(seed)`.
        generate_kwargs = {name: value for name, value in kwargs.items() if name != "seed"}
        if "seed" in kwargs:
            torch.manual_seed(kwargs["seed"])
        with torch.no_grad():
            out = model.generate(
                input_ids=prompts[case["prompt"]],
                attention_mask=masks[case["prompt"]],
                return_dict_in_generate=True,
                output_scores=True,
                **generate_kwargs,
            )
        result = {"sequences": out.sequences.tolist(), "scores": _scores_summary(out.scores)}
        if getattr(out, "beam_indices", None) is not None:
            result["beam_indices"] = out.beam_indices.tolist()
        if getattr(out, "sequences_scores", None) is not None:
            result["sequences_scores"] = out.sequences_scores.tolist()
        cases.append({**case, "resolved_kwargs": kwargs, "expected": result})
    golden = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": spec["model"],
        "weights_checksum": _checksum(model),
        "frequent": frequent,
        "prompts": spec["prompts"],
        "top": TOP,
        "cases": cases,
    }
    with open(sys.argv[2], "w") as f:
        json.dump(golden, f, indent=None, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
