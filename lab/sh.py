"""Running commands on the lab machine itself: argument lists, never a shell."""
from __future__ import annotations

import subprocess


class LabError(Exception):
    pass


def run(*args, check=True, capture=True, input=None, timeout=None, env=None) -> subprocess.CompletedProcess:
    args = [str(a) for a in args]
    try:
        proc = subprocess.run(args, capture_output=capture, text=True, input=input, timeout=timeout, env=env)
    except FileNotFoundError as exc:
        raise LabError(f"{args[0]} is not installed: run `invoke lab.up` as root on Debian 12 "
                       f"(it installs what the lab needs)") from exc
    if check and proc.returncode != 0:
        out = ((proc.stdout or "") + (proc.stderr or "")).strip()
        raise LabError(f"{' '.join(args)} failed (exit {proc.returncode}): {out[-1500:]}")
    return proc


def ok(*args) -> bool:
    return run(*args, check=False).returncode == 0
