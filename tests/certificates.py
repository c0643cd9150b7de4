"""Throwaway CAs and certificates for TLS tests, made with the `openssl` command line (OpenSSL 3).

Also lays files out as the kubelet mounts a Secret: the visible names are symlinks through `..data`,
which points at a timestamped folder; an update writes a new folder and swaps `..data` atomically.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(folder: Path, name: str) -> KeyPair:
    """A self-signed CA `name` (an EC P-256 key, valid one day)."""
    pair = KeyPair(folder / f"{name}.crt", folder / f"{name}.key")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", str(pair.key), "-out", str(pair.cert),
    )  # fmt: skip
    return pair


def make_leaf(folder: Path, name: str, ca: KeyPair, sans: str = "DNS:localhost,IP:127.0.0.1") -> KeyPair:
    """A certificate `name` signed by `ca`, for servers and clients alike, naming `sans`."""
    pair = KeyPair(folder / f"{name}.crt", folder / f"{name}.key")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
        "-subj", f"/CN={name}", "-CA", str(ca.cert), "-CAkey", str(ca.key),
        "-addext", f"subjectAltName={sans}", "-addext", "basicConstraints=critical,CA:FALSE",
        "-addext", "extendedKeyUsage=serverAuth,clientAuth",
        "-keyout", str(pair.key), "-out", str(pair.cert),
    )  # fmt: skip
    return pair


class MountedSecret:
    """A folder laid out like a Secret volume (`tls.crt`, `tls.key`, `ca.crt` through `..data`).

    Args:
        folder (`Path`): the mount point; created.
    """

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._versions = 0

    def path(self, name: str) -> Path:
        return self.folder / name

    def publish(self, files: dict[str, bytes]) -> None:
        """Swap in a new set of files the way the kubelet's atomic writer does."""
        self._versions += 1
        version = self.folder / f"..v{self._versions}"
        version.mkdir()
        for name, data in files.items():
            (version / name).write_bytes(data)
        staged = self.folder / "..data_tmp"
        staged.symlink_to(version.name)
        os.replace(staged, self.folder / "..data")
        for name in files:
            link = self.folder / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")
