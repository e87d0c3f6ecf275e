"""Connections to hosts: one SSH connection per host per run, or the local machine.

The SSH connection is a Fabric ``Connection`` (ssh_config, gateways, connect
settings; see fabric_ssh for what we change: strict host keys, shared jump
hosts). What stays ours is the speed path, which Fabric's ``run`` does not
have: every command is a POSIX shell script sent on standard input to
``sh -s``, its exec request sent without waiting for the reply (as OpenSSH's
own client does), so one script is one round trip; the script (and any secret
inside a heredoc) never appears on a command line. The one exception is a held
script that the caller marks ``inline`` (the host lock and the facts, which hold
no secret): it is the exec request's command line, which saves the round trip
sshd makes a script on stdin wait (it opens a session's window only once the
exec runs). Become (sudo) wraps the shell; its password goes first on stdin
(become.py).
"""
from __future__ import annotations

import os
import select
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import paramiko

from . import fabric_ssh, hostkeys
from .become import Become, diagnose
from .errors import BecomeRefused, ConnectionFailed, RemoteCommandError
from .ssh_settings import SSHSettings


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self):
        return self.rc == 0


class Connection:
    """What the engine needs from a host: run a script, hold a lock, close."""

    name: str

    def _send_script(self, channel, script: str):
        """The script on the command's stdin; a link that died meanwhile is the
        connection's failure (unreachable), not the step's."""
        try:
            channel.sendall(self._preamble() + script.encode())
            channel.shutdown_write()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if self.dead_reason:
                raise self._lost() from exc
            raise ConnectionFailed(f"{self.name}: the SSH connection was lost: {exc}") from exc

    def run(self, script: str, timeout: float | None = None, on_output=None) -> Result:
        raise NotImplementedError

    def hold(self, script: str, timeout: float, inline: bool = False) -> "Held":
        """Start ``script`` with its stdin kept open and return it as a `Held`:
        its output is read line by line as it comes, and it ends when the
        connection closes (the host lock and the facts share one such script).

        ``inline``: the script may travel on the command line (it holds no secret),
        which saves a round trip over SSH."""
        raise NotImplementedError

    def refused(self, held: "Held"):
        """Raise BecomeRefused if ``held`` ended because sudo would not run it."""

    def holding(self, held: "Held") -> bool:
        """Whether a held script (the host lock) still runs; raises ConnectionFailed
        when the connection was found dead."""
        return not held.ended and held.alive()

    def local_address(self) -> str | None:
        """This machine's address on the host's side of the link (None: no direct link)."""
        return None

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shell(become: Become | None, script: str | None = None) -> str:
    """The command a host runs: ``sh -s`` reading the script on stdin, or ``sh -c SCRIPT``."""
    if become is not None:
        return become.command(script)
    return f"sh -c {shlex.quote(script)}" if script is not None else "sh -s"


INLINE_MAX = 64 * 1024  # well under sshd's packet and Linux's single-argument limits
# what a host may send back: a line (facts, lock answers) and a command's whole output; a
# host that sends more (broken or hostile) fails with a message, the control process's
# memory stays bounded; a command's output keeps its end, where the markers are
MAX_LINE = 16 * 1024 * 1024
MAX_HELD_OUTPUT = 64 * 1024 * 1024
MAX_OUTPUT = 32 * 1024 * 1024


# Liveness, as OpenSSH's ServerAliveInterval/CountMax: paramiko's own keepalive asks for
# no reply, so a dead link (cable, host gone) was noticed only by a command's timeout, or
# TCP's, in minutes to hours. Every ALIVE_S seconds the connection asks the server for a
# reply; with none for ALIVE_S * ALIVE_COUNT seconds, it is closed and says why.
ALIVE_S = 5.0
ALIVE_COUNT = 3
# The host lock's heartbeat (runner.KEEP_HOLDING): a line this often, patience on the host side
HEARTBEAT_S = 15
HOST_PATIENCE_S = 45


def _keep_tail(buffer: bytearray):
    if len(buffer) > MAX_OUTPUT:
        del buffer[:len(buffer) - MAX_OUTPUT]


class Held:
    """A script that keeps running while we read its output line by line.

    ``recv(seconds)`` returns the next chunk of standard output, ``None`` when
    nothing came within that time, or ``b""`` when the script's output ended.
    ``stderr()`` is what came on standard error (where sudo speaks).
    """

    def __init__(self, name: str, recv, close, stderr=lambda: "", alive=lambda: True):
        self.name = name
        self._recv = recv
        self._close = close
        self.stderr = stderr
        self.alive = alive  # whether the script still runs (raises ConnectionFailed if the link died)
        self._buf = b""
        self.ended = False

    def readline(self, timeout: float) -> str | None:
        """The next line; ``None`` if the script ended first. Raises
        RemoteCommandError (rc 124) when no line came within ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            if self.ended:
                if not self._buf:
                    return None
                line, self._buf = self._buf, b""
                return line.decode(errors="replace")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RemoteCommandError(f"{self.name}: no answer within {timeout:g} s", rc=124,
                                         output=self._buf.decode(errors="replace"))
            chunk = self._recv(min(remaining, 1.0))
            if chunk is None:
                self.alive()  # a link the keeper found dead: say so now, not at the timeout
            if chunk == b"":
                self.ended = True
            elif chunk:
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
        lines = []
        size = 0
        while True:
            if size > MAX_HELD_OUTPUT:
                raise RemoteCommandError(f"{self.name}: the host sent more than {MAX_HELD_OUTPUT // 1024 // 1024} "
                                         f"MiB before {marker!r}", rc=None)
            try:
                line = self.readline(max(deadline - time.monotonic(), 0))
            except RemoteCommandError as exc:
                raise RemoteCommandError(f"{self.name}: a command did not finish within {timeout:g} s", rc=124,
                                         output="\n".join(lines)) from exc
            if line is None:
                return "\n".join(lines), False
            if line == marker:
                return "\n".join(lines), True
            lines.append(line)
            size += len(line) + 1

    def close(self):
        self._close()


class SSHConnection(Connection):
    """A host over SSH: a Fabric connection (through its jump hosts, if any)
    driven by our pipelined scripts."""

    def __init__(self, settings: SSHSettings, jumps: fabric_ssh.JumpHosts | None = None):
        self.name = settings.name
        self.settings = settings
        self.become = settings.become
        self._own_jumps = jumps is None  # alone (trust, tests): its jump hosts are its own
        self.jumps = jumps if jumps is not None else fabric_ssh.JumpHosts()
        self._gateway = self.jumps.gateway(settings)
        self.fabric = fabric_ssh.for_host(settings, self._gateway)
        self.client = self.fabric.client
        self._held = []
        self.dead_reason: str | None = None  # set by the keeper when the link died
        self._closing = threading.Event()

    @property
    def known_hosts_name(self) -> str:
        return hostkeys.known_hosts_name(self.fabric.host, self.fabric.port)

    def open(self) -> "SSHConnection":
        s = self.settings
        try:
            self.jumps.open_for(s, self._gateway)
            via = str(s.jumps[-1]) if s.jumps else None
            fabric_ssh.open_connection(self.fabric, s.name, "", s.known_hosts, s.connect_timeout, via=via)
        except ConnectionFailed:
            self.close()
            raise
        threading.Thread(target=self._keep, name=f"keeper-{s.name}", daemon=True).start()
        return self

    def _keep(self):
        """Probe the link every ALIVE_S seconds; send the host lock's heartbeat."""
        transport = self.client.get_transport()
        last_beat = time.monotonic()
        while not self._closing.wait(ALIVE_S):
            if transport is None or not transport.is_active():
                return
            if not _answers(transport, ALIVE_S * ALIVE_COUNT):
                if self._closing.is_set():
                    return
                self.dead_reason = (f"{self.name}: no answer from {self.known_hosts_name} for "
                                    f"{ALIVE_S * ALIVE_COUNT:g} s: the link or the host went down")
                transport.close()
                return
            if time.monotonic() - last_beat >= HEARTBEAT_S:
                last_beat = time.monotonic()
                for channel in list(self._held):
                    try:
                        if not channel.closed:
                            channel.sendall(b"alive\n")
                    except (OSError, EOFError, paramiko.SSHException):
                        pass

    def local_address(self) -> str | None:
        # through jump hosts the link is a channel in the first hop's connection: our
        # address toward that hop, which the host behind it may or may not reach (ask it)
        sock = self.client.get_transport().sock
        for _ in range(8):
            if isinstance(sock, socket.socket):
                return sock.getsockname()[0]
            if not isinstance(sock, paramiko.Channel):
                return None
            sock = sock.get_transport().sock
        return None

    def _lost(self) -> ConnectionFailed:
        return ConnectionFailed(self.dead_reason or f"{self.name}: the SSH connection was lost")


    def _exec(self, timeout, command: str | None = None) -> paramiko.Channel:
        """A session channel running our shell.

        The exec request is sent without waiting for its reply (as OpenSSH's own
        client does): the script follows at once, which saves a round trip per
        command. A refused request closes the channel, which `run` reports."""
        command = command or _shell(self.become)
        try:
            channel = self.client.get_transport().open_session(timeout=timeout)
            # paramiko's exec_command without its wait (same message, same bookkeeping)
            mark_pending = getattr(channel, "_event_pending", None)
            send = getattr(channel.transport, "_send_user_message", None)
            if mark_pending is None or send is None:  # a paramiko without them: the waiting request
                channel.exec_command(command)
                return channel
            message = paramiko.Message()
            message.add_byte(paramiko.common.cMSG_CHANNEL_REQUEST)
            message.add_int(channel.remote_chanid)
            message.add_string("exec")
            message.add_boolean(True)
            message.add_string(command)
            mark_pending()
            send(message)
        except (paramiko.SSHException, AttributeError, EOFError, OSError) as exc:
            if self.dead_reason:
                raise self._lost() from exc
            raise ConnectionFailed(f"{self.name}: the SSH connection was lost: {exc}") from exc
        return channel

    def _preamble(self) -> bytes:
        return self.become.preamble() if self.become else b""

    def _refused(self, output: str):
        """Raise BecomeRefused when sudo, not the script, said no."""
        if self.become is None:
            return
        why = diagnose(output, self.fabric.user, self.become, self.name)
        if why:
            raise BecomeRefused(why)

    def run(self, script: str, timeout: float | None = None, on_output=None) -> Result:
        channel = self._exec(timeout)
        self._send_script(channel, script)
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout if timeout else None
        pending = b""
        # Read until the end of output (EOF), not until the exit status: sshd may
        # send the status before the last of the output.
        while True:
            if channel.recv_ready():
                chunk = channel.recv(65536)
                out += chunk
                _keep_tail(out)
                if on_output:
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        on_output(line.decode(errors="replace"))
                    pending = pending[-MAX_LINE:]
                continue
            if channel.recv_stderr_ready():
                err += channel.recv_stderr(65536)
                _keep_tail(err)
                continue
            if channel.eof_received or channel.closed:
                break
            if deadline and time.monotonic() > deadline:
                channel.close()
                raise RemoteCommandError(f"{self.name}: a command did not finish within {timeout:g} s", rc=124,
                                         output=out.decode(errors="replace"))
            select.select([channel], [], [], 0.5)
        wait = max(deadline - time.monotonic(), 0.1) if deadline else 30
        # a closed channel without a status will not get one: no need to wait for it
        got_status = channel.status_event.is_set() or (not channel.closed and channel.status_event.wait(wait))
        if not got_status:
            channel.close()
            if channel.transport is None or not channel.transport.is_active():
                raise self._lost()
            raise RemoteCommandError(f"{self.name}: the host ended a command without an exit status "
                                     f"(did sshd refuse to run '{_shell(self.become)}'?)", rc=255,
                                     output=out.decode(errors="replace"))
        rc = channel.recv_exit_status()
        channel.close()
        if self.dead_reason or (rc == -1 and not channel.transport.is_active()):
            raise self._lost()  # paramiko closes a dead connection's channels with status -1: not the command's
        result = Result(rc, out.decode(errors="replace"), err.decode(errors="replace"))
        if rc != 0:
            self._refused(result.stderr)
        return result

    def hold(self, script: str, timeout: float, inline: bool = False) -> Held:
        if inline and len(script) < INLINE_MAX and (self.become is None or self.become.inline_ok):
            # in the exec request itself: sshd opens a session's window only once the exec
            # is running, so a script on stdin waits one more round trip for it
            channel = self._exec(timeout, _shell(self.become, script))
        else:
            channel = self._exec(timeout)
            try:
                channel.sendall(self._preamble() + script.encode())  # stdin stays open: the heartbeat
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ConnectionFailed(f"{self.name}: the SSH connection was lost: {exc}") from exc
        self._held.append(channel)
        err = bytearray()

        def recv(seconds):
            for _ in range(2):
                if channel.recv_ready():
                    return channel.recv(65536)
                while channel.recv_stderr_ready():  # sudo's words: kept apart from the script's lines
                    err.extend(channel.recv_stderr(65536))
                if channel.eof_received or channel.closed:
                    return b""
                if not select.select([channel], [], [], seconds)[0]:
                    return None
            return None

        def stderr():
            while channel.recv_stderr_ready():
                err.extend(channel.recv_stderr(65536))
            return err.decode(errors="replace")

        def alive():
            if self.dead_reason:
                raise self._lost()
            return not (channel.closed or channel.eof_received)

        return Held(self.name, recv, channel.close, stderr, alive)

    def refused(self, held: Held):
        """For the runner: raise BecomeRefused if a held script ended because sudo said no."""
        self._refused(held.stderr())

    def close(self):
        self._closing.set()
        for channel in self._held:
            channel.close()
        self.fabric.close()
        if self._own_jumps:
            self.jumps.close()


def _answers(transport, timeout: float) -> bool:
    """Whether the server answers a ``keepalive@openssh.com`` request (with a
    reply asked for: OpenSSH answers "failure", which is an answer) in time."""
    answered = threading.Event()
    send = getattr(transport, "_send_user_message", None)
    if send is None:  # a paramiko without it: the waiting request, in a thread of its own
        threading.Thread(target=lambda: (transport.global_request("keepalive@openssh.com", wait=True),
                                         answered.set()), daemon=True).start()
        return answered.wait(timeout)
    message = paramiko.Message()
    message.add_byte(paramiko.common.cMSG_GLOBAL_REQUEST)
    message.add_string("keepalive@openssh.com")
    message.add_boolean(True)
    transport.completion_event = answered  # set by paramiko when the reply (success or failure) comes
    try:
        send(message)
    except (OSError, EOFError, paramiko.SSHException):
        return False
    return answered.wait(timeout)


class LocalConnection(Connection):
    """The machine we run on, through the same scripts (``--local``)."""

    def __init__(self, name: str = "localhost", become: Become | None = None):
        self.name = name
        self.become = become
        self._held = []
        self._closing = threading.Event()
        self._beating = False

    def open(self):
        return self

    def run(self, script: str, timeout: float | None = None, on_output=None) -> Result:
        proc = subprocess.Popen(shlex.split(_shell(self.become)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        err_chunks = []
        reader = threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True)
        reader.start()
        proc.stdin.write(script.encode())
        proc.stdin.close()
        out = bytearray()
        deadline = time.monotonic() + timeout if timeout else None
        pending = b""
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
                _keep_tail(out)
                if on_output:
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        on_output(line.decode(errors="replace"))
            if deadline and time.monotonic() > deadline:
                os.killpg(proc.pid, 9)
                raise RemoteCommandError(f"{self.name}: a command did not finish within {timeout:g} s", rc=124,
                                         output=out.decode(errors="replace"))
        rc = proc.wait()
        reader.join(5)
        return Result(rc, out.decode(errors="replace"), b"".join(err_chunks).decode(errors="replace"))

    def hold(self, script: str, timeout: float, inline: bool = False) -> Held:
        proc = subprocess.Popen(shlex.split(_shell(self.become)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        proc.stdin.write(script.encode())
        proc.stdin.flush()
        self._held.append(proc)
        if not self._beating:  # the host lock's heartbeat, as over SSH
            self._beating = True
            threading.Thread(target=self._beat, daemon=True).start()

        def recv(seconds):
            ready, _, _ = select.select([proc.stdout], [], [], seconds)
            return os.read(proc.stdout.fileno(), 65536) if ready else None

        def close():
            self._release(proc)
            self._held.remove(proc)

        return Held(self.name, recv, close, alive=lambda: proc.poll() is None)

    def _beat(self):
        while not self._closing.wait(HEARTBEAT_S):
            for proc in list(self._held):
                try:
                    proc.stdin.write(b"alive\n")
                    proc.stdin.flush()
                except (OSError, ValueError):
                    pass

    @staticmethod
    def _release(proc):
        try:
            proc.stdin.close()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()

    def close(self):
        self._closing.set()
        for proc in self._held:
            self._release(proc)
        self._held = []


def connect(settings: SSHSettings | None, local: bool = False, name: str = "localhost") -> Connection:
    if local:
        return LocalConnection(name).open()
    return SSHConnection(settings).open()
