"""The one way the engine reaches a host: run a script, hold one open, close.

Every command is a POSIX shell script sent on standard input to ``sh -s``, so a
script (and any secret inside a heredoc) never appears on a command line. Become
(sudo) wraps that shell, its password first on stdin (converge.become). A held
script keeps its stdin open and is read line by line while it runs (the host lock
and the facts share one); a held script that holds no secret may travel ``inline``
as the command line itself, one round trip less over SSH.

Two transports, one read loop: ``ssh.SSHTransport`` (a Fabric connection, our
pipelined exec, a keepalive watchdog) and ``local.LocalTransport``. Each only
starts a `Process` (a script running on the host) and reads its bytes;
`collect` and `Held` are the only readers of a process's output.
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
    if len(buffer) > MAX_OUTPUT:
        del buffer[:len(buffer) - MAX_OUTPUT]


class Process:
    """A script running on a host, as a transport started it.

    ``read(seconds)``: the next chunk of standard output, ``None`` when nothing came
    in that time, ``b""`` once the output ended (standard error is gathered aside);
    ``write``: more standard input; ``status(seconds)``: the exit status;
    ``alive()``: whether it still runs (raises ConnectionFailed when the link died);
    ``kill()``: end it."""

    name: str

    def read(self, seconds: float) -> bytes | None: ...
    def stderr(self) -> bytes: ...
    def write(self, data: bytes): ...
    def status(self, seconds: float) -> int: ...
    def alive(self) -> bool: ...
    def kill(self): ...


def collect(proc: Process, timeout: float | None, on_output=None) -> Result:
    """The read loop: ``proc``'s output to its end (not to its exit status: sshd may
    send the status before the last of the output), lines handed to ``on_output``
    as they come, then its exit status."""
    out = bytearray()
    deadline = time.monotonic() + timeout if timeout else None
    pending = b""
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

    def __init__(self, proc: Process):
        self.proc = proc
        self.name = proc.name
        self._buf = b""
        self.ended = False

    def readline(self, timeout: float) -> str | None:
        """The next line; ``None`` if the script ended first. Raises
        RemoteCommandError (rc 124) when no line came within ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            if self.ended:
                line, self._buf = self._buf, b""
                return line.decode(errors="replace") if line else None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RemoteCommandError(f"{self.name}: no answer within {timeout:g} s", rc=124,
                                         output=self._buf.decode(errors="replace"))
            chunk = self.proc.read(min(remaining, 1.0))
            if chunk is None:
                self.proc.alive()  # a link the watchdog found dead: say so now, not at the timeout
            elif chunk == b"":
                self.ended = True
            else:
                self._buf += chunk
                if len(self._buf) > MAX_LINE and b"\n" not in self._buf:
                    raise RemoteCommandError(f"{self.name}: the host sent a line longer than "
                                             f"{MAX_LINE // 1024 // 1024} MiB", rc=None)
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def read_until(self, marker: str, timeout: float) -> tuple[str, bool]:
        """Lines up to the line ``marker`` (excluded), and whether it came
        (False: the script ended before printing it)."""
        deadline = time.monotonic() + timeout
        lines: list[str] = []
        size = 0
        while size <= MAX_HELD_OUTPUT:
            try:
                line = self.readline(max(deadline - time.monotonic(), 0))
            except RemoteCommandError as exc:
                if exc.rc != 124:
                    raise
                raise RemoteCommandError(f"{self.name}: a command did not finish within {timeout:g} s", rc=124,
                                         output="\n".join(lines)) from exc
            if line is None or line == marker:
                return "\n".join(lines), line is not None
            lines.append(line)
            size += len(line) + 1
        raise RemoteCommandError(f"{self.name}: the host sent more than {MAX_HELD_OUTPUT // 1024 // 1024} MiB "
                                 f"before {marker!r}", rc=None)

    def running(self) -> bool:
        return not self.ended and self.proc.alive()

    def close(self):
        self.proc.kill()


class Transport:
    """A host as the engine reaches it. Subclasses start processes (``_start``);
    running, holding, become and sudo's refusals are the same everywhere."""

    name: str
    become: Become | None = None
    login_user: str = ""

    def _start(self, command: str, stdin: bytes, keep_open: bool, timeout: float | None) -> Process:
        raise NotImplementedError

    def _shell(self, inline_script: str | None = None) -> str:
        """The command a host runs: ``sh -s`` reading the script on stdin, or ``sh -c SCRIPT``."""
        if self.become is not None:
            return self.become.command(inline_script)
        return "sh -s" if inline_script is None else f"sh -c {shlex.quote(inline_script)}"

    def _stdin(self, script: str) -> bytes:
        return (self.become.preamble() if self.become else b"") + script.encode()

    def run(self, script: str, timeout: float | None = None, on_output=None) -> Result:
        proc = self._start(self._shell(), self._stdin(script), False, timeout)
        result = collect(proc, timeout, on_output)
        if result.rc != 0:
            self._refused(result.stderr)
        return result

    def hold(self, script: str, timeout: float, inline: bool = False) -> Held:
        """Start ``script`` with its stdin kept open (`Held.proc.write` adds to it):
        it ends when it is closed or the transport closes. ``inline``: it holds no
        secret and may travel on the command line."""
        if inline and len(script) < INLINE_MAX and (self.become is None or self.become.inline_ok):
            return Held(self._start(self._shell(script), b"", True, timeout))
        return Held(self._start(self._shell(), self._stdin(script), True, timeout))

    def refused(self, held: Held):
        """Raise BecomeRefused if a held script ended because sudo would not run it."""
        self._refused(held.proc.stderr().decode(errors="replace"))

    def _refused(self, output: str):
        if self.become is not None:
            why = diagnose(output, self.login_user or getpass.getuser(), self.become, self.name)
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
