"""The host lock: one run converges a host at a time.

The lock is an ``flock`` taken by a script held open for the whole run on the
host (the facts are gathered in the same script: one round trip). It lasts as
long as the run is alive: a heartbeat writes a line to the script's stdin every
HEARTBEAT_S seconds. If the control process dies, sshd closes the channel and
``head`` sees EOF; if the link dies (or the control machine freezes), no line
comes within HOST_PATIENCE_S and the host lets the lock go.
"""
from __future__ import annotations

import os
import shlex
import socket
import threading
import time
from pathlib import Path

from .errors import ConnectionFailed, ConvergeError
from .shell_files import as_sent
from .transport import Held, Transport

LOCK_DIR = "/run/lock"
FIRST_ANSWER_S = 15  # for the held script to start and say whether it has the lock
HEARTBEAT_S = 15
HOST_PATIENCE_S = 45


SCRIPT = Path(__file__).parent / "host_scripts" / "hostlock.sh"


def _script(name: str, mode: str, wait: float = 0, holder: str = "") -> str:
    params = {"LOCK": f"{LOCK_DIR}/{name}.lock", "MODE": mode, "WAIT": int(wait), "HOLDER": holder}
    return "".join(f"{key}={shlex.quote(str(value))}\n" for key, value in params.items()) + as_sent(SCRIPT)


def changing_line(host: str, holder: str, again: str) -> str:
    """What a read-only run says of a host it found locked by a run that changes it (it read the
    host mid-run, and did not wait): ``again``, the command to run once that run is done."""
    return f"CHANGING {host}: another run holds its lock ({holder}); this is the host mid-run: run {again} again " \
           f"when it is done"


def lock_script(name: str, wait: float, holder: str) -> str:
    """Take an flock on the host and print ``locked`` (``busy HOLDER`` first if
    another run has it). Whatever follows runs under the lock; the script must
    end with `KEEP_HOLDING`."""
    return _script(name, "take", wait, holder)


def peek_script(name: str) -> str:
    """A read-only run's start: no lock taken, nothing written; ``busy HOLDER`` when a run
    holds the lock now, then ``reading``. The script must end with `KEEP_HOLDING`."""
    return _script(name, "peek")


def keep_holding(patience: int) -> str:
    # `exit` on the same line: a shell reading its script from stdin would otherwise wait
    # there for more script, and keep the lock
    return f"while l=$(timeout {int(patience)} head -n 1) && [ -n \"$l\" ]; do :; done; exit\n"


KEEP_HOLDING = keep_holding(HOST_PATIENCE_S)


class HostLock:
    """``take`` the lock with ``then`` (a script that runs under it, the facts)
    and read on from the returned `Held`; ``holding`` says whether the host still
    has it for us; ``release`` lets it go (closing the transport does too).

    ``read_only`` (a run that changes nothing: check mode): no lock is taken and nothing
    is written on the host; ``take`` says who holds the lock now (``on_busy``) and goes on
    at once, where a run that may change the host waits for it."""

    def __init__(self, transport: Transport, name: str, wait: float, read_only: bool = False):
        self.transport = transport
        self.name = name
        self.wait = wait
        self.read_only = read_only
        self.path = f"{LOCK_DIR}/{name}.lock"
        self.held: Held | None = None
        self._released = threading.Event()

    def take(self, then: str, on_busy=lambda holder: None) -> Held:
        holder = f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        start = peek_script(self.name) if self.read_only else lock_script(self.name, self.wait, holder)
        # inline: the lock and the facts hold no secret (a secret file is only hashed), so
        # the script may be the exec request's command line, one round trip less than stdin
        self.held = self.transport.hold(start + then + KEEP_HOLDING, timeout=FIRST_ANSWER_S, inline=True)
        first = self.held.readline(FIRST_ANSWER_S)
        if first is not None and first.startswith("busy"):
            on_busy(first[5:] or "another run")
            first = self.held.readline(FIRST_ANSWER_S if self.read_only else self.wait + 10)
        if first == "timeout":
            raise ConvergeError(f"another run is converging this host and kept its lock for more than "
                                f"{self.wait:g} s ({self.path}); try again when it is done, or pass a longer "
                                f"--lock-wait")
        if first is None:
            self.transport.refused(self.held)  # sudo said no (wrong password, not allowed): say that
        if first != ("reading" if self.read_only else "locked"):
            raise ConvergeError(f"could not {'read' if self.read_only else 'take'} the host lock {self.path}: "
                                f"{first or 'the shell ended without a word'}")
        threading.Thread(target=self._beat, args=(self.held,), name=f"heartbeat-{self.transport.name}",
                         daemon=True).start()
        return self.held

    def _beat(self, held: Held):
        while not self._released.wait(HEARTBEAT_S):
            try:
                held.proc.write(b"alive\n")
            except (ConnectionFailed, OSError, ValueError):
                return  # the link's own watchdog says what happened

    def holding(self) -> bool:
        """Raises ConnectionFailed when the link was found dead."""
        return self.held is not None and self.held.running()

    def release(self):
        self._released.set()
        if self.held is not None:
            self.held.close()
            self.held = None
