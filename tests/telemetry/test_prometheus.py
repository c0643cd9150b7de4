"""The opt-in Prometheus endpoint after known requests, and `specwire stats` reading it."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specwire.client import TargetClient
from specwire.client.cli import main as cli_main
from specwire.client.stats import acceptance
from specwire.draft_service.__main__ import build_server as build_draft_server
from specwire.generation.config import GenerationConfig
from specwire.target_service.__main__ import build_server as build_target_server
from specwire.target_service.drafting import DraftPolicy
from tests.servers import threaded_server
from tests.telemetry.conftest import BATCH, PROMPT, telemetry_for_module


@pytest.fixture(scope="module")
def scraped(loaded):
    """Known requests through a target with SPECWIRE_PROMETHEUS_PORT=0, then one scrape."""
    spec = dict(proposer="draft_model", assistant_confidence_threshold=0.0)
    with (
        telemetry_for_module("specwire-target", env={"SPECWIRE_PROMETHEUS_PORT": "0"}) as state,
        threaded_server(lambda: build_draft_server(loaded)) as draft,
    ):
        policy = DraftPolicy(draft.address, round_timeout_s=30.0)
        with (
            threaded_server(lambda: build_target_server(loaded, drafting=policy)) as target,
            TargetClient(target.address) as client,
        ):
            outputs = {
                "default": [client.generate(PROMPT, max_new_tokens=12, num_assistant_tokens=n, **spec) for n in (2, 4)],
                "inline": [
                    client.generate(
                        BATCH,
                        generation_config=GenerationConfig(max_new_tokens=10),
                        num_assistant_tokens=3,
                        **spec,
                    )
                ],
                "plain": [client.generate(PROMPT, max_new_tokens=5)],
            }
        url = f"http://127.0.0.1:{state.prometheus_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        yield state, url, text, outputs


def _samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_endpoint_binds_loopback(scraped):
    state, *_ = scraped
    assert state.prometheus_address[0] == "127.0.0.1"


def test_names_labels_and_values_after_known_requests(scraped):
    _, _, text, outputs = scraped
    samples = _samples(text)
    model = outputs["plain"][0].model_id
    for config in ("default", "inline"):
        stats = [o.speculation for o in outputs[config]]
        assert all(s.proposer == "draft_model" and s.rounds > 0 for s in stats)
        labels = {"model": model, "proposer": "draft_model", "config": config}

        def value(name, extra=None, labels=labels):
            found = [v for lab, v in samples[name] if lab.items() >= {**labels, **(extra or {})}.items()]
            assert len(found) == 1, (name, labels, extra, samples.get(name))
            return found[0]

        assert value("specwire_spec_decode_draft_tokens_total") == sum(s.drafted_tokens for s in stats)
        assert value("specwire_spec_decode_accepted_tokens_total") == sum(s.accepted_tokens for s in stats)
        if config == "default":  # one row: a draft per round
            assert value("specwire_spec_decode_drafts_total") == sum(s.rounds for s in stats)
        width = max(len(s.accepted_by_position) for s in stats)
        for position in range(width):
            want = sum(s.accepted_by_position[position] for s in stats if position < len(s.accepted_by_position))
            assert value("specwire_spec_decode_accepted_tokens_per_position_total", {"position": str(position)}) == want
        for histogram in (
            "gen_ai_server_request_duration_seconds",
            "gen_ai_server_time_to_first_token_seconds",
            "gen_ai_server_time_per_output_token_seconds",
        ):
            assert value(f"{histogram}_count") == len(stats)
    # Plain decoding: latency histograms under proposer="none", no speculation counters.
    none = {"model": model, "proposer": "none", "config": "default"}
    assert [v for lab, v in samples["gen_ai_server_request_duration_seconds_count"] if lab.items() >= none.items()] == [
        1.0
    ]
    assert not [lab for lab, _ in samples["specwire_spec_decode_draft_tokens_total"] if lab["proposer"] == "none"]


def test_stats_command_prints_the_formulas_and_draws_a_png(scraped, tmp_path, capsys):
    _, url, text, outputs = scraped
    png = tmp_path / "acceptance.png"
    assert cli_main(["stats", "--prometheus", url, "--json", "--png", str(png)]) == 0
    groups = {(g["proposer"], g["config"]): g for g in json.loads(capsys.readouterr().out)}
    stats = [o.speculation for o in outputs["default"]]
    g = groups[("draft_model", "default")]
    drafted, accepted, rounds = (
        sum(s.drafted_tokens for s in stats),
        sum(s.accepted_tokens for s in stats),
        sum(s.rounds for s in stats),
    )
    assert g["acceptance_rate"] == pytest.approx(accepted / drafted)
    assert g["mean_acceptance_length"] == pytest.approx(1 + accepted / rounds)
    assert g["acceptance_by_position"][0] == pytest.approx(sum(s.accepted_by_position[0] for s in stats) / rounds)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000

    assert cli_main(["stats", "--prometheus", url]) == 0
    table = capsys.readouterr().out
    assert "draft_model" in table and f"{accepted / drafted:.3f}" in table and f"{1 + accepted / rounds:.3f}" in table


EXPOSITION = """\
# TYPE specwire_spec_decode_drafts_total counter
specwire_spec_decode_drafts_total{model="a",proposer="draft_model",config="chat"} 10
specwire_spec_decode_drafts_total{model="b",proposer="draft_model",config="chat"} 10
# TYPE specwire_spec_decode_draft_tokens_total counter
specwire_spec_decode_draft_tokens_total{model="a",proposer="draft_model",config="chat"} 40
specwire_spec_decode_draft_tokens_total{model="b",proposer="draft_model",config="chat"} 40
# TYPE specwire_spec_decode_accepted_tokens_total counter
specwire_spec_decode_accepted_tokens_total{model="a",proposer="draft_model",config="chat"} 20
specwire_spec_decode_accepted_tokens_total{model="b",proposer="draft_model",config="chat"} 10
# TYPE specwire_spec_decode_accepted_tokens_per_position_total counter
specwire_spec_decode_accepted_tokens_per_position_total{model="a",proposer="draft_model",config="chat",position="0"} 12
specwire_spec_decode_accepted_tokens_per_position_total{model="a",proposer="draft_model",config="chat",position="1"} 8
"""  # noqa: E501


def test_acceptance_formulas_on_a_known_exposition():
    (group,) = acceptance([EXPOSITION])
    assert (group.drafts, group.draft_tokens, group.accepted_tokens) == (20, 80, 30)
    assert group.acceptance_rate == 30 / 80 and group.mean_acceptance_length == 1 + 30 / 20
    assert group.position_rates() == [12 / 20, 8 / 20]
    (only_a,) = acceptance([EXPOSITION], model="a")
    assert only_a.mean_acceptance_length == 1 + 20 / 10
    (two,) = acceptance([EXPOSITION, EXPOSITION])  # two endpoints (replicas) add up
    assert two.drafts == 40 and two.acceptance_rate == 30 / 80


def test_stats_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from specwire.client.stats import plot

    with pytest.raises(SystemExit, match=r"pip install -e '\.\[bench\]'"):
        plot(acceptance([EXPOSITION]), tmp_path / "x.png")
