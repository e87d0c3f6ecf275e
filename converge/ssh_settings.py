"""How to reach a host: the inventory's Ansible names first, then ssh_config.

``ansible_host``, ``ansible_port``, ``ansible_user``, ``ansible_ssh_private_key_file``,
``known_hosts_file``, ``connect_timeout``, ``ansible_become`` (with
``ansible_become_user``, ``ansible_become_method`` and ``become_password_file``)
and ``ansible_ssh_common_args``, of which we understand the options in
``UNDERSTOOD`` (a bastion is ``-o ProxyJump=user@bastion``, as Ansible users
write it). What the inventory leaves out, ssh_config says (through Fabric), as
OpenSSH would.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

from . import ssh_config
from .become import Become, check_password
from .errors import ConvergeError
from .secrets import read_secret_file

# what `ansible_ssh_common_args` may hold: the options we honour, and what each takes
UNDERSTOOD = {
    "proxyjump": "ProxyJump=[user@]host[:port][,...] (or -J ...), or none",
    "userknownhostsfile": "UserKnownHostsFile=PATH",
    "stricthostkeychecking": "StrictHostKeyChecking=yes (keys are always checked)",
    "connecttimeout": "ConnectTimeout=SECONDS",
}
MAX_JUMPS = 8
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*" \
        r"|\[[0-9A-Fa-f:.]+\])"
_HOP = re.compile(rf"^(?:ssh://)?(?:(?P<user>[a-z_][a-z0-9_-]{{0,31}})@)?(?P<host>{_HOST})(?::(?P<port>[0-9]{{1,5}}))?$")
_PATH = re.compile(r"^[A-Za-z0-9_./~-]+$")


@dataclass(frozen=True)
class Hop:
    """One jump host of a ProxyJump list: ``[user@]host[:port]``."""

    host: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Hop":
        match = _HOP.match(text.strip())
        if not match or not 1 <= int(match.group("port") or 22) <= 65535:
            raise ValueError(f"{text!r} is not a jump host; expected [user@]host[:port]")
        return cls(match.group("host").strip("[]"), match.group("user"),
                   int(match.group("port")) if match.group("port") else None)

    def __str__(self):
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.user + '@' if self.user else ''}{host}{':' + str(self.port) if self.port else ''}"


def parse_jumps(text: str) -> tuple[Hop, ...]:
    """A ProxyJump value: hops separated by commas, or ``none``."""
    if text.strip().lower() == "none":
        return ()
    hops = tuple(Hop.parse(part) for part in text.split(","))
    if len(hops) > MAX_JUMPS:
        raise ValueError(f"more than {MAX_JUMPS} jump hosts")
    return hops


def parse_common_args(text: str) -> dict:
    """The options of ``ansible_ssh_common_args`` that we honour, as
    ``{"jump": (Hop, ...), "known_hosts": str, "connect_timeout": int}``.

    Raises ValueError naming what is not understood and listing what is."""
    try:
        words = shlex.split(text or "")
    except ValueError as exc:
        raise ValueError(f"cannot split {text!r} into words ({exc})") from exc
    options: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-o", "-J"):
            if i + 1 >= len(words):
                raise ValueError(f"{word} needs a value")
            value, i = words[i + 1], i + 2
        elif word.startswith(("-o", "-J")) and len(word) > 2:
            value, i = word[2:], i + 1
        else:
            raise ValueError(f"{word!r} is not understood; only -o OPTION=VALUE and -J are, with the options: "
                             f"{'; '.join(UNDERSTOOD.values())}")
        if word.startswith("-J"):
            options.append(("proxyjump", value))
            continue
        key, sep, val = value.partition("=")
        if not sep:
            key, _, val = value.partition(" ")
        options.append((key.strip(), val.strip()))
    out: dict = {}
    for written, value in options:
        key = written.lower()
        if key not in UNDERSTOOD:
            raise ValueError(f"-o {written}: not understood; the options understood are: "
                             f"{'; '.join(UNDERSTOOD.values())}")
        if key == "proxyjump":
            out["jump"] = parse_jumps(value)
        elif key == "userknownhostsfile":
            path = value.split()[0] if value.split() else ""
            if not _PATH.match(path):
                raise ValueError(f"UserKnownHostsFile={value!r}: expected one path without spaces")
            out["known_hosts"] = path
        elif key == "stricthostkeychecking":
            if value.lower() != "yes":
                raise ValueError(f"StrictHostKeyChecking={value}: host keys are always checked here; only 'yes' "
                                 f"is accepted (pin new keys with: invoke trust)")
        elif key == "connecttimeout":
            if not value.isdigit() or not 1 <= int(value) <= 300:
                raise ValueError(f"ConnectTimeout={value!r}: expected seconds from 1 to 300")
            out["connect_timeout"] = int(value)
    return out


@dataclass
class SSHSettings:
    """What the inventory and ssh_config say about reaching one host."""

    name: str  # the inventory's name
    host: str  # what to connect to and look up in ssh_config: ansible_host, else the name
    port: int | None = None  # None: ssh_config's, else 22
    user: str | None = None  # None: ssh_config's, else root
    key_file: str | None = None
    known_hosts: str | None = None
    connect_timeout: float = 10.0
    jumps: tuple[Hop, ...] = ()
    become: Become | None = field(default=None)

    @classmethod
    def from_vars(cls, name: str, hostvars: dict, become_password: str | None = None) -> "SSHSettings":
        """Inventory values win over ssh_config, which wins over defaults.

        ``become_password``: the one typed at --ask-become-pass; a host's own
        become_password_file wins over it. Raises ConvergeError for a setting
        that cannot be used (its message names the host and what to do)."""
        try:
            common = parse_common_args(hostvars.get("ansible_ssh_common_args") or "")
        except ValueError as exc:
            raise ConvergeError(f"{name}: ansible_ssh_common_args: {exc}") from exc
        host = hostvars.get("ansible_host") or name
        config = ssh_config.lookup(host)
        known = (hostvars.get("known_hosts_file") or common.get("known_hosts")
                 or (config.get("userknownhostsfile") or "").split(" ")[0] or None)
        if "jump" in common:
            jumps = common["jump"]
        else:
            try:
                jumps = parse_jumps(config.get("proxyjump") or "none")
            except ValueError as exc:
                raise ConvergeError(f"{name}: ProxyJump in ssh_config: {exc}") from exc
        key = hostvars.get("ansible_ssh_private_key_file")
        return cls(
            name=name, host=host,
            port=int(hostvars["ansible_port"]) if hostvars.get("ansible_port") else None,
            user=hostvars.get("ansible_user"),
            key_file=os.path.expanduser(key) if key else None,
            known_hosts=os.path.expanduser(known) if known else None,
            connect_timeout=float(hostvars.get("connect_timeout") or common.get("connect_timeout")
                                  or config.get("connecttimeout") or 10),
            jumps=jumps,
            become=_become(name, hostvars, become_password),
        )


def _become(name: str, hostvars: dict, typed: str | None) -> Become | None:
    if not hostvars.get("ansible_become"):
        return None
    password = typed
    path = hostvars.get("become_password_file")
    if path:
        text = read_secret_file(path, "become_password_file", name)
        try:
            password = check_password(text, f"become_password_file {path}")
        except ValueError as exc:
            raise ConvergeError(f"{name}: {exc}") from exc
    return Become(user=hostvars.get("ansible_become_user") or "root",
                  method=hostvars.get("ansible_become_method") or "sudo", password=password)
