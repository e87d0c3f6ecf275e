"""Users' API keys: made here, shown once, kept only as sha256.

The store is ``keys.json`` (0600) in the credentials folder: ``{NAME: {"sha256":
HEX, "added": ISO8601}}``. Front doors and the gateway get the hashes only; the
front door hashes each request's bearer token and looks it up.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import re
import secrets
import stat
from pathlib import Path

from . import CredentialError, locked, unsaved, write_private

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
PREFIX = "dgk-"  # makes a leaked key easy to recognise (and to grep for)
# the names the fleet's own keys go by beside the users' (serving/haproxy/tls.py: the gateway's key to
# the front doors, the monitoring hosts' key; serving/key_limits.py: the inventory's api_key_file,
# never limited): a user's key of one of these names would take that key's place
RESERVED = frozenset({"gateway", "monitoring", "api_key_file"})


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    def __init__(self, folder: Path):
        self.path = folder / "keys.json"

    def load(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        info = self.path.stat()
        if info.st_mode & 0o077:
            raise CredentialError(f"{self.path} is mode {stat.S_IMODE(info.st_mode):04o}: chmod 600 {self.path}")
        try:
            data = json.loads(self.path.read_text())
        except ValueError as exc:
            raise CredentialError(f"{self.path}: not JSON ({exc}); restore it from a backup or remove it and add "
                                  f"the keys again") from exc
        if not isinstance(data, dict) or not all(isinstance(v, dict) and re.fullmatch(r"[0-9a-f]{64}",
                                                                                       str(v.get("sha256")))
                                                  and isinstance(v.get("limits", {}), dict)
                                                  for v in data.values()):
            raise CredentialError(f"{self.path}: each entry must be {{\"sha256\": 64 hex digits, \"limits\": "
                                  f"{{...}} or none}}")
        return data

    def _save(self, data: dict):
        write_private(self.path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())

    def add(self, name: str, limits: dict | None = None) -> str:
        """A new key for ``name`` (with its own ``limits``, checked by the caller); the secret is
        returned once and kept nowhere."""
        if not NAME.match(name):
            raise CredentialError(f"key name {name!r}: use letters, digits and . _ @ - (at most 64)")
        if name in RESERVED:
            raise CredentialError(f"key name {name!r} is the fleet's own ({', '.join(sorted(RESERVED))} are): "
                                  f"choose another name")
        with locked(self.path.parent):
            return self._add(name, limits or {})

    def _add(self, name: str, limits: dict) -> str:
        data = self.load()
        if name in data:
            raise CredentialError(f"a key named {name} exists: revoke it first (invoke keys.revoke {name})")
        secret = PREFIX + secrets.token_urlsafe(32)
        data[name] = {"sha256": digest(secret),
                      "added": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if limits:
            data[name]["limits"] = dict(limits)
        self._save(data)
        return secret

    def set_limits(self, name: str, changes: dict, cleared=()) -> dict:
        """``name``'s own limits with ``changes`` over them and the ``cleared`` ones gone (back to
        the inventory's); returns them."""
        with locked(self.path.parent):
            data = self.load()
            if name not in data:
                have = ", ".join(sorted(data)) or "none"
                raise CredentialError(f"no key named {name} (keys: {have}); see: invoke keys.list")
            own = {k: v for k, v in {**(data[name].get("limits") or {}), **changes}.items() if k not in cleared}
            if own:
                data[name]["limits"] = own
            else:
                data[name].pop("limits", None)
            self._save(data)
            return own

    def limits(self) -> dict[str, dict]:
        """Each key's own limits (empty: the inventory's)."""
        return {name: dict(entry.get("limits") or {}) for name, entry in sorted(self.load().items())}

    def revoke(self, *names: str):
        """Forget each of ``names``: all of them, or none when one is not there."""
        with locked(self.path.parent):
            self._revoke(names)

    def _revoke(self, names: tuple[str, ...]):
        data = self.load()
        names = tuple(dict.fromkeys(names))  # a name given twice is one key
        unknown = [name for name in names if name not in data]
        if unknown:
            have = ", ".join(sorted(data)) or "none"
            kept = " (none revoked)" if len(names) > len(unknown) else ""
            raise CredentialError(f"no key named {', '.join(unknown)} (keys: {have}){kept}; see: invoke keys.list")
        for name in names:
            del data[name]
        self._save(data)

    def hashes(self) -> dict[str, str]:
        return {name: entry["sha256"] for name, entry in sorted(self.load().items())}


def service_key(folder: Path, name: str, *, make: bool) -> str:
    """A key the fleet's own parts use (the gateway, to reach the front doors): made
    once, kept in a 0600 file here, handed only to the host that uses it (``make``: else
    what a deploy would make, held in memory, unsaved)."""
    path = folder / f"{name}.key"
    if not path.exists():
        if not make:
            return unsaved(folder, ("key", name), lambda: PREFIX + secrets.token_urlsafe(32))
        with locked(folder):
            if not path.exists():
                write_private(path, (PREFIX + secrets.token_urlsafe(32) + "\n").encode())
    info = path.stat()
    if info.st_mode & 0o077:
        raise CredentialError(f"{path} is mode {stat.S_IMODE(info.st_mode):04o}: chmod 600 {path}")
    return path.read_text().strip()
