"""The fleet CA, made on the control machine on first need, and the front
doors' certificates it signs. The CA's key is 0600 here and never copied to a
host; a host gets its own key and a certificate for its inventory name and
addresses, renewed when it has less than RENEW_DAYS left or its names changed."""
from __future__ import annotations

import datetime
import ipaddress
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from . import CredentialError, locked, unsaved, write_private

CA_DAYS = 3650
CERT_DAYS = 365
RENEW_DAYS = 30


@dataclass(frozen=True)
class Issued:
    cert_pem: str
    key_pem: str  # a secret: goes to the host only, in a 0600 file
    not_after: datetime.datetime


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_key(path: Path):
    info = path.stat()
    if info.st_mode & 0o077:
        raise CredentialError(f"{path} is mode {stat.S_IMODE(info.st_mode):04o}; it holds a private key: "
                              f"chmod 600 {path}")
    try:
        return serialization.load_pem_private_key(path.read_bytes(), None)
    except ValueError as exc:
        raise CredentialError(f"{path} is not a PEM private key ({exc}); move it away to make a new one") from exc


def ca_paths(folder: Path) -> tuple[Path, Path]:
    return folder / "ca" / "ca.crt", folder / "ca" / "ca.key"


def ensure_ca(folder: Path, name: str = "dgemma-fleet CA", *, make: bool) -> tuple[x509.Certificate, object]:
    """The fleet CA (certificate, key), made once (``make``: else one held in memory, unsaved)."""
    found = _load_ca(folder)
    if found is not None:
        return found
    if not make:
        return unsaved(folder, ("ca",), lambda: _new_ca(name))
    with locked(folder):
        return _ensure_ca(folder, name)


def _load_ca(folder: Path):
    """The CA as saved (written by rename: whole or absent), or None."""
    cert_path, key_path = ca_paths(folder)
    if not (cert_path.exists() and key_path.exists()):
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except ValueError as exc:
        raise CredentialError(f"{cert_path} is not a PEM certificate ({exc})") from exc
    return cert, _load_key(key_path)


def _new_ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def _ensure_ca(folder: Path, name: str) -> tuple[x509.Certificate, object]:
    found = _load_ca(folder)
    if found is not None:
        return found
    cert, key = _new_ca(name)
    cert_path, key_path = ca_paths(folder)
    write_private(key_path, _key_pem(key))
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def _usages(cert: x509.Certificate) -> set:
    try:
        return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return set()


def _names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n) for n in san.get_values_for_type(x509.DNSName)} | \
           {str(a) for a in san.get_values_for_type(x509.IPAddress)}


def _alt_name(name: str):
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


# what a certificate is for: a host's (a TLS server), a gateway's among its peers (server and client)
SERVER, PEER = "server", "peer"
_USAGES = {SERVER: (x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,),
           PEER: (x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH)}


def host_certificate(folder: Path, host: str, names: list[str], *, make: bool) -> Issued:
    """The certificate of ``host``'s front door for ``names`` (inventory name,
    addresses), kept in the credentials folder and renewed before it expires (``make``:
    else what a deploy would issue, held in memory, unsaved)."""
    return _certificate(folder, host, names, SERVER, make)


def peer_certificate(folder: Path, host: str, *, make: bool) -> Issued:
    """A gateway's certificate among its peers (the gateways' shared counts): for its inventory
    name alone, good for a TLS client as well as a server. A front door's certificate is a
    server's alone, so a peers listener that asks for a client certificate of the fleet CA
    takes a gateway's and refuses a front door's. Kept apart from the host's own certificate
    (which may be the user's), renewed as it is."""
    return _certificate(folder, host, [host], PEER, make)


def _certificate(folder: Path, host: str, names: list[str], purpose: str, make: bool) -> Issued:
    """The saved certificate of ``host`` for ``purpose`` while it still serves, else a new one
    (saved, under the folder's lock; ``make`` False: held in memory, unsaved)."""
    ca_cert, ca_key = ensure_ca(folder, make=make)
    current = _current(folder, host, names, ca_cert, purpose)
    if current is not None:
        return current
    if not make:
        return unsaved(folder, (purpose, host, tuple(names)), lambda: _issue(ca_cert, ca_key, host, names, purpose))
    with locked(folder):
        ca_cert, ca_key = _ensure_ca(folder, "dgemma-fleet CA")
        current = _current(folder, host, names, ca_cert, purpose)
        if current is not None:
            return current
        issued = _issue(ca_cert, ca_key, host, names, purpose)
        cert_path, key_path = _host_paths(folder, host, purpose)
        write_private(key_path, issued.key_pem.encode())
        write_private(cert_path, issued.cert_pem.encode(), 0o644)
        return issued


def certificate_paths(folder: Path, host: str) -> tuple[Path, Path]:
    """Where ``host``'s certificate and its key (0600) are kept in the credentials folder."""
    return _host_paths(folder, host, SERVER)


def _host_paths(folder: Path, host: str, purpose: str) -> tuple[Path, Path]:
    stem = host if purpose == SERVER else f"{host}.{purpose}"
    return folder / "hosts" / f"{stem}.crt", folder / "hosts" / f"{stem}.key"


def host_certificate_due(folder: Path, host: str, names: list[str]) -> bool:
    """Whether a deploy would issue ``host`` a certificate (none, names changed, under
    RENEW_DAYS left, or another CA's)."""
    return _due(folder, host, names, SERVER)


def peer_certificate_due(folder: Path, host: str) -> bool:
    """Whether a deploy would issue the gateway ``host`` its peer certificate."""
    return _due(folder, host, [host], PEER)


def _due(folder: Path, host: str, names: list[str], purpose: str) -> bool:
    found = _load_ca(folder)
    return found is None or _current(folder, host, names, found[0], purpose) is None


def _current(folder: Path, host: str, names: list[str], ca_cert, purpose: str) -> Issued | None:
    """The saved certificate when it still serves: the same names, RENEW_DAYS left, this CA's."""
    cert_path, key_path = _host_paths(folder, host, purpose)
    if not (cert_path.exists() and key_path.exists()):
        return None
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    left = cert.not_valid_after_utc - _now()
    if _names(cert) != set(names) or left <= datetime.timedelta(days=RENEW_DAYS) or cert.issuer != ca_cert.subject:
        return None
    if _usages(cert) != set(_USAGES[purpose]):
        return None
    return Issued(cert_path.read_text(), _key_pem(_load_key(key_path)).decode(), cert.not_valid_after_utc)


def _issue(ca_cert, ca_key, host: str, names: list[str], purpose: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_alt_name(n) for n in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage(list(_USAGES[purpose])), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Issued(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key).decode(),
                  cert.not_valid_after_utc)


def ca_pem(folder: Path, *, make: bool) -> str:
    cert, _ = ensure_ca(folder, make=make)
    return cert.public_bytes(serialization.Encoding.PEM).decode()
