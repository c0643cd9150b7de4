"""The chart's services and command lines: the headless draft Service, the args each server gets (parsed
by its real CLI), the settings checksum, and the `helm test` pod with its health-check script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.helm.rendering import (
    COMPONENTS,
    HEALTH_NAMES,
    NAMESPACE,
    PORTS,
    RELEASE,
    ROOT,
    VARIANTS,
    Rendered,
    template,
)

# --- services and the draft's headless Service ----------------------------------------------------


def test_draft_service_is_headless_and_target_round_robins_over_it(renders):
    r = renders["default"]
    draft_svc = r.get("Service", "draft")["spec"]
    assert draft_svc["clusterIP"] == "None"
    assert draft_svc["ports"][0]["port"] == PORTS["draft"]
    assert r.get("Service", "target")["spec"].get("clusterIP") is None  # a normal ClusterIP
    fqdn = f"{RELEASE}-specwire-draft.{NAMESPACE}.svc.cluster.local"
    assert r.settings("target")["SPECWIRE_DRAFT_ADDRESS"] == f"dns:///{fqdn}:{PORTS['draft']}"
    assert r.settings("target")["SPECWIRE_CONFIG_ADDRESS"] == (
        f"{RELEASE}-specwire-config.{NAMESPACE}.svc.cluster.local:{PORTS['config']}"
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_args_are_the_documented_cli_and_resolve_from_the_configmap(renders, variant):
    """Each $(VAR) in the args is defined in the service's ConfigMap, so kubelet expands it."""
    r = renders[variant]
    for c in COMPONENTS:
        container = r.container(c)
        assert container["command"] == [f"{c}-service"]
        args = container["args"]
        data = r.settings(c)
        expected = ["--host", "--port", "--grace", "--max-message-bytes", "--max-concurrent-rpcs"]
        # With PostgreSQL the URL comes from a Secret as SPECWIRE_DB, the server's --db default: no --db.
        expected += ["--db"] if c == "config" and "SPECWIRE_DB" in data else []
        expected += {"config": ["--max-config-bytes", "--max-extra-bytes"], "draft": [], "target": []}[c]
        expected += ["--model"] if "SPECWIRE_MODEL" in data else []
        expected += ["--max-sessions", "--session-idle-timeout"] if c == "draft" else []
        if c == "target":
            expected += ["--device", "--dtype", "--config-address", "--config-stale-max", "--draft-address"]
            expected += ["--tensor-parallel"] if "SPECWIRE_TENSOR_PARALLEL" in data else []
            expected += ["--scheduler"]
            expected += ["--max-batch-rows", "--max-tokens-per-step", "--max-queued", "--max-lane-requests"]
            expected += ["--kv-cache-mb"]
            expected += ["--slot-tokens"] if "SPECWIRE_SLOT_TOKENS" in data else []
            expected += ["--max-model-len"] if "SPECWIRE_MAX_MODEL_LEN" in data else []
            expected += ["--max-new-tokens"] if "SPECWIRE_MAX_NEW_TOKENS" in data else []
            expected += ["--max-request-rows", "--max-prompts", "--max-beams", "--max-stop-strings"]
            expected += ["--max-stop-string-chars", "--max-bias-entries"]
            expected += ["--max-output-bytes"] if "SPECWIRE_MAX_OUTPUT_BYTES" in data else []
            expected += ["--max-prompt-chars", "--prepare-workers", "--max-preparing", "--stuck-after"]
        assert [a for a in args if a.startswith("--")] == expected, (c, args)
        (ref,) = [e["configMapRef"]["name"] for e in container["envFrom"] if "configMapRef" in e][:1]
        assert ref == f"{RELEASE}-specwire-{c}"
        for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
            assert var in data, f"{c}: $({var}) is not in its ConfigMap"
        assert data["SPECWIRE_PORT"] == str(PORTS[c])
    model = r.settings("draft").get("SPECWIRE_MODEL")
    assert ("--model" in r.container("draft")["args"]) == bool(model)


def test_scheduler_values_reach_the_target_command_line(tools, renders):
    """The expanded args parse with the target's real CLI: the chart's defaults are the server's."""
    from specwire.target_service.__main__ import build_parser, resolve_scheduler

    def parsed(r):
        data = r.settings("target")
        args = [re.sub(r"\$\((\w+)\)", lambda m: data[m.group(1)], a) for a in r.container("target")["args"]]
        return build_parser().parse_args(args)

    defaults = parsed(renders["default"])
    cli_defaults = build_parser().parse_args([])
    cli_defaults.scheduler = resolve_scheduler(cli_defaults)  # unset on the command line: the default
    names = ("scheduler", "max_batch_rows", "max_tokens_per_step", "max_queued", "max_lane_requests")
    for name in (*names, "slot_tokens", "kv_cache_mb"):
        assert getattr(defaults, name) == getattr(cli_defaults, name), name
    custom = Rendered(
        template(
            tools,
            "--set",
            "target.scheduler.mode=sequential,target.scheduler.maxBatchRows=4,target.scheduler.maxQueued=0,target.scheduler.maxLaneRequests=2,"
            "target.scheduler.slotTokens=4096,target.scheduler.kvCacheMb=512,target.scheduler.maxTokensPerStep=64",
        ).stdout
    )
    args = parsed(custom)
    assert (args.scheduler, args.max_batch_rows, args.max_queued, args.max_lane_requests) == ("sequential", 4, 0, 2)
    assert (args.slot_tokens, args.kv_cache_mb, args.max_tokens_per_step) == (4096, 512.0, 64)


LIMIT_FLAGS = (
    "max_model_len",
    "max_new_tokens",
    "max_request_rows",
    "max_prompts",
    "max_beams",
    "max_stop_strings",
    "max_stop_string_chars",
    "max_bias_entries",
    "max_output_bytes",
    "max_prompt_chars",
    "prepare_workers",
    "max_preparing",
    "max_message_bytes",
    "max_concurrent_rpcs",
    "grace",
)


def test_limit_values_reach_the_target_command_line(tools, renders):
    """Request limits, message size and RPC cap: the chart's defaults are the server's, and values reach it."""
    from specwire.target_service.__main__ import build_parser, resolve_scheduler

    def parsed(r):
        data = r.settings("target")
        args = [re.sub(r"\$\((\w+)\)", lambda m: data[m.group(1)], a) for a in r.container("target")["args"]]
        return build_parser().parse_args(args)

    defaults = parsed(renders["default"])
    cli_defaults = build_parser().parse_args([])
    cli_defaults.scheduler = resolve_scheduler(cli_defaults)  # unset on the command line: the default
    for name in LIMIT_FLAGS:
        if name != "grace":  # derived from the pod's termination period
            assert getattr(defaults, name) == getattr(cli_defaults, name), name
    values = {
        "maxModelLen": 4096,
        "maxNewTokens": 1024,
        "maxRequestRows": 32,
        "maxPrompts": 8,
        "maxBeams": 4,
        "maxStopStrings": 10,
        "maxStopStringChars": 50,
        "maxBiasEntries": 100,
        "maxOutputBytes": 1000000,
        "maxPromptChars": 20000,
        "prepareWorkers": 3,
        "maxPreparing": 5,
    }
    sets = ",".join(f"target.limits.{k}={v}" for k, v in values.items())
    sets += ",target.maxMessageBytes=4194304,target.maxConcurrentRpcs=64,target.graceSeconds=100"
    args = parsed(Rendered(template(tools, "--set", sets).stdout))
    got = {name: getattr(args, name) for name in LIMIT_FLAGS}
    assert got == {
        "max_model_len": 4096,
        "max_new_tokens": 1024,
        "max_request_rows": 32,
        "max_prompts": 8,
        "max_beams": 4,
        "max_stop_strings": 10,
        "max_stop_string_chars": 50,
        "max_bias_entries": 100,
        "max_output_bytes": 1000000,
        "max_prompt_chars": 20000,
        "prepare_workers": 3,
        "max_preparing": 5,
        "max_message_bytes": 4194304,
        "max_concurrent_rpcs": 64,
        "grace": 100.0,
    }


def test_config_and_draft_size_values_are_their_cli_flags(tools, renders):
    """The flags the chart passes exist on the config and draft services' real CLIs, with the same defaults."""
    r = Rendered(
        template(
            tools,
            "--set",
            "config.maxConfigBytes=65536,config.maxExtraBytes=1024,config.maxMessageBytes=2097152,"
            "draft.maxConcurrentRpcs=100,draft.maxMessageBytes=8388608",
        ).stdout
    )
    assert r.settings("config")["SPECWIRE_MAX_CONFIG_BYTES"] == "65536"
    assert r.settings("config")["SPECWIRE_MAX_EXTRA_BYTES"] == "1024"
    assert r.settings("config")["SPECWIRE_MAX_MESSAGE_BYTES"] == "2097152"
    assert r.settings("draft")["SPECWIRE_MAX_CONCURRENT_RPCS"] == "100"
    assert r.settings("draft")["SPECWIRE_MAX_MESSAGE_BYTES"] == "8388608"
    for c in ("config", "draft"):
        text = subprocess.run(
            [sys.executable, "-m", f"specwire.{c}_service", "--help"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ).stdout
        text = " ".join(text.split())  # argparse wraps the help text
        data = renders["default"].settings(c)
        for flag in [a for a in r.container(c)["args"] if a.startswith("--max-") or a == "--grace"]:
            assert flag in text, (c, flag)
        # The chart's defaults are the servers' defaults.
        assert f"default {data['SPECWIRE_MAX_MESSAGE_BYTES']}" in text
        assert f"default {data['SPECWIRE_MAX_CONCURRENT_RPCS']}" in text
        if c == "config":
            assert f"default {data['SPECWIRE_MAX_CONFIG_BYTES']}" in text
            assert f"default {data['SPECWIRE_MAX_EXTRA_BYTES']})" in text


def expanded_args(r: Rendered, component: str) -> list[str]:
    """The container's args as the kubelet runs them: each $(VAR) replaced by its ConfigMap value."""
    data = r.settings(component)
    return [re.sub(r"\$\((\w+)\)", lambda m: data[m.group(1)], a) for a in r.container(component)["args"]]


def flag_value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


def test_session_and_liveness_values_reach_the_right_servers(tools, renders, tmp_path):
    """draft.maxSessions, draft.sessionIdleTimeoutSeconds and target.stuckAfterSeconds become the draft's
    --max-sessions/--session-idle-timeout and the target's --stuck-after, with the servers' defaults."""
    from specwire.draft_service.__main__ import _idle_timeout, _positive_int
    from specwire.target_service.__main__ import build_parser

    draft_help = subprocess.run(
        [sys.executable, "-m", "specwire.draft_service", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout
    draft_help = " ".join(draft_help.split())  # argparse wraps the help text

    r = renders["default"]
    draft, target = expanded_args(r, "draft"), expanded_args(r, "target")
    # Each flag goes to its own server only.
    for flag in ("--max-sessions", "--session-idle-timeout"):
        assert flag in draft and flag not in target and flag not in r.container("config")["args"]
    assert "--stuck-after" in target and "--stuck-after" not in draft + r.container("config")["args"]
    # The chart's defaults are the servers' defaults.
    assert flag_value(draft, "--max-sessions") == "64" and "(default 64)" in draft_help
    assert flag_value(draft, "--session-idle-timeout") == "60" and "never (default 60)" in draft_help
    assert build_parser().parse_args(target).stuck_after == build_parser().parse_args([]).stuck_after == 60.0

    # Overrides from a values file (where fractional seconds stay numbers) reach the servers' parsers.
    values = tmp_path / "sessions.yaml"
    values.write_text(
        "draft:\n  maxSessions: 3\n  sessionIdleTimeoutSeconds: 0.5\ntarget:\n  stuckAfterSeconds: 90.25\n"
    )
    custom = Rendered(template(tools, "-f", str(values)).stdout)
    draft, target = expanded_args(custom, "draft"), expanded_args(custom, "target")
    assert _positive_int(flag_value(draft, "--max-sessions")) == 3
    assert _idle_timeout(flag_value(draft, "--session-idle-timeout")) == 0.5
    assert build_parser().parse_args(target).stuck_after == 90.25
    # 0 is "never" on the draft, and is passed through rather than dropped (the server's default is 60).
    never = Rendered(template(tools, "--set", "draft.sessionIdleTimeoutSeconds=0,draft.maxSessions=1000").stdout)
    draft = expanded_args(never, "draft")
    assert _idle_timeout(flag_value(draft, "--session-idle-timeout")) is None
    assert _positive_int(flag_value(draft, "--max-sessions")) == 1000


def test_checksum_rolls_pods_when_settings_change(tools, renders):
    def checksums(r):
        return {
            c: r.get("Deployment", c)["spec"]["template"]["metadata"]["annotations"]["checksum/settings"]
            for c in COMPONENTS
        }

    before = checksums(renders["default"])
    after = checksums(Rendered(template(tools, "--set", "target.model.name=Qwen/Qwen3-0.6B").stdout))
    assert after["target"] != before["target"]
    assert after["draft"] == before["draft"] and after["config"] == before["config"]


# --- helm test -----------------------------------------------------------------------------------


def test_helm_test_pod_checks_every_service(renders):
    r = renders["default"]
    pod = r.get("Pod", "test-health")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "/etc/specwire/scripts/health_check.py"]
    targets = [a for a in command if "/" in a and ":" in a]
    expected = []
    for c in COMPONENTS:
        addr = f"{RELEASE}-specwire-{c}.{NAMESPACE}.svc.cluster.local:{PORTS[c]}"
        expected += [f"{addr}/", f"{addr}/{HEALTH_NAMES[c]}"]
    assert targets == expected
    assert pod["spec"]["volumes"][1]["configMap"]["name"] == f"{RELEASE}-specwire-scripts"


def test_helm_test_pod_skips_a_disabled_draft(tools):
    r = Rendered(template(tools, "--set", "draft.enabled=false").stdout)
    command = r.get("Pod", "test-health")["spec"]["containers"][0]["command"]
    assert not [a for a in command if "draft" in a]
    assert not [d for d in r.docs if d["metadata"]["name"].endswith("-draft")]
    assert "SPECWIRE_DRAFT_ADDRESS" not in r.settings("target")
    assert "--draft-address" not in r.container("target")["args"]


def test_a_dflash_assistant_is_the_targets_flag_and_refused_with_tensor_parallelism(tools):
    r = Rendered(template(tools, "--set", "target.dflashModel=org/dflash").stdout)
    assert r.settings("target")["SPECWIRE_DFLASH_MODEL"] == "org/dflash"
    args = r.container("target")["args"]
    assert args[args.index("--dflash-model") + 1] == "$(SPECWIRE_DFLASH_MODEL)"
    assert "--dflash-model" not in Rendered(template(tools).stdout).container("target")["args"]
    failed = template(tools, "--set", "target.dflashModel=org/dflash", "--set", "target.tensorParallel=2", check=False)
    assert failed.returncode != 0 and "target.dflashModel with target.tensorParallel" in failed.stderr


def test_a_colocated_draft_model_is_the_targets_flag_and_no_draft_address(tools):
    r = Rendered(template(tools, "--set", "target.draftModel=default-int8", "--set", "draft.enabled=false").stdout)
    assert r.settings("target")["SPECWIRE_DRAFT_MODEL"] == "default-int8"
    args = r.container("target")["args"]
    assert args[args.index("--draft-model") + 1] == "$(SPECWIRE_DRAFT_MODEL)"
    assert "--draft-address" not in args and "SPECWIRE_DRAFT_ADDRESS" not in r.settings("target")
    # With the draft service still deployed, the target still does not get its address (both are refused).
    r = Rendered(template(tools, "--set", "target.draftModel=default-int8").stdout)
    assert "--draft-address" not in r.container("target")["args"]


def test_draft_overlap_is_on_by_default_and_a_value_turns_it_off(tools):
    args = Rendered(template(tools).stdout).container("target")["args"]
    assert "--draft-address" in args and "--no-draft-overlap" not in args
    args = Rendered(template(tools, "--set", "target.draftOverlap=false").stdout).container("target")["args"]
    assert "--draft-address" in args and "--no-draft-overlap" in args


def test_the_adaptive_speculation_controller_is_on_unless_turned_off(tools):
    assert "--no-adaptive-speculation" not in Rendered(template(tools).stdout).container("target")["args"]
    off = Rendered(template(tools, "--set", "target.adaptiveSpeculation=false").stdout)
    assert "--no-adaptive-speculation" in off.container("target")["args"]
    # A typo or a string is refused by the values schema, not ignored.
    bad = template(tools, "--set-string", "target.adaptiveSpeculation=no", check=False)
    assert bad.returncode != 0 and "adaptiveSpeculation" in bad.stderr


HEALTH_SERVER = textwrap.dedent(
    """
    import sys, grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("specwire.target.v1.TargetService", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("specwire.draft.v1.DraftService", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    """
)


def test_the_rendered_health_check_script_works(renders, tmp_path):
    """Run the script exactly as the chart ships it against a real grpc.health.v1 server."""
    script = tmp_path / "health_check.py"
    script.write_text(renders["default"].get("ConfigMap", "scripts")["data"]["health_check.py"])
    server = subprocess.Popen(
        [sys.executable, "-c", HEALTH_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        addr = f"127.0.0.1:{port}"

        def run(*targets):
            env = {k: v for k, v in os.environ.items() if not k.startswith("SPECWIRE_")}
            return subprocess.run(
                [sys.executable, str(script), "--timeout", "3", *targets],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )

        ok = run(f"{addr}/", f"{addr}/specwire.target.v1.TargetService")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert ok.stdout.count("SERVING") == 2
        not_serving = run(f"{addr}/", f"{addr}/specwire.draft.v1.DraftService")
        assert not_serving.returncode == 1 and "NOT_SERVING" in not_serving.stdout
        unknown = run(f"{addr}/specwire.config.v1.ConfigService")
        assert unknown.returncode == 2 and "NOT_FOUND" in unknown.stdout
    finally:
        server.stdin.close()
        server.wait(timeout=10)


def test_config_stale_max_reaches_the_target(tools, renders, tmp_path):
    """target.configStaleMaxSeconds becomes the target's --config-stale-max, with the server's default; 0
    (no stale serving) is passed through, not dropped."""
    from specwire.target_service.__main__ import build_parser

    target = expanded_args(renders["default"], "target")
    assert build_parser().parse_args(target).config_stale_max == build_parser().parse_args([]).config_stale_max == 300
    values = tmp_path / "stale.yaml"  # a values file: fractional seconds stay numbers there
    values.write_text("target:\n  configStaleMaxSeconds: 12.5\n")
    for args in (["--set", "target.configStaleMaxSeconds=0"], ["-f", str(values)]):
        custom = Rendered(template(tools, *args).stdout)
        assert build_parser().parse_args(expanded_args(custom, "target")).config_stale_max == (
            0 if "--set" in args else 12.5
        )
    failed = template(tools, "--set", "target.configStaleMaxSeconds=-1", check=False)
    assert failed.returncode != 0 and "configStaleMaxSeconds" in failed.stderr
