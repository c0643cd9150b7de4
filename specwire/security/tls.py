"""TLS credentials of servers and client channels, from `SPECWIRE_TLS_*` files.

Servers fail closed: TLS settings that are only half there (a CA with no certificate/key, a
certificate with no key, a file that is missing or does not parse, a key that is not the
certificate's) raise `TlsSettingsError` with the fix instead of serving plaintext or failing at the
first handshake. A server reloads its certificate, key and CA when their files change (cert-manager
renews a Secret; the kubelet swaps the mounted files through the `..data` symlink): gRPC asks
`CertificateReloader` before every new handshake, and it reads the files at most once a second.
Connections already open keep the certificate they were made with.

Client channels read the files when the channel is created: a channel made after a renewal presents
the new client certificate; one that lives on keeps presenting the one it was made with.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from specwire.security.tokens import SecuritySettingsError

log = logging.getLogger("specwire.security.tls")

CERT_ENV, KEY_ENV, CA_ENV = "SPECWIRE_TLS_CERT_FILE", "SPECWIRE_TLS_KEY_FILE", "SPECWIRE_TLS_CA_FILE"
# A handshake asks for new files at most this often: reading three small files once a second
# is nothing next to a TLS handshake, and a renewal is picked up within a second.
RELOAD_INTERVAL_S = 1.0


class TlsSettingsError(SecuritySettingsError):
    """`SPECWIRE_TLS_*` settings that cannot give the transport security they ask for (message ends with the fix)."""


def _problem(what: str, fix: str) -> TlsSettingsError:
    return TlsSettingsError(f"TLS settings refused: {what}\n  fix: {fix}")


@dataclass(frozen=True)
class TlsFiles:
    """Where a process's certificate, private key and CA are (paths as given; any may be None)."""

    cert: str | None
    key: str | None
    ca: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> TlsFiles:
        """The paths in `SPECWIRE_TLS_{CERT,KEY,CA}_FILE`; an empty variable counts as unset."""
        return cls(env.get(CERT_ENV) or None, env.get(KEY_ENV) or None, env.get(CA_ENV) or None)

    def check_pairing(self) -> None:
        """Refuse a certificate without its key or a key without its certificate."""
        if self.cert and not self.key:
            raise _problem(
                f"{CERT_ENV} is set ({self.cert}) but {KEY_ENV} is not: a certificate cannot be presented without "
                "its private key",
                f"set {KEY_ENV} to the PEM private key of that certificate, or unset {CERT_ENV}",
            )
        if self.key and not self.cert:
            raise _problem(
                f"{KEY_ENV} is set ({self.key}) but {CERT_ENV} is not: a private key is no use without its certificate",
                f"set {CERT_ENV} to the PEM certificate (chain) of that key, or unset {KEY_ENV}",
            )


@dataclass(frozen=True)
class PemFiles:
    """The bytes of a `TlsFiles`, as one set read together."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None


def _read(variable: str, path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _problem(
            f"{variable}={path} cannot be read ({exc.strerror or exc})",
            f"point {variable} at a readable PEM file (is the Secret mounted?), or unset it",
        ) from None


def _read_all(files: TlsFiles) -> PemFiles:
    return PemFiles(_read(CERT_ENV, files.cert), _read(KEY_ENV, files.key), _read(CA_ENV, files.ca))


def _no_password() -> bytes:
    # An encrypted key would otherwise make OpenSSL prompt on the terminal; gRPC cannot use one anyway.
    return b""


def load_checked(files: TlsFiles) -> PemFiles:
    """Read and check the files: the key is the certificate's, the CA parses.

    The files are read, checked by OpenSSL from their paths, and read again: a set that changed in
    between (a renewal half written) is refused, so the bytes returned are the ones that were checked.

    Raises:
        TlsSettingsError: a file is missing, does not parse, or the key does not match the certificate.
    """
    files.check_pairing()
    first = _read_all(files)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if files.cert and files.key:
        try:
            context.load_cert_chain(files.cert, files.key, password=_no_password)
        except (ssl.SSLError, OSError) as exc:
            raise _problem(
                f"the certificate {files.cert} and the private key {files.key} do not make a pair "
                f"(OpenSSL says: {exc})",
                f"give {CERT_ENV} a PEM certificate (chain, leaf first) and {KEY_ENV} its unencrypted PEM private "
                "key, e.g. `tls.crt` and `tls.key` of the same kubernetes.io/tls Secret",
            ) from None
    if files.ca:
        try:
            context.load_verify_locations(cafile=files.ca)
        except (ssl.SSLError, OSError) as exc:
            raise _problem(
                f"{CA_ENV}={files.ca} holds no usable CA certificate (OpenSSL says: {exc})",
                f"point {CA_ENV} at the PEM certificate(s) of the CA that signs the peers (`ca.crt`)",
            ) from None
    if _read_all(files) != first:
        raise _problem(
            "the certificate files changed while they were being read",
            "retry; this happens when a renewal writes the files one by one",
        )
    return first


def _fingerprint(pem: bytes | None) -> str:
    return hashlib.sha256(pem or b"").hexdigest()[:12]


class CertificateReloader:
    """The fetcher of `grpc.dynamic_ssl_server_credentials`: a new certificate configuration when the
    files changed since the one being served, else None (gRPC keeps the current one).

    gRPC calls it from its own threads before each new handshake. It reads the files at most once every
    `interval_s` seconds; a set that does not check out (a key that is not the new certificate's, a file
    missing mid-renewal) is logged and the old certificate kept, and it is tried again a second later.

    Args:
        files (`TlsFiles`): the server's certificate, key and optional CA.
        served (`PemFiles`): the checked contents being served now.
        interval_s (`float`, defaults to `RELOAD_INTERVAL_S`): least time between two reads of the files.
    """

    def __init__(self, files: TlsFiles, served: PemFiles, interval_s: float = RELOAD_INTERVAL_S):
        self.files = files
        self.served = served
        self.interval_s = interval_s
        self.reloads = 0  # how many new configurations were handed to gRPC
        self._checked_at = time.monotonic()
        self._refusal = ""  # the last reason a changed set was not loaded
        self._lock = threading.Lock()

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        # Handshakes run concurrently; the ones arriving while another checks keep the current config.
        if not self._lock.acquire(blocking=False):
            return None
        try:
            now = time.monotonic()
            if now - self._checked_at < self.interval_s:
                return None
            self._checked_at = now
            try:
                if _read_all(self.files) == self.served:
                    return None
                fresh = load_checked(self.files)
            except TlsSettingsError as error:
                if str(error) != self._refusal:  # once per problem, not once a second
                    log.warning("TLS files changed but were not reloaded, the old certificate stays: %s", error)
                    self._refusal = str(error)
                return None
            except Exception:  # noqa: BLE001 - a fetcher that raises would fail the handshake
                log.exception("TLS reload check failed; the old certificate stays")
                return None
            self.served = fresh
            self.reloads += 1
            self._refusal = ""
            log.info(
                "TLS: reloaded certificate %s (sha256 %s), CA %s (sha256 %s)",
                self.files.cert,
                _fingerprint(fresh.cert),
                self.files.ca or "none",
                _fingerprint(fresh.ca),
            )
            return _configuration(fresh)
        finally:
            self._lock.release()


class ClientFilesWatch:
    """Whether the TLS files a client channel was made with changed since, so that a long-lived channel
    (the target's to the registry and to the draft service) can be replaced by one presenting the
    renewed client certificate: a channel reads the files once, when it is made.

    The files are read at most once every `interval_s` seconds. A changed set that does not check out
    (a renewal half written) counts as unchanged until it does. Without TLS files it never changes.

    Args:
        env (`Mapping`): where the `SPECWIRE_TLS_*` paths are read.
        interval_s (`float`, defaults to `RELOAD_INTERVAL_S`): least time between two reads of the files.
    """

    def __init__(self, env: Mapping[str, str] = os.environ, interval_s: float = RELOAD_INTERVAL_S):
        self.files = TlsFiles.from_env(env)
        self.interval_s = interval_s
        self._seen = _read_all(self.files) if self.files.ca or self.files.cert else None
        self._checked_at = time.monotonic()

    def changed(self) -> bool:
        """True once per change of the files (a new channel should be made), else False."""
        if self._seen is None or time.monotonic() - self._checked_at < self.interval_s:
            return False
        self._checked_at = time.monotonic()
        try:
            if _read_all(self.files) == self._seen:
                return False
            fresh = load_checked(self.files)
        except TlsSettingsError as error:
            log.warning("TLS files changed but are not used yet, the channel keeps its certificate: %s", error)
            return False
        self._seen = fresh
        log.info(
            "TLS: client certificate %s changed (sha256 %s): new channels use it",
            self.files.cert,
            _fingerprint(fresh.cert),
        )
        return True


def _configuration(pem: PemFiles) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], root_certificates=pem.ca)


def _server_files(env: Mapping[str, str]) -> TlsFiles | None:
    files = TlsFiles.from_env(env)
    if not (files.cert or files.key or files.ca):
        return None
    if files.ca and not (files.cert or files.key):
        raise _problem(
            f"{CA_ENV} is set ({files.ca}) but {CERT_ENV} and {KEY_ENV} are not, so this server would listen "
            "in plaintext although a CA for mutual TLS was given",
            f"set {CERT_ENV} and {KEY_ENV} to this server's PEM certificate and private key (then clients must "
            f"present a certificate signed by the CA), or unset {CA_ENV} to serve plaintext",
        )
    files.check_pairing()
    return files


def check_server_settings(env: Mapping[str, str] = os.environ) -> None:
    """Refuse a server's TLS settings that are half there (a CA alone would mean plaintext although the
    operator asked for mutual TLS; a certificate without its key) or whose files do not check out.

    Servers call it at start, before loading a model, so a bad setting costs no model load.

    Raises:
        TlsSettingsError: what is wrong, and the fix.
    """
    files = _server_files(env)
    if files is not None:
        load_checked(files)


def server_credentials(
    env: Mapping[str, str] = os.environ, interval_s: float = RELOAD_INTERVAL_S
) -> grpc.ServerCredentials | None:
    """TLS credentials for a server that reload their files when they change, or None for plaintext
    (no `SPECWIRE_TLS_*` set at all).

    With a CA, clients must present a certificate it signed (mutual TLS); whether client certificates
    are required is fixed at start, the CA's contents are reloaded like the rest.

    Raises:
        TlsSettingsError: see `check_server_settings`.
    """
    files = _server_files(env)
    if files is None:
        return None
    served = load_checked(files)
    return grpc.dynamic_ssl_server_credentials(
        _configuration(served),
        CertificateReloader(files, served, interval_s),
        require_client_authentication=served.ca is not None,
    )


def channel_credentials(env: Mapping[str, str] = os.environ) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client (with our certificate for mutual TLS when we have one), or None.

    The files are read now: a channel keeps the client certificate it was made with.

    Raises:
        TlsSettingsError: a certificate without its key (or the reverse), or a file that cannot be read.
    """
    files = TlsFiles.from_env(env)
    if not files.ca and not files.cert and not files.key:
        return None
    files.check_pairing()
    pem = _read_all(files)
    return grpc.ssl_channel_credentials(root_certificates=pem.ca, private_key=pem.key, certificate_chain=pem.cert)
