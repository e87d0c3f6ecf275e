"""The files on the control machine that a deploy will read, checked before it runs (`invoke
inventory.check`): every key, certificate and secret file the inventory names, per host, exists
and is readable here, and a secret is a 0600 file holding one line (converge/secrets.py's rules,
those the deploy applies as it reads it). Each problem names the file and line that set the
variable, the host and the variable. The secrets are opened, never printed."""
from __future__ import annotations

import os
import stat

from converge.errors import SecretError
from converge.secrets import read_secret_file

from .fleet import is_gateway, is_monitoring, is_serving

# variable -> (what it holds, a secret?): the connection's (Ansible's names) and the roles'
TOP_LEVEL = {
    "ansible_ssh_private_key_file": ("the SSH private key", "key"),
    "known_hosts_file": ("the hosts' public keys", "file"),
    "become_password_file": ("the sudo password", "secret"),
    "api_key_file": ("vLLM's key", "secret"),
    "hf_token_file": ("the Hugging Face token", "secret"),
    "tls_cert_file": ("the front door's certificate", "file"),
    "tls_key_file": ("the front door's private key", "key"),
    "tls_ca_file": ("the CA of tls_cert_file", "file"),
}


def _files(v: dict) -> list[tuple[tuple, str, str]]:
    """(the variable's key path, what it holds, its kind) of each file the host's deploy reads."""
    found = [((name,), what, kind) for name, (what, kind) in TOP_LEVEL.items() if v.get(name)]
    if is_gateway(v):
        for family, rule in sorted((v.get("model_fallback") or {}).items()):
            if isinstance(rule, dict) and rule.get("key_file"):
                found.append((("model_fallback", family, "key_file"), f"the key of {family}'s external upstream",
                              "secret"))
    if is_monitoring(v):
        for i, receiver in enumerate(v.get("alert_receivers") or []):
            for kind_name, settings in (receiver or {}).items() if isinstance(receiver, dict) else ():
                if isinstance(settings, dict):
                    for key, value in settings.items():
                        if key.endswith("_file") and value:
                            found.append((("alert_receivers", i, kind_name, key),
                                          f"alert receiver {receiver.get('name', i)}'s {kind_name} {key[:-5]}",
                                          "secret"))
    return found


def _value(v: dict, keypath: tuple):
    for part in keypath:
        v = v[part]
    return v


def _check(path: str, what: str, kind: str, host: str, name: str) -> str | None:
    full = os.path.expanduser(str(path))
    if kind == "secret":
        try:
            read_secret_file(str(path), name, host)
        except SecretError as exc:
            return str(exc)
        return None
    try:
        info = os.stat(full)
        with open(full, "rb"):
            pass
    except OSError as exc:
        return f"{host}: {name}: cannot read {path} on this machine ({exc.strerror}): {what} goes there"
    if not stat.S_ISREG(info.st_mode):
        return f"{host}: {name}: {path} is not a regular file ({what})"
    if kind == "key" and info.st_mode & 0o077:
        return (f"{host}: {name}: {path} is mode {stat.S_IMODE(info.st_mode):04o}; it holds {what}, so others must "
                f"not read it (ssh refuses such a key too): chmod 600 {path}")
    return None


def problems(play) -> list[str]:
    """Each file a deploy of the inventory's hosts would fail on, once a file (not once a host)."""
    out, seen = [], set()
    for host in play.inventory.host_names:
        v = play.hostvars(host)
        if not (is_serving(v) or is_gateway(v) or is_monitoring(v)):
            continue
        resolved = play.inventory.host(host, play.defaults, play.overrides)
        for keypath, what, kind in _files(v):
            path = _value(v, keypath)
            name = ".".join(str(p) for p in keypath)
            problem = _check(path, what, kind, host, name)
            if problem is None:
                continue
            setter = next((src for src in reversed(resolved.sources) if keypath[0] in (src.values or {})), None)
            where = str(setter.origin_of(keypath)) if setter is not None else "--set"
            key = (where, name, str(path))
            if key in seen:
                continue
            seen.add(key)
            out.append(f"{where}: {problem}")
    return out
