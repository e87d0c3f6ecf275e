"""What the front door gets from the control machine: its certificate (from the
fleet CA, or the user's own) and the sha256 of every key it accepts."""
from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path

from converge.errors import StepFailed
from credentials import CredentialError, directory
from credentials.ca import ca_pem, host_certificate
from credentials.keys import KeyStore, digest, service_key

from roles.service.role import read_secret


@dataclass(frozen=True)
class Bundle:
    cert_pem: str
    key_pem: str  # a secret: written 0600 on the host, never shown
    ca_pem: str


def _read_pem(path: str, what: str, host: str, secret: bool) -> str:
    full = Path(path).expanduser()
    try:
        info = full.stat()
        if secret and info.st_mode & 0o077:
            raise StepFailed(f"{host}: {what}: {path} is mode {stat.S_IMODE(info.st_mode):04o}; it holds a private "
                             f"key: chmod 600 {path}")
        text = full.read_text()
    except OSError as exc:
        raise StepFailed(f"{host}: {what}: cannot read {path} on this machine ({exc.strerror})") from exc
    if "-----BEGIN" not in text:
        raise StepFailed(f"{host}: {what}: {path} is not PEM")
    return text if text.endswith("\n") else text + "\n"


def names(host: str, v: dict) -> list[str]:
    """What the certificate names: the inventory name and every address the host is reached at."""
    out = [host]
    for value in (v.get("ansible_host"), v.get("api_host")):
        if value and value not in ("0.0.0.0", "::") and value not in out:
            out.append(value)
    return out


def bundle(host: str, v: dict) -> Bundle:
    folder = directory(v)
    try:
        ca = ca_pem(folder)
        if v.get("tls_cert_file"):
            if not v.get("tls_key_file"):
                raise StepFailed(f"{host}: tls_cert_file is set but tls_key_file is not: set both, or neither")
            return Bundle(_read_pem(v["tls_cert_file"], "tls_cert_file", host, False),
                          _read_pem(v["tls_key_file"], "tls_key_file", host, True), ca)
        issued = host_certificate(folder, host, names(host, v))
    except CredentialError as exc:
        raise StepFailed(f"{host}: {exc}") from exc
    return Bundle(issued.cert_pem, issued.key_pem, ca)


GATEWAY_KEY = "gateway"


def accepted_keys(host: str, v: dict, gateway: bool = False) -> dict[str, str]:
    """Key name -> sha256: the users' keys, the inventory's api_key_file as one more,
    and (``gateway``: the fleet has one) the key the gateway reaches front doors with."""
    try:
        hashes = KeyStore(directory(v)).hashes()
        if gateway:
            hashes = {GATEWAY_KEY: digest(service_key(directory(v), GATEWAY_KEY)), **hashes}
    except CredentialError as exc:
        raise StepFailed(f"{host}: {exc}") from exc
    legacy = read_secret(v.get("api_key_file"), "api_key_file", host)
    if legacy:
        hashes = {"api_key_file": digest(legacy), **hashes}
    return hashes
