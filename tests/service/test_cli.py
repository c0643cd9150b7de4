"""The `specwire` CLI against real services: every `config` subcommand, `generate`, and `demo`
(three real service processes on a tiny model)."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from specwire.client.cli import main
from specwire.client.cli.common import ctrl_c_closes
from specwire.config_service.__main__ import build_server as build_config_server
from specwire.models import load_model
from specwire.target_service.__main__ import build_server as build_target_server
from tests.servers import free_port, threaded_server, wait_for
from tests.service.releases import Faults


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    db = tmp_path_factory.mktemp("cli") / "r.db"
    with threaded_server(lambda: build_config_server(str(db))) as config:
        with threaded_server(lambda: build_target_server(loaded, config.address)) as target:
            yield config.address, target.address


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_config_subcommands(services, capsys, tmp_path):
    config, _ = services
    code, out, _ = run(
        capsys,
        "config",
        "--address",
        config,
        "create",
        "chat",
        "--set",
        "do_sample=true",
        "--set",
        "temperature=0.7",
        "--label",
        "team=x",
    )
    assert code == 0 and out.startswith("chat@1")
    assert json.loads(out.split("\n", 1)[1]) == {"do_sample": True, "temperature": 0.7}
    code, out, _ = run(
        capsys,
        "config",
        "--address",
        config,
        "update",
        "chat",
        "--set",
        "do_sample=true",
        "--set",
        "temperature=0.9",
        "--expected-version",
        "1",
    )
    assert code == 0 and out.startswith("chat@2")
    assert run(capsys, "config", "--address", config, "tag", "chat", "prod", "1")[0] == 0
    code, out, _ = run(capsys, "config", "--address", config, "get", "chat:prod", "--as-json")
    record = json.loads(out)
    assert record["version"] == 1 and record["tags"] == ["prod"] and record["labels"] == {"team": "x"}
    code, out, _ = run(capsys, "config", "--address", config, "list", "--prefix", "ch")
    assert out.split() == ["chat@2"]
    code, out, _ = run(capsys, "config", "--address", config, "export", "chat@1")
    assert json.loads(out)["temperature"] == 0.7
    source = tmp_path / "generation_config.json"
    source.write_text(json.dumps({"num_beams": 2, "max_new_tokens": 5}))
    code, out, _ = run(capsys, "config", "--address", config, "import", "--file", str(source), "--name", "beams")
    assert code == 0 and out.startswith("beams@1")
    code, out, err = run(capsys, "config", "--address", config, "validate", "--json", str(source))
    assert code == 0 and "is now --file FILE" in err  # the old spelling still works, with a warning
    code, out, _ = run(capsys, "config", "--address", config, "validate", "--set", "top_p=0.5")
    assert code == 0 and "warning" in out and out.strip().endswith("valid")
    code, out, _ = run(
        capsys,
        "config",
        "--address",
        config,
        "validate",
        "--set",
        "do_sample=true",
        "--set",
        "temperature=0.0",
    )
    assert code == 1 and "config.temperature" in out and out.strip().endswith("invalid")
    code, out, err = run(capsys, "config", "--address", config, "get", "missing")
    assert code == 1 and "NOT_FOUND" in err
    code, out, err = run(capsys, "config", "--address", config, "create", "bad", "--set", "num_beams=0")
    assert code == 1 and "INVALID_ARGUMENT" in err and "config.num_beams" in err
    assert err.count("config.num_beams") == 1  # said once, not again as a violation line
    assert run(capsys, "config", "--address", config, "delete", "beams")[1].startswith("deleted 1")


def test_generate_json_stream_and_errors(services, capsys):
    _, target = services
    code, out, _ = run(
        capsys,
        "generate",
        "Hello world",
        "--address",
        target,
        "--no-chat",
        "--json",
        "--set",
        "max_new_tokens=5",
    )
    output = json.loads(out)
    assert code == 0 and len(output["sequences"][0]) > 5 and output["finish_reasons"] == ["length"]
    code, out, _ = run(
        capsys,
        "generate",
        "Hello world",
        "--address",
        target,
        "--no-chat",
        "--stream",
        "--set",
        "max_new_tokens=5",
    )
    # A plain request prints no (zeroed) speculation line.
    assert code == 0 and "-- speculation" not in out and "-- finish: length" in out
    code, out, _ = run(
        capsys,
        "generate",
        "Hello",
        "world",
        "--address",
        target,
        "--no-chat",
        "--set",
        "max_new_tokens=3",
        "--proposer",
        "prompt_lookup",
    )
    assert code == 0 and out.startswith("[0] ") and "proposer=prompt_lookup" in out
    code, _, err = run(
        capsys,
        "generate",
        "Hello",
        "--address",
        target,
        "--no-chat",
        "--set",
        "top_k=-3",
        "--set",
        "do_sample=true",
    )
    assert code == 1 and "config.top_k" in err


def test_demo_runs_three_services_and_prints_stats(tiny_model_dir, tmp_path):
    ports = [str(free_port()) for _ in range(3)]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specwire.client.cli",
            "demo",
            "Hello world",
            "--model",
            str(tiny_model_dir),
            "--draft-model",
            str(tiny_model_dir),
            "--config-port",
            ports[0],
            "--target-port",
            ports[1],
            "--draft-port",
            ports[2],
            "--max-new-tokens",
            "12",
            "--no-chat",
            "--db",
            str(tmp_path / "demo.db"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all services healthy" in result.stderr
    assert "-- speculation: proposer=draft_model" in result.stdout
    assert "acceptance_rate=" in result.stdout and "fell back" not in result.stdout
    # What speculation bought, next to plain decoding of the same prompt, and the same text both ways; both timed
    # after a short warm-up request each way, so that neither side pays the fresh services' first forwards.
    assert "warming up: one short request with speculation and one without" in result.stderr
    assert "tokens/s with draft_model" in result.stdout and "tokens/s plain decoding (same text)" in result.stdout


def test_ctrl_c_during_the_demo_stops_every_service_cleanly(tmp_path):
    """Ctrl-C while the demo's answer streams: "stopped", exit 130, and every service exits 0 on the SIGTERM that
    follows. The target used to abort ("terminate called without an active exception", exit -6) in 7 of 8 tries:
    its model thread, a daemon, was still in a forward when the interpreter finalized. The embedded SmolLM2 (a
    forward of tens of ms, so one is under way at the Ctrl-C) with its int8 draft, the demo's defaults."""
    ports = [str(free_port()) for _ in range(3)]
    process = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, "demo", "--db", str(tmp_path / "demo.db")]
        + ["--config-port", ports[0], "--target-port", ports[1], "--draft-port", ports[2]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = process.stdout.read(1)  # the answer streams (the warm-up requests print nothing on stdout)
    if not first:
        _, err = process.communicate(timeout=120)
        pytest.fail(f"the demo ended before its answer streamed (exit {process.returncode}): {err[-3000:]}")
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert (process.returncode, "stopped" in err) == (130, True), err[-3000:]
    assert "while stopping" not in err and "terminate called" not in err and "Traceback" not in err, err[-3000:]


def test_warnings_reach_the_user_on_stderr_and_in_json(services, capsys):
    _, target = services
    # transformers warns that a temperature does nothing without sampling.
    base = ("generate", "Hello", "--address", target, "--no-chat", "--set", "max_new_tokens=2")
    code, out, err = run(capsys, *base, "--set", "temperature=0.5")
    assert code == 0 and "warning: config.temperature" in err
    code, out, err = run(capsys, *base, "--set", "temperature=0.5", "--json")
    assert code == 0 and any(w["field"] == "config.temperature" for w in json.loads(out)["warnings"])


def test_stream_with_beams_says_it_cannot_stream_and_prints_the_answer(services, capsys):
    _, target = services
    code, out, err = run(
        capsys, "generate", "Hello", "--address", target, "--no-chat", "--stream", "--set", "num_beams=2"
    )
    assert code == 0 and "beam search cannot stream" in err and "-- finish:" in out


def test_client_side_mistakes_are_one_line_with_exit_code_2(services, capsys):
    _, target = services
    code, out, err = run(capsys, "generate", "Hi", "--address", target, "--set", "max_new_tokens=abc")
    assert code == 2 and "max_new_tokens" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, "generate", "--address", target)
    assert code == 2 and "give a prompt" in err
    code, out, err = run(capsys, "generate", "Hi", "--set", "oops")
    assert code == 2 and "key=value" in err
    with pytest.raises(SystemExit) as info:  # argparse's own usage errors exit 2 as well
        main(["generate", "Hi", "--proposer", "nope"])
    assert info.value.code == 2


def test_nothing_listening_says_how_to_start_the_services(capsys):
    code, out, err = run(capsys, "generate", "Hi", "--address", f"127.0.0.1:{free_port()}", "--timeout", "5")
    assert code == 1 and "UNAVAILABLE" in err and "specwire serve" in err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "default: 50052" in out and "default: cpu" in out and "registry.db" in out


# `specwire` with Python's own Ctrl-C handler, as from a terminal: a pytest-xdist worker ignores SIGINT (its controller
# takes Ctrl-C), and an ignored signal stays ignored in its children, so the CLI would never see it (as after `nohup`
# or `cmd &`). Set in the child itself: a `preexec_fn` runs Python in a fork of this process, whose gRPC threads make
# that unsafe (it aborted the child now and then).
AS_FROM_A_TERMINAL = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from specwire.client.cli import main; sys.exit(main())"
)


def test_ctrl_c_during_a_stream_prints_stopped_not_a_traceback(tiny_model_dir):
    # A target 20 ms a forward: its 200 tokens take 4 s, so the stream is still going when Ctrl-C comes however busy
    # the machine (the tiny model alone streams them in ~0.5 s). The sequential scheduler calls the model's `forward`
    # (the batched one's lean decoder runs the layers itself, which the delay would miss).
    slow = load_model(str(tiny_model_dir), progress=False)
    Faults(slow.model, delay_s=0.02)
    forwards = count_calls(slow.model)
    with threaded_server(lambda: build_target_server(slow, scheduler="sequential")) as target:
        process = subprocess.Popen(
            [sys.executable, "-c", AS_FROM_A_TERMINAL, "generate", "Hello", "--address", target.address]
            + ["--no-chat", "--stream", "--set", "max_new_tokens=200", "--set", "min_new_tokens=200"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first = process.stdout.read(1)  # streaming has begun; '' means the command ended before any text
        if not first:
            _, err = process.communicate(timeout=60)
            pytest.fail(f"the stream ended before its first token (exit {process.returncode}): {err}")
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
        assert (process.returncode, "stopped" in err, "Traceback" in err) == (130, True, False), err
        # The request was cancelled on the server: its forwards stop short of the 200 tokens asked for.
        wait_for(lambda: no_new_calls(forwards, quiet_s=0.3), timeout=30)
        assert len(forwards) < 200


def count_calls(model) -> list[None]:
    """Wrap `model.forward` to append to the returned list at every call."""
    calls: list[None] = []
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        calls.append(None)
        return inner(*args, **kwargs)

    model.forward = forward
    return calls


def no_new_calls(calls: list[None], quiet_s: float) -> bool:
    before = len(calls)
    time.sleep(quiet_s)
    return len(calls) == before


def test_ctrl_c_that_breaks_grpcs_lock_is_still_an_interrupt(monkeypatch, capsys):
    """Ctrl-C inside grpc's wait for a streamed message can leave its condition's lock released; leaving grpc's `with`
    then raises RuntimeError("cannot release un-acquired lock") in the middle of the KeyboardInterrupt (seen once in
    the test above, before a first Ctrl-C closed the channel instead; a second one still raises there). The CLI says
    "stopped" and exits 130 for that too, and lets any other RuntimeError through."""
    import specwire.client.cli as cli

    def interrupted_in_grpcs_wait(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("cannot release un-acquired lock")  # noqa: B904 (threading chains it implicitly)

    monkeypatch.setattr(cli, "generate_command", interrupted_in_grpcs_wait)
    code, _, err = run(capsys, "generate", "Hello", "--address", "127.0.0.1:1")
    assert (code, "stopped" in err, "Traceback" in err) == (130, True, False)

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "generate_command", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate", "Hello", "--address", "127.0.0.1:1"])


@pytest.fixture
def python_handles_ctrl_c():
    """SIGINT raising KeyboardInterrupt, as in a CLI started from a terminal (a pytest-xdist worker ignores it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class Closable:
    def __init__(self):
        self.closed = threading.Event()

    def close(self):
        self.closed.set()


def test_ctrl_c_closes_the_client_instead_of_raising_where_the_call_waits(python_handles_ctrl_c):
    client = Closable()
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_closes(client):
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pytest.fail("Ctrl-C raised in the body, where grpc waits for the call")
            assert client.closed.wait(10)
            raise ValueError("Cannot invoke RPC on closed channel!")  # what the closed channel makes the call raise
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # The body finishing as the channel closes is still the user's Ctrl-C; errors without one pass through.
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_closes(Closable()):
            signal.raise_signal(signal.SIGINT)
    with pytest.raises(ValueError, match="a bug"):
        with ctrl_c_closes(Closable()):
            raise ValueError("a bug")


def test_a_second_ctrl_c_raises_at_once(python_handles_ctrl_c):
    client = Closable()
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_closes(client):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            pytest.fail("the second Ctrl-C did not raise")
    assert client.closed.wait(10)


def test_an_ignored_ctrl_c_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as after `nohup`
    try:
        client = Closable()
        with ctrl_c_closes(client):
            signal.raise_signal(signal.SIGINT)
        assert not client.closed.is_set() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_registry_warns_about_unknown_keys_refuses_them_strictly_and_stores_them_on_purpose(services, capsys):
    config, target = services
    base = ("config", "--address", config)
    code, out, err = run(capsys, *base, "create", "typo", "--set", "temprature=0.7")
    assert code == 0 and "config.temprature" in err and "did you mean `temperature`?" in err
    code, out, err = run(capsys, *base, "create", "typo-strict", "--set", "temprature=0.7", "--strict")
    assert code == 1 and "INVALID_ARGUMENT" in err and "did you mean `temperature`?" in err
    code, out, err = run(capsys, *base, "create", "custom", "--set", "my_team_key=1", "--allow-custom")
    assert code == 0 and "warning" not in err and '"my_team_key": 1' in out
    code, out, _ = run(capsys, *base, "validate", "--set", "temprature=0.7", "--strict")
    assert code == 1 and "temprature" in out and out.strip().endswith("invalid")
    code, out, err = run(capsys, "generate", "Hi", "--address", target, "--set", "temprature=0.7")
    assert code == 1 and "overrides.temprature" in err and "did you mean `temperature`?" in err
