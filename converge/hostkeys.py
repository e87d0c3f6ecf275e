"""Host keys: known_hosts files, fingerprints, and pinning a key on request.

Keys are always checked (paramiko's RejectPolicy); nothing is added to a
known_hosts file except by ``invoke trust``, which shows the fingerprint first.
"""
from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import paramiko

USER_KNOWN_HOSTS = "~/.ssh/known_hosts"


def known_hosts_name(address: str, port: int) -> str:
    """How OpenSSH names a host in known_hosts."""
    return address if port == 22 else f"[{address}]:{port}"


def files(known_hosts: str | None) -> list[str]:
    """The known_hosts files read for a host: the inventory's (or ssh_config's), then the user's."""
    out = [os.path.expanduser(known_hosts)] if known_hosts else []
    user = os.path.expanduser(USER_KNOWN_HOSTS)
    return out + ([user] if user not in out else [])


def load(paths: list[str], into: paramiko.HostKeys | None = None) -> paramiko.HostKeys:
    keys = into if into is not None else paramiko.HostKeys()
    for path in paths:
        if os.path.isfile(path):
            keys.load(path)
    return keys


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def pin(path: str | None, name: str, key: paramiko.PKey) -> str:
    """Append the key to ``path`` (default ~/.ssh/known_hosts); returns the file."""
    target = os.path.expanduser(path or USER_KNOWN_HOSTS)
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a", encoding="ascii") as handle:
        handle.write(f"{name} {key.get_name()} {key.get_base64()}\n")
    return target
