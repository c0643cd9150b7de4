"""Transport security, bearer tokens and roles, configured by environment (as the Helm chart sets it).

- `SPECWIRE_TLS_CERT_FILE` + `SPECWIRE_TLS_KEY_FILE`: servers listen with TLS; clients verify the
  server against `SPECWIRE_TLS_CA_FILE` (or the system roots). When the CA is given to a server it
  also requires client certificates (mutual TLS between the services).
- `SPECWIRE_AUTH_TOKEN` (or `..._FILE`): the reader token (reads and generation); clients send it (or
  their `token=`) as `authorization: Bearer <token>`. `SPECWIRE_ADMIN_TOKEN` (or `..._FILE`): the admin
  token (also registry writes). `SPECWIRE_ADMIN_IDENTITIES` / `SPECWIRE_READER_IDENTITIES`: client
  certificate identities (mutual TLS) and their role. Health checks and reflection stay open.

Unset variables mean plaintext and anonymous calls: the local default. Off loopback, anonymous registry
writes and tokens over plaintext are refused unless explicitly allowed.

Modules:
- `tls`: server and channel TLS credentials.
- `tokens`: the bearer token clients send, and servers' tokens from env or files.
- `roles`: the role each RPC needs (one table).
- `access`: a server's credentials and access flags, and the decision for one call.
- `authorization`: the server interceptor applying that decision and setting the caller's identity.
- `channels`: every client channel (keepalive, message limits, TLS, token, tracing).
- `identity`: who is calling, as the server's authorization found it.
"""
