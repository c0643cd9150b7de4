"""gRPC target forms on client channels: every address of a list, the load-balancing policy chosen."""

from __future__ import annotations

import pytest

from specwire.security.channels import (
    address_hosts,
    check_token_transport,
    client_channel_options,
    load_balancing_policy,
)
from specwire.security.tokens import SecuritySettingsError


@pytest.mark.parametrize(
    "address, hosts",
    [
        ("127.0.0.1:50052", ["127.0.0.1"]),
        (
            "dns:///specwire-target-headless.ns.svc.cluster.local:50052",
            ["specwire-target-headless.ns.svc.cluster.local"],
        ),
        ("ipv4:127.0.0.1:1,10.0.0.6:2", ["127.0.0.1", "10.0.0.6"]),
        ("ipv6:[::1]:1,[2001:db8::1]:2", ["::1", "2001:db8::1"]),
        ("unix:/tmp/s.sock", None),
    ],
)
def test_every_address_of_a_target(address, hosts):
    assert address_hosts(address) == hosts


@pytest.mark.parametrize(
    "address, local",
    [
        ("ipv4:127.0.0.1:1,127.0.0.2:2", True),
        ("ipv6:[::1]:1,[::1]:2", True),
        # One remote address in the list is enough: a call may go there, token and all.
        ("ipv4:127.0.0.1:1,10.0.0.6:1", False),
        ("ipv6:[::1]:1,[2001:db8::1]:2", False),
    ],
)
def test_a_token_goes_in_plaintext_only_when_every_address_is_loopback(address, local):
    env = {"SPECWIRE_AUTH_TOKEN": "t"}
    if local:
        check_token_transport(address, env=env)
    else:
        with pytest.raises(SecuritySettingsError, match="SPECWIRE_TLS_CA_FILE"):
            check_token_transport(address, env=env)
        check_token_transport(address, env=env, allow_insecure_token=True)


@pytest.mark.parametrize(
    "address, policy",
    [
        ("127.0.0.1:50052", "pick_first"),
        ("target:50052", "pick_first"),
        ("dns:///target-headless:50052", "round_robin"),
        ("dns://10.0.0.10/target-headless:50052", "round_robin"),
        ("ipv4:127.0.0.1:1,127.0.0.1:2", "round_robin"),
        ("ipv4:127.0.0.1:1", "pick_first"),
        ("unix:/tmp/s.sock", "pick_first"),
    ],
)
def test_default_policy(address, policy):
    assert load_balancing_policy(address) == policy
    other = {"round_robin": "pick_first", "pick_first": "round_robin"}[policy]
    assert load_balancing_policy(address, other) == other


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(
        ValueError, match=r"load_balancing must be one of \['round_robin', 'pick_first'\], got 'grpclb'"
    ):
        load_balancing_policy("dns:///t:1", "grpclb")


def test_reconnect_options_on_every_channel():
    options = dict(client_channel_options())
    assert options["grpc.max_reconnect_backoff_ms"] == 10_000
    assert options["grpc.dns_min_time_between_resolutions_ms"] == 5_000
    assert options["grpc.initial_reconnect_backoff_ms"] == 1_000
