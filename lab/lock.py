"""One lab command at a time on this machine: `invoke lab.up` and `invoke lab.down` each hold
an flock on the lab's state folder while they run. Two of them at once (a second terminal, a
test session beside a ./run.sh main) would copy, boot and remove the same hosts' disks over each
other; the second is refused at once, naming the first."""
from __future__ import annotations

import contextlib
import fcntl
import os

from . import config
from .sh import LabError


@contextlib.contextmanager
def held(what: str):
    """The lab's lock for ``what`` (a command's name), or LabError naming who holds it."""
    config.STATE.mkdir(parents=True, exist_ok=True)
    path = config.STATE / "lab.lock"
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another command"
            raise LabError(f"{holder} is running on this lab now ({path} is locked): wait for it to end, "
                           f"then run {what} again") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"invoke {what} (pid {os.getpid()})\n")
        handle.flush()
        yield
