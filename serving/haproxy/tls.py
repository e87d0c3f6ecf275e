"""What the front door gets from the control machine: its certificate (from the
fleet CA, or the user's own) and the sha256 of every key it accepts."""
from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path

from converge.changes import Check
from converge.errors import StepFailed
from credentials import CredentialError, directory
from credentials.ca import ca_paths, ca_pem, host_certificate, host_certificate_due
from credentials.keys import RESERVED, KeyStore, digest, service_key

from converge.secrets import read_optional_secret as read_secret
from serving.fleet import shared_address


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
    """What the certificate names: the inventory name and every address the host is reached at
    (a gateway: the address the gateways share too)."""
    out = [host]
    shared = shared_address(v)
    for value in (v.get("ansible_host"), v.get("api_host"), shared):
        if value and value not in ("0.0.0.0", "::") and value not in out:
            out.append(value)
    return out


def bundle(host: str, v: dict, extra_ca_files: tuple = (), *, make: bool) -> Bundle:
    """The host's certificate and key, and the CAs it trusts (``ca.crt``): the fleet CA, the
    CA of its own certificate when it brings one, and ``extra_ca_files`` (a gateway: those
    of the front doors that bring their own). ``make``: a deploy makes what is missing (a
    read-only run holds it in memory, unsaved)."""
    folder = directory(v)
    try:
        cas = [ca_pem(folder, make=make)]
        for path in extra_ca_files:
            cas.append(_read_pem(path, "tls_ca_file", host, False))
        if v.get("tls_cert_file"):
            cert, key, own_ca = own_certificate(host, v, cas[0])
            return Bundle(cert, key, _join(cas + [own_ca]))
        issued = host_certificate(folder, host, names(host, v), make=make)
    except CredentialError as exc:
        raise StepFailed(f"{host}: {exc}") from exc
    return Bundle(issued.cert_pem, issued.key_pem, _join(cas))


def not_after(pem: str) -> float:
    """When the first certificate of ``pem`` expires (Unix time)."""
    from cryptography import x509
    return x509.load_pem_x509_certificate(pem.encode()).not_valid_after_utc.timestamp()


def expiries(bundle: Bundle, kind: str) -> dict[str, float]:
    """When the host's certificate (``kind``: frontdoor, gateway) and the fleet CA expire."""
    return {kind: not_after(bundle.cert_pem), "ca": not_after(bundle.ca_pem)}


def trusted_cas(host: str, v: dict, extra_ca_files: tuple = (), *, make: bool) -> str:
    """The CAs a client of the fleet's front doors trusts: the fleet CA, and those of the
    front doors that bring a certificate of their own (``extra_ca_files``)."""
    try:
        cas = [ca_pem(directory(v), make=make)]
    except CredentialError as exc:
        raise StepFailed(f"{host}: {exc}") from exc
    return _join(cas + [_read_pem(path, "tls_ca_file", host, False) for path in extra_ca_files])


def _join(pems: list[str]) -> str:
    """PEM blocks, each once, in order."""
    blocks = []
    for pem in pems:
        for block in pem.split("-----END CERTIFICATE-----"):
            block = block.strip()
            if block:
                block += "\n-----END CERTIFICATE-----\n"
                if block not in blocks:
                    blocks.append(block)
    return "".join(blocks)


def own_certificate(host: str, v: dict, fleet_ca: str) -> tuple[str, str, str]:
    """A certificate the user brings (tls_cert_file, tls_key_file, and tls_ca_file unless the
    fleet CA signed it), checked here so that a mismatch is an error at deploy, not a front
    door that no client, no gateway and no check of ours can reach: the key is the
    certificate's, it names the host's inventory name (what the gateway and deploy's check
    ask for), it has not expired, and the CA named signed it."""
    from datetime import datetime, timezone

    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    if not v.get("tls_key_file"):
        raise StepFailed(f"{host}: tls_cert_file is set but tls_key_file is not: set both, or neither")
    cert_pem = _read_pem(v["tls_cert_file"], "tls_cert_file", host, False)
    key_pem = _read_pem(v["tls_key_file"], "tls_key_file", host, True)
    ca_text = _read_pem(v["tls_ca_file"], "tls_ca_file", host, False) if v.get("tls_ca_file") else fleet_ca
    where = f"{host}: tls_cert_file {v['tls_cert_file']}"
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
        key = serialization.load_pem_private_key(key_pem.encode(), password=None)
        cas = x509.load_pem_x509_certificates(ca_text.encode())
    except (ValueError, TypeError) as exc:
        raise StepFailed(f"{where}: cannot read the certificate, its key or its CA ({exc}); PEM without a "
                         f"passphrase is needed") from None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, spki) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, spki):
        raise StepFailed(f"{where}: tls_key_file {v['tls_key_file']} is not this certificate's key")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        named = [str(n) for n in san.get_values_for_type(x509.DNSName)] + \
                [str(a) for a in san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        named = []
    if host not in named:
        raise StepFailed(f"{where} names {', '.join(named) or 'no name (no subjectAltName)'}, not {host}: the "
                         f"gateway and deploy's own check reach the front door under its inventory name; add "
                         f"DNS:{host} to the certificate")
    shared = shared_address(v)
    if shared and shared not in named:
        raise StepFailed(f"{where} does not name the gateways' shared address {shared} (gateway_address): clients "
                         f"reach the gateway there; add IP:{shared} to the certificate")
    if cert.not_valid_after_utc <= datetime.now(timezone.utc):
        raise StepFailed(f"{where} expired on {cert.not_valid_after_utc:%Y-%m-%d}: renew it")
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return cert_pem, key_pem, ca_text
        except (ValueError, TypeError, InvalidSignature):  # another issuer, or a signature that does not verify
            continue
    raise StepFailed(f"{where} is not signed by {'tls_ca_file ' + v['tls_ca_file'] if v.get('tls_ca_file') else 'the fleet CA'}: "
                     f"set tls_ca_file to the CA certificate that signed it (the gateway and deploy's check "
                     f"trust it then)")


GATEWAY_KEY = "gateway"
# the monitoring hosts' key (Prometheus's scrapes): the front doors and gateways hold its
# sha256 apart from the users' keys, so that it opens their metrics alone and no user key does
MONITORING_KEY = "monitoring"


def monitoring_keys(host: str, v: dict, *, make: bool) -> dict[str, str]:
    """Key name -> sha256 of the keys that open this host's metrics (the monitoring key)."""
    try:
        return {MONITORING_KEY: digest(service_key(directory(v), MONITORING_KEY, make=make))}
    except CredentialError as exc:
        raise StepFailed(f"{host}: {exc}") from exc


def accepted_keys(host: str, v: dict, gateway: bool = False, *, make: bool) -> dict[str, str]:
    """Key name -> sha256: the users' keys, the inventory's api_key_file as one more,
    and (``gateway``: the fleet has one) the key the gateway reaches front doors with."""
    try:
        # a user's key stored under a name the fleet's own keys use (a keys.json from before
        # keys.add refused them) never takes their place
        hashes = {name: d for name, d in KeyStore(directory(v)).hashes().items() if name not in RESERVED}
        if gateway:
            hashes = {GATEWAY_KEY: digest(service_key(directory(v), GATEWAY_KEY, make=make)), **hashes}
    except CredentialError as exc:
        raise StepFailed(f"{host}: {exc}") from exc
    legacy = read_secret(v.get("api_key_file"), "api_key_file", host)
    if legacy:
        hashes = {"api_key_file": digest(legacy), **hashes}
    return hashes


def to_make(host: str, v: dict, keys: tuple = (), certificate: bool = True) -> list[str]:
    """What a deploy makes on the control machine for this host, before it can plan it: the fleet
    CA, the host's certificate (none yet, renewal due, its names changed), the fleet's own
    ``keys`` (gateway, monitoring). Empty when all are there."""
    folder = directory(v)
    out = []
    if not ca_paths(folder)[0].exists():
        out.append(f"the fleet CA in {folder}/ca")
    if certificate and not v.get("tls_cert_file") and host_certificate_due(folder, host, names(host, v)):
        out.append(f"{host}'s certificate")
    out += [f"the {name} key" for name in keys if not (folder / f"{name}.key").exists()]
    return out


def made_step(ctx, keys: tuple = (), certificate: bool = True, also: list | None = None):
    """The line that says what a deploy makes on the control machine for this host (in check
    mode: would make, and nothing is written), or nothing when all is there; ``also``: what
    else the role makes there."""
    missing = to_make(ctx.name, ctx.vars, keys, certificate) + list(also or ())
    if missing:
        yield Check("fleet credentials", ok=True,
                    message=f"{'would make' if ctx.check else 'made'} {', '.join(missing)} on this machine"
                            + (" (a deploy makes them; nothing was written)" if ctx.check else ""))
