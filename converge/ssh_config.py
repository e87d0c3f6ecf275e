"""OpenSSH's ``ssh_config``, as Fabric reads it, plus ``Include``.

Fabric loads ``~/.ssh/config`` and ``/etc/ssh/ssh_config`` into a paramiko
``SSHConfig`` (Host, Match, HostName, User, Port, IdentityFile, ProxyJump...),
but paramiko's parser has no ``Include``: an included file's hosts would be
silently unknown. Our ``Config`` is Fabric's with one change: a file's
``Include`` lines are replaced by the files they name (globs, ``~``, paths
relative to ``~/.ssh`` or ``/etc/ssh`` as OpenSSH resolves them, at most 16
deep as OpenSSH allows) before paramiko parses it. Files are read with a size
bound, so a runaway include cannot eat the control machine.
"""
from __future__ import annotations

import glob
import io
import os
import re
from functools import lru_cache

import fabric
from paramiko.ssh_exception import ConfigParseError

from .errors import InventoryError

MAX_DEPTH = 16  # OpenSSH's READCONF_MAX_DEPTH
MAX_BYTES = 1024 * 1024  # all files of one configuration together
_INCLUDE = re.compile(r"^\s*include(?:\s*=\s*|\s+)(.+?)\s*$", re.I)


def expand_includes(path: str, base: str, depth: int = 0, budget: list | None = None) -> str:
    """The text of ``path`` with its ``Include`` lines replaced by the files they name.

    ``base`` is where relative Include paths start (``~/.ssh`` for a user's
    file, ``/etc/ssh`` for the system's). Raises InventoryError on loops that
    go too deep, files too large, or text that is not UTF-8."""
    budget = budget if budget is not None else [MAX_BYTES]
    if depth > MAX_DEPTH:
        raise InventoryError([f"{path}: Include nested more than {MAX_DEPTH} deep (a loop?)"])
    try:
        with open(path, "rb") as handle:
            raw = handle.read(budget[0] + 1)
    except OSError as exc:
        raise InventoryError([f"{path}: cannot read: {exc.strerror}"]) from exc
    budget[0] -= len(raw)
    if budget[0] < 0:
        raise InventoryError([f"{path}: ssh configuration larger than {MAX_BYTES // 1024} KiB with its includes"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise InventoryError([f"{path}:{line}: not UTF-8 text"]) from exc
    out = []
    for line in text.splitlines():
        match = _INCLUDE.match(line)
        if not match:
            out.append(line)
            continue
        for pattern in match.group(1).split():
            pattern = os.path.expanduser(pattern.strip('"'))
            if not os.path.isabs(pattern):
                pattern = os.path.join(base, pattern)
            for found in sorted(glob.glob(pattern)):
                if os.path.isfile(found):
                    out.append(expand_includes(found, base, depth + 1, budget))
    return "\n".join(out) + "\n"


class Config(fabric.Config):
    """Fabric's configuration, whose ssh_config files understand ``Include``."""

    def _load_ssh_file(self, path):
        if not os.path.isfile(path):
            return
        base = os.path.dirname(path) if os.path.abspath(path).startswith("/etc/") else os.path.expanduser("~/.ssh")
        try:
            self.base_ssh_config.parse(io.StringIO(expand_includes(path, base)))
        except ConfigParseError as exc:
            raise InventoryError([f"{path}: {exc}"]) from exc


@lru_cache(maxsize=None)
def shared_config() -> Config:
    """One Fabric configuration per run (ssh_config read once), shared by every
    connection: Fabric's own config files are not read (lazy), only ssh_config."""
    config = Config(lazy=True)
    config.load_ssh_config()
    return config


def lookup(host: str) -> dict:
    """What ssh_config says for ``host`` (paramiko's lookup: lower-case keys)."""
    return dict(shared_config().base_ssh_config.lookup(host))
