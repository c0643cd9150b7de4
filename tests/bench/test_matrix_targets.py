"""Issue #23's targets from a speculation matrix's results (`bench.evaluate.matrix_targets`), on made-up numbers: the
slowest controller row is named, with whether its requests drafted at all, and with what identical work (plain greedy
on two targets) read in the same run, so that a miss of plain decoding against plain decoding reads as the box's
noise it is."""

from __future__ import annotations

from bench.evaluate import matrix_targets


def _summary(*values: float) -> dict:
    ordered = sorted(values)
    return {"median": ordered[len(ordered) // 2], "values": list(values), "n": len(values)}


def _prompt(plain: float, colocated_plain: float, colocated_on: float, rounds: list[float]) -> dict:
    return {
        "series": {
            "plain_greedy": {"tokens_per_second": _summary(plain)},
            "colocated_plain_greedy": {"tokens_per_second": _summary(colocated_plain)},
        },
        "ratios": {"co-located, controller on / plain greedy (same target)": colocated_on / colocated_plain},
        "speculation": {"colocated_on": {"rounds": {"values": rounds}}},
    }


def _matrix(code_rounds: list[float], waves_drafted: int) -> dict:
    return {
        "prompts": {
            "chat": _prompt(20.0, 21.0, 30.0, [16.0, 16.0, 16.0]),
            "code": _prompt(22.4, 23.8, 21.8, code_rounds),
        },
        "concurrency": {
            "clients": 8,
            "prompts": ["chat", "code"],
            "aggregate_tokens_per_second": {
                "plain_greedy, chat": _summary(90.0),
                "colocated_plain_greedy, chat": _summary(99.0),
                "plain_greedy, code": _summary(60.0),
                "colocated_plain_greedy, code": _summary(57.0),
            },
            "ratios": {"remote draft / plain greedy, chat": 0.97},
            "controller": {"remote_draft_on, chat": {"rounds_with_drafts": waves_drafted, "probes": 0}},
        },
    }


def _slowest(matrix: dict) -> dict:
    return next(t for t in matrix_targets(matrix) if t["name"] == "controller: slowest speculative row vs plain greedy")


def test_the_slowest_row_says_whether_it_drafted_and_what_identical_work_read():
    target = _slowest(_matrix([0.0, 0.0, 0.0], waves_drafted=0))
    assert target["met"] is False and round(target["measured"], 3) == round(21.8 / 23.8, 3)
    assert "co-located, controller on / plain greedy (same target), code prompt" in target["detail"]
    assert "none of its requests drafted a block" in target["detail"]
    # Single client: 21/20 and 23.8/22.4; 8 clients: 99/90 and 57/60.
    assert "read 1.05x-1.06x single client and 0.95x-1.10x with 8 clients" in target["detail"]

    drafting = _slowest(_matrix([0.0, 3.0, 0.0], waves_drafted=0))
    assert "none of its requests drafted" not in drafting["detail"]


def test_a_concurrent_case_is_named_with_whether_its_waves_drafted():
    matrix = _matrix([16.0, 16.0, 16.0], waves_drafted=0)
    matrix["prompts"]["code"]["ratios"]["co-located, controller on / plain greedy (same target)"] = 1.0
    target = _slowest(matrix)
    assert target["measured"] == 0.97 and "remote draft / plain greedy, chat, 8 clients" in target["detail"]
    assert "none of its requests drafted" in target["detail"]
    matrix["concurrency"]["controller"]["remote_draft_on, chat"]["rounds_with_drafts"] = 12
    assert "none of its requests drafted" not in _slowest(matrix)["detail"]
