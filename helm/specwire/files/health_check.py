"""Check grpc.health.v1 on specwire servers; used by `helm test` and, with TLS, by the exec probes.

Usage:
    health_check.py [--timeout S] [--attempts N] [--tls-server-name NAME] ADDRESS/SERVICE [...]

Each target is `host:port/service`; `host:port/` checks the server's overall health (service "").
TLS is used when SPECWIRE_TLS_CERT_FILE is set (the chart sets it when `tls.enabled`): the server
is verified against SPECWIRE_TLS_CA_FILE when that file exists, else the system roots, and the
certificate and key are offered as a client certificate. SPECWIRE_AUTH_TOKEN, when set, is sent as
a bearer token.

Exit status: 0 when every target is SERVING, 1 when one reports another status, 2 on an RPC error.
"""

import argparse
import os
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _channel(address, server_name):
    cert_file = os.environ.get("SPECWIRE_TLS_CERT_FILE")
    if not cert_file:
        return grpc.insecure_channel(address)
    ca_file = os.environ.get("SPECWIRE_TLS_CA_FILE", "")
    key_file = os.environ.get("SPECWIRE_TLS_KEY_FILE", "")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file) if ca_file and os.path.exists(ca_file) else None,
        private_key=_read(key_file) if key_file and os.path.exists(key_file) else None,
        certificate_chain=_read(cert_file) if os.path.exists(cert_file) else None,
    )
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(target, *, timeout, server_name):
    """Return (exit code, message) for one `host:port/service` target."""
    address, _, service = target.rpartition("/")
    if not address:
        return 2, f"{target}: expected host:port/service (service may be empty)"
    token = os.environ.get("SPECWIRE_AUTH_TOKEN")
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        with _channel(address, server_name) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=metadata
            )
    except grpc.RpcError as e:
        return 2, f"{address} {service or '(overall)'}: {e.code().name} {e.details() or ''}".rstrip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    code = 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1
    return code, f"{address} {service or '(overall)'}: {status}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", metavar="ADDRESS/SERVICE")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per check (default 5)")
    parser.add_argument("--attempts", type=int, default=1, help="tries per target, 2 s apart (default 1)")
    parser.add_argument("--tls-server-name", default="", help="name to verify in the server certificate")
    args = parser.parse_args(argv)

    worst = 0
    for target in args.targets:
        for attempt in range(1, args.attempts + 1):
            code, message = check(target, timeout=args.timeout, server_name=args.tls_server_name)
            if code == 0 or attempt == args.attempts:
                break
            time.sleep(2)
        print(message, flush=True)
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    sys.exit(main())
