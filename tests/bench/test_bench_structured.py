"""`python -m bench --quick --workloads structured` on the tiny random model: the workload's results,
checks, targets and Markdown section, the README's table (timings are measured, never asserted; the random model's JSON
often runs into max_new_tokens, so validity is recorded, not asserted)."""

from __future__ import annotations

from bench.structured_workload import SCHEMAS, parses_and_validates, readme_table
from tests.bench.test_bench_quick import run_quick


def test_structured_workload_results_and_report(tiny_model_dir, tiny_draft_dir, tmp_path):
    out = tmp_path / "results"
    done, results = run_quick(
        out, "--model", str(tiny_model_dir), "--draft-model", str(tiny_draft_dir), "--workloads", "structured"
    )
    structured = results["workloads"]["structured"]
    assert structured["status"] == "ok", structured
    assert structured["requests"] == len(SCHEMAS) and 0 <= structured["valid"] <= len(SCHEMAS)  # one per schema
    assert set(structured["series"]) == {"constrained", "free", "constrained_copy", "constrained_copy_prompt_lookup"}
    assert structured["mask_us_per_token"] > 0 and structured["mask_overhead"] > 0
    checks = {check["name"]: check["passed"] for check in structured["checks"]}
    assert checks["constrained + prompt lookup gives constrained greedy's tokens"] is True
    names = {target["name"] for target in results["targets"]}
    assert "structured output: mask cost per token vs a free decode step" in names
    markdown = (out / "results.md").read_text()
    assert "### 10. Structured output" in markdown
    # The README's table, printed at the end of the workload and the same in results.md, targets included.
    table = readme_table(structured)
    assert all(line in markdown for line in table) and all(line in done.stderr for line in table)
    assert any("target <= 10 %" in line for line in table) and any("target > 1x" in line for line in table)


def test_readme_table_states_the_targets_and_their_verdicts():
    summary = {"median": 10.0, "min": 9.0, "max": 11.0}
    faster = {"median": 15.0, "min": 14.0, "max": 16.0}
    result = {
        "valid": 100,
        "requests": 100,
        "mask_us_per_token": 120.0,
        "mask_overhead": 0.02,
        "series": {
            "constrained": {"tokens_per_second": summary},
            "free": {"tokens_per_second": summary},
            "constrained_copy": {"tokens_per_second": summary},
            "constrained_copy_prompt_lookup": {"tokens_per_second": faster},
        },
    }
    table = "\n".join(readme_table(result))
    assert f"| 100/100 ({len(SCHEMAS)} schemas) |" in table
    assert "| mask / free decode step (target <= 10 %) | 2.00 % (met) |" in table
    assert "| constrained + prompt lookup / constrained (target > 1x) | 1.50x (met) |" in table
    result["mask_overhead"], result["series"]["constrained_copy_prompt_lookup"] = 0.2, {"tokens_per_second": summary}
    table = "\n".join(readme_table(result))
    assert "20.00 % (NOT met)" in table and "1.00x (NOT met)" in table


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
