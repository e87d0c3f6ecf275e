"""The one way the engine reaches a host: run a script, hold one open, close.

Every command is a POSIX shell script sent on standard input to ``sh -s``, so a
script (and any secret inside a heredoc) never appears on a command line; become
(sudo) wraps that shell, its password first on stdin (converge.become). A held
script keeps its stdin open and is read line by line while it runs (the host lock
and the facts share one); one that holds no secret may travel ``inline`` as the
command line itself, one round trip less over SSH.

Two transports, ``ssh.SSHTransport`` and ``local.LocalTransport``, only start a
process on the host: an object with ``read(seconds)`` (the next chunk of standard
output; None: nothing in that time; b"": the output ended; standard error is
kept aside, ``stderr()``), ``write(data)``, ``status(seconds)`` (the exit
status), ``alive()`` (raises ConnectionFailed when the link died) and ``kill()``.
`collect` and `Held` are the only readers of that output.
"""
from __future__ import annotations

import getpass
import shlex
import time
from dataclasses import dataclass

from ..become import Become, diagnose
from ..errors import BecomeRefused, RemoteCommandError

INLINE_MAX = 64 * 1024  # well under sshd's packet and Linux's single-argument limits
# what a host may send back: a line (facts, lock answers) and a command's whole output; a
# host that sends more (broken or hostile) fails with a message, the control process's
# memory stays bounded; a command's output keeps its end, where the markers are
MAX_LINE = 16 * 1024 * 1024
MAX_HELD_OUTPUT = 64 * 1024 * 1024
MAX_OUTPUT = 32 * 1024 * 1024


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self):
        return self.rc == 0


def keep_tail(buffer: bytearray):
    del buffer[:max(0, len(buffer) - MAX_OUTPUT)]


def collect(proc, timeout: float | None, on_output=None) -> Result:
    """A process's output to its end (not to its exit status: sshd may send the
    status before the last of the output), lines handed to ``on_output`` as they
    come, then its exit status."""
    out, pending = bytearray(), b""
    deadline = time.monotonic() + timeout if timeout else None
    while (chunk := proc.read(0.5)) != b"":
        if chunk:
            out += chunk
            keep_tail(out)
            if on_output:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    on_output(line.decode(errors="replace"))
                pending = pending[-MAX_LINE:]
        elif deadline and time.monotonic() > deadline:
            proc.kill()
            raise RemoteCommandError(f"{proc.name}: a command did not finish within {timeout:g} s", rc=124,
                                     output=out.decode(errors="replace"))
    rc = proc.status(max(deadline - time.monotonic(), 0.1) if deadline else 30)
    return Result(rc, out.decode(errors="replace"), proc.stderr().decode(errors="replace"))


class Held:
    """A held script's output, read line by line while it keeps running."""

    def __init__(self, proc):
        self.proc = proc
        self.name = proc.name
        self._buf = b""
        self.ended = False

    def readline(self, timeout: float) -> str | None:
        """The next line; None if the script ended first. RemoteCommandError
        (rc 124) when no line came within ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf and not self.ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RemoteCommandError(f"{self.name}: no answer within {timeout:g} s", rc=124)
            chunk = self.proc.read(min(remaining, 1.0))
            if chunk is None:
                self.proc.alive()  # a link the watchdog found dead: say so now, not at the timeout
            self.ended = chunk == b""
            self._buf += chunk or b""
            if len(self._buf) > MAX_LINE and b"\n" not in self._buf:
                raise RemoteCommandError(f"{self.name}: the host sent a line longer than "
                                         f"{MAX_LINE // 1024 // 1024} MiB")
        if b"\n" in self._buf:
            line, _, self._buf = self._buf.partition(b"\n")
            return line.decode(errors="replace")
        line, self._buf = self._buf, b""  # the script ended without a last newline
        return line.decode(errors="replace") if line else None

    def read_until(self, marker: str, timeout: float) -> tuple[str, bool]:
        """Lines up to the line ``marker`` (excluded), and whether it came
        (False: the script ended before printing it)."""
        deadline, lines, size = time.monotonic() + timeout, [], 0
        while size <= MAX_HELD_OUTPUT:
            try:
                line = self.readline(max(deadline - time.monotonic(), 0))
            except RemoteCommandError as exc:
                raise RemoteCommandError(f"{self.name}: a command did not finish within {timeout:g} s", rc=exc.rc,
                                         output="\n".join(lines)) if exc.rc == 124 else exc
            if line is None or line == marker:
                return "\n".join(lines), line is not None
            lines.append(line)
            size += len(line) + 1
        raise RemoteCommandError(f"{self.name}: the host sent more than {MAX_HELD_OUTPUT // 1024 // 1024} MiB "
                                 f"before {marker!r}")

    def running(self) -> bool:
        return not self.ended and self.proc.alive()

    def close(self):
        self.proc.kill()


class Transport:
    """A host as the engine reaches it: subclasses start processes (``_start``);
    running, holding, become and sudo's refusals are the same for all."""

    name: str
    become: Become | None = None
    login_user: str = ""

    def _start(self, command: str, stdin: bytes, keep_open: bool, timeout: float | None):
        raise NotImplementedError

    def _shell(self, inline_script: str | None = None) -> str:
        if self.become is not None:
            return self.become.command(inline_script)
        return "sh -s" if inline_script is None else f"sh -c {shlex.quote(inline_script)}"

    def run(self, script: str, timeout: float | None = None, on_output=None) -> Result:
        stdin = (self.become.preamble() if self.become else b"") + script.encode()
        result = collect(self._start(self._shell(), stdin, False, timeout), timeout, on_output)
        if result.rc != 0:
            self._refused(result.stderr)
        return result

    def hold(self, script: str, timeout: float, inline: bool = False) -> Held:
        """``script`` with its stdin kept open (``Held.proc.write`` adds to it) until
        it is closed or the transport closes."""
        if inline and len(script) < INLINE_MAX and (self.become is None or self.become.inline_ok):
            return Held(self._start(self._shell(script), b"", True, timeout))
        stdin = (self.become.preamble() if self.become else b"") + script.encode()
        return Held(self._start(self._shell(), stdin, True, timeout))

    def refused(self, held: Held):
        """Raise BecomeRefused if a held script ended because sudo would not run it."""
        self._refused(held.proc.stderr().decode(errors="replace"))

    def _refused(self, output: str):
        why = self.become and diagnose(output, self.login_user or getpass.getuser(), self.become, self.name)
        if why:
            raise BecomeRefused(why)

    def local_address(self) -> str | None:
        """This machine's address on the host's side of the link (None: no direct link)."""
        return None

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
