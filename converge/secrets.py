"""Secrets that live in files on the control machine (API key, HF token, become
password): read with care, never echoed.

A file is refused when others may read it (like ssh refuses a private key),
when it is large, not UTF-8, empty, or more than one line.
"""
from __future__ import annotations

import os
import stat

from .errors import SecretError

MAX_BYTES = 64 * 1024


def read_secret_file(path: str, what: str, host: str) -> str:
    """The secret in ``path`` (one line, without its newline)."""
    full = os.path.expanduser(path)
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SecretError(f"{host}: {what}: cannot read {path} on this machine ({exc.strerror}); create it with "
                          f"the secret on one line (chmod 600 {path})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"{host}: {what}: {path} is not a regular file")
        if info.st_mode & 0o077:
            raise SecretError(f"{host}: {what}: {path} is mode {stat.S_IMODE(info.st_mode):04o}; it holds a secret, "
                              f"so others must not read it: chmod 600 {path}")
        raw = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise SecretError(f"{host}: {what}: {path} is larger than {MAX_BYTES // 1024} KiB; it must hold one line")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SecretError(f"{host}: {what}: {path} is not UTF-8 text") from exc
    value = text.removesuffix("\n")  # spaces may belong to a password: only the line's end goes
    if not value.strip() or "\n" in value or "\r" in value or "\0" in value:
        raise SecretError(f"{host}: {what}: {path} must hold the secret on exactly one line")
    return value


def read_optional_secret(path: str | None, what: str, host: str) -> str | None:
    """The secret in ``path`` when a file is named (None when not), without surrounding
    blanks; refused as `read_secret_file` refuses it."""
    if not path:
        return None
    return read_secret_file(path, what, host).strip()
