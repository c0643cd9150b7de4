"""`python -m bench --quick --workloads structured` on the tiny random model: the workload's results,
checks, targets and Markdown section (timings are measured, never asserted; the random model's JSON
often runs into max_new_tokens, so validity is recorded, not asserted)."""

from __future__ import annotations

from bench.structured_workload import SCHEMAS, parses_and_validates
from tests.bench.test_bench_quick import run_quick


def test_structured_workload_results_and_report(tiny_model_dir, tiny_draft_dir, tmp_path):
    out = tmp_path / "results"
    _, results = run_quick(
        out, "--model", str(tiny_model_dir), "--draft-model", str(tiny_draft_dir), "--workloads", "structured"
    )
    structured = results["workloads"]["structured"]
    assert structured["status"] == "ok", structured
    assert structured["requests"] == 8 and 0 <= structured["valid"] <= 8
    assert set(structured["series"]) == {"constrained", "free", "constrained_copy", "constrained_copy_prompt_lookup"}
    assert structured["mask_us_per_token"] > 0 and structured["mask_overhead"] > 0
    checks = {check["name"]: check["passed"] for check in structured["checks"]}
    assert checks["constrained + prompt lookup gives constrained greedy's tokens"] is True
    names = {target["name"] for target in results["targets"]}
    assert "structured output: mask cost per token vs a free decode step" in names
    assert "### 10. Structured output" in (out / "results.md").read_text()


def test_the_benchmark_validator():
    person = SCHEMAS["person"]
    assert parses_and_validates('{"name":"Ada","age":36,"email":"a@b.c"}', person)
    assert not parses_and_validates('{"name":"Ada","age":-1,"email":"a@b.c"}', person)
    assert not parses_and_validates('{"name":"Ada","age":36}', person)
    assert not parses_and_validates('{"name":"Ada","age":36,"email":"a@b.c","x":1}', person)
    assert not parses_and_validates('{"name":"Ada","age":true,"email":"a@b.c"}', person)
    assert not parses_and_validates('{"name":"Ada"', person)
    product = SCHEMAS["product"]
    assert parses_and_validates('{"title":"t","price":1.5,"in_stock":false,"tags":["a"]}', product)
    assert not parses_and_validates('{"title":"t","price":1.5,"in_stock":false,"tags":[1]}', product)
    assert parses_and_validates('{"title":"t","city":"c","kind":"talk","year":2000}', SCHEMAS["event"])
    assert not parses_and_validates('{"title":"t","city":"c","kind":"party","year":2000}', SCHEMAS["event"])
