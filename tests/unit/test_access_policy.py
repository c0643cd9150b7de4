"""The method -> role table against the protos, and the access decisions without a server (the servers:
tests/service/test_roles.py, test_mtls_roles.py, test_insecure_token.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

import grpc
import pytest

from specwire.security.access import AccessDenied, AccessPolicy, ServerAccess, env_flag, is_loopback
from specwire.security.channels import address_host, check_token_transport
from specwire.security.roles import METHOD_ROLES, Role, is_registry_write, required_role
from specwire.security.tokens import SecuritySettingsError, read_token

ROOT = Path(__file__).resolve().parents[2]
CREATE = "/specwire.config.v1.ConfigService/CreateConfig"
GET = "/specwire.config.v1.ConfigService/GetConfig"
GENERATE = "/specwire.target.v1.TargetService/Generate"


def proto_methods() -> list[str]:
    """`/package.Service/Method` of every RPC of every service in the generated stubs of protos/."""
    methods = []
    for path in sorted((ROOT / "specwire").glob("*/v*/*_pb2.py")):
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for service in module.DESCRIPTOR.services_by_name.values():
            methods += [f"/{service.full_name}/{m.name}" for m in service.methods]
    return methods


def test_every_rpc_in_the_protos_has_a_role():
    methods = proto_methods()
    assert len(methods) >= 13, methods  # the config (9), target (3) and draft (1) services at least
    missing = [m for m in methods if m not in METHOD_ROLES]
    assert not missing, f"classify these RPCs in specwire/security/roles.py METHOD_ROLES: {missing}"


def test_registry_writes_need_the_admin_role_and_everything_else_a_reader():
    writes = {m.rsplit("/", 1)[1] for m in proto_methods() if is_registry_write(m)}
    assert writes == {"CreateConfig", "UpdateConfig", "SetTag", "DeleteTag", "DeleteConfig", "ImportConfig"}
    assert all(METHOD_ROLES[m] is Role.READER for m in proto_methods() if not is_registry_write(m))
    # Unlisted (an RPC nobody classified): closed, admin only.
    assert required_role("/specwire.config.v1.ConfigService/Unclassified") is Role.ADMIN
    assert required_role("/specwire.target.v1.TargetService/Unclassified") is Role.ADMIN
    assert required_role("/grpc.health.v1.Health/Check") is None
    assert Role.ADMIN.allows(Role.READER) and not Role.READER.allows(Role.ADMIN)


def test_tokens_map_to_roles_and_callers():
    policy = AccessPolicy(reader_token="r-secret", admin_token="a-secret")
    assert policy.authorize(GET, ["Bearer r-secret"]) == "reader:token"
    assert policy.authorize(CREATE, ["Bearer a-secret"]) == "admin:token"
    assert policy.authorize(GENERATE, ["bearer a-secret"]) == "admin:token"  # the scheme is case-insensitive
    for metadata, code in [
        ([], grpc.StatusCode.UNAUTHENTICATED),
        (["Bearer w-secret"], grpc.StatusCode.UNAUTHENTICATED),
        (["Basic a-secret"], grpc.StatusCode.UNAUTHENTICATED),
        (["Bearer r-secret", "Bearer a-secret"], grpc.StatusCode.UNAUTHENTICATED),
        (["Bearer r-secret"], grpc.StatusCode.PERMISSION_DENIED),
    ]:
        with pytest.raises(AccessDenied) as info:
            policy.authorize(CREATE, metadata)
        assert info.value.code == code, (metadata, info.value.message)
        assert "secret" not in info.value.message, "a token is never echoed"
    assert policy.authorize("/grpc.health.v1.Health/Check") == "anonymous"


def test_anonymous_server_refuses_tokens_and_off_loopback_writes():
    loopback = AccessPolicy(host="127.0.0.1")
    assert loopback.authorize(CREATE) == "anonymous"
    with pytest.raises(AccessDenied) as info:
        loopback.authorize(GET, ["Bearer x"])
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and "no tokens configured" in info.value.message
    lan = AccessPolicy(host="0.0.0.0")
    assert lan.authorize(GET) == "anonymous"
    with pytest.raises(AccessDenied) as info:
        lan.authorize(CREATE)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED and "--allow-anonymous-writes" in info.value.message
    assert AccessPolicy(host="::", access=ServerAccess(allow_anonymous_writes=True)).authorize(CREATE) == "anonymous"
    assert any("writes refused: bound to 0.0.0.0" in line for line in lan.describe(serves_writes=True))


def test_start_up_log_says_when_nobody_can_write():
    reader_only = AccessPolicy(reader_token="r", mutual_tls=True)
    assert any("writes refused: no admin credentials" in line for line in reader_only.describe(serves_writes=True))
    assert not any("writes refused" in line for line in reader_only.describe(serves_writes=False))
    with_admin = AccessPolicy(reader_token="r", admin_token="a", host="0.0.0.0")
    assert not any("writes refused" in line for line in with_admin.describe(serves_writes=True))
    read_only = AccessPolicy(admin_token="a", access=ServerAccess(read_only=True))
    assert "writes refused: read-only (--read-only)" in read_only.describe(serves_writes=True)
    assert any("has the admin role" in line for line in AccessPolicy(mutual_tls=True).describe(serves_writes=True))


def test_settings_that_cannot_be_honoured_are_refused(tmp_path):
    with pytest.raises(SecuritySettingsError, match="a token has one role"):
        AccessPolicy.from_env("127.0.0.1", env={"SPECWIRE_AUTH_TOKEN": "t", "SPECWIRE_ADMIN_TOKEN": "t"})
    with pytest.raises(SecuritySettingsError, match="need mutual TLS"):
        AccessPolicy.from_env("127.0.0.1", env={"SPECWIRE_ADMIN_IDENTITIES": "spiffe://x"})
    with pytest.raises(SecuritySettingsError, match="--allow-insecure-token"):
        AccessPolicy.from_env("0.0.0.0", env={"SPECWIRE_AUTH_TOKEN": "t"})
    allowed = {"SPECWIRE_AUTH_TOKEN": "t", "SPECWIRE_ALLOW_INSECURE_TOKEN": "true"}
    assert AccessPolicy.from_env("0.0.0.0", env=allowed).reader_token == "t"
    with pytest.raises(SecuritySettingsError, match="expected true or false"):
        env_flag("SPECWIRE_READ_ONLY", {"SPECWIRE_READ_ONLY": "maybe"})
    token = tmp_path / "admin"
    token.write_text("from-a-file\n")
    assert read_token("SPECWIRE_ADMIN_TOKEN", {"SPECWIRE_ADMIN_TOKEN_FILE": str(token)}) == "from-a-file"
    with pytest.raises(SecuritySettingsError, match="not both"):
        read_token("SPECWIRE_ADMIN_TOKEN", {"SPECWIRE_ADMIN_TOKEN_FILE": str(token), "SPECWIRE_ADMIN_TOKEN": "x"})
    with pytest.raises(SecuritySettingsError, match="cannot read"):
        read_token("SPECWIRE_ADMIN_TOKEN", {"SPECWIRE_ADMIN_TOKEN_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecuritySettingsError, match="is empty"):
        read_token("SPECWIRE_ADMIN_TOKEN", {"SPECWIRE_ADMIN_TOKEN_FILE": str(tmp_path / "empty")})


@pytest.mark.parametrize(
    "address, host, local",
    [
        ("127.0.0.1:50051", "127.0.0.1", True),
        ("localhost:50051", "localhost", True),
        ("[::1]:50051", "::1", True),
        ("dns:///localhost:50051", "localhost", True),
        ("unix:/tmp/specwire.sock", None, True),
        ("10.0.0.5:50051", "10.0.0.5", False),
        ("dns:///specwire-draft.ns.svc.cluster.local:50053", "specwire-draft.ns.svc.cluster.local", False),
        ("dns://8.8.8.8/registry.example:50051", "registry.example", False),
        ("ipv4:10.0.0.5:1,10.0.0.6:1", "10.0.0.5", False),
        ("[2001:db8::1]:50051", "2001:db8::1", False),
    ],
)
def test_addresses_and_loopback(address, host, local):
    assert address_host(address) == host
    assert (host is None or is_loopback(host)) == local
    env = {"SPECWIRE_AUTH_TOKEN": "t"}
    if local:
        check_token_transport(address, env=env)
    else:
        with pytest.raises(SecuritySettingsError, match="SPECWIRE_TLS_CA_FILE"):
            check_token_transport(address, env=env)
        check_token_transport(address, env=env, allow_insecure_token=True)
        check_token_transport(address, env={**env, "SPECWIRE_ALLOW_INSECURE_TOKEN": "1"})
        check_token_transport(address, env=env, token="")  # no token: nothing to protect


def test_bind_addresses_off_loopback():
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "192.168.1.4", "registry.internal"))
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
