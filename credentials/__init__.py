"""What the control machine keeps for the fleet's front doors: the fleet CA
(its key never leaves this machine) and the users' API keys (only their sha256).

Both live in ``credentials_dir`` (an inventory variable; default
~/.local/state/dgemma-fleet), a 0700 folder whose secret files are 0600.

What is missing is made by a deploy, and only by a deploy: a read-only run (``deploy
--check``, verify, status, top, facts, render) passes ``make=False``, and gets what a
deploy would make held in memory for the run (`unsaved`), never written; nothing is
created on this machine, not even the folder or its lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

DEFAULT_DIR = "~/.local/state/dgemma-fleet"


class CredentialError(Exception):
    """A credential file that cannot be used; the message says what to do."""


def directory(hostvars_any: dict | None) -> Path:
    """The credentials folder the inventory names (every host shares one: it is an ``all`` variable)."""
    return Path(os.path.expanduser((hostvars_any or {}).get("credentials_dir", DEFAULT_DIR)))


def write_private(path: Path, data: bytes, mode: int = 0o600):
    """Write atomically with ``mode`` from the start: a secret is never readable by others, not even briefly."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_THREADS = threading.RLock()
_UNSAVED: dict = {}  # (folder, what) -> what a read-only run would have made, for every host of the run alike


def unsaved(folder: Path, what: tuple, make):
    """What a deploy would make, made in memory once per process and never saved."""
    with _THREADS:
        key = (str(folder), what)
        if key not in _UNSAVED:
            _UNSAVED[key] = make()
        return _UNSAVED[key]


@contextlib.contextmanager
def locked(folder: Path):
    """One writer at a time: the hosts of a run plan in threads, and two runs may share the folder."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _THREADS:
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
