"""Transport security and bearer tokens, configured by environment (as the Helm chart sets it).

- `SPECWIRE_TLS_CERT_FILE` + `SPECWIRE_TLS_KEY_FILE`: servers listen with TLS; clients verify the
  server against `SPECWIRE_TLS_CA_FILE` (or the system roots). When the CA is given to a server it
  also requires client certificates (mutual TLS between the services).
- `SPECWIRE_AUTH_TOKEN`: servers refuse calls without `authorization: Bearer <token>` with
  UNAUTHENTICATED (health checks and reflection stay open so probes and grpcurl work); clients send it.

Unset variables mean plaintext and no token: the local default.

Modules:
- `tls`: server and channel TLS credentials.
- `tokens`: the bearer token clients send and servers check.
- `channels`: every client channel (keepalive, message limits, TLS, token, tracing).
- `identity`: who is calling, as the server's authorization found it.
"""
