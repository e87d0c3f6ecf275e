"""Connections to hosts: one SSH connection per host per run, or the local machine.

Every command is a POSIX shell script sent on standard input to ``sh -s``: the
script (and any secret inside a heredoc) never appears on a command line, and
one script is one command. The one exception is a held script that the caller
marks ``inline`` (the host lock and the facts, which hold no secret): it is the
exec request's command line, which saves the round trip sshd makes a script on
stdin wait (it opens a session's window only once the exec runs). Host keys are checked against known_hosts with
paramiko's RejectPolicy; nothing is ever added behind the user's back
(``invoke trust`` does that, on request).
"""
from __future__ import annotations

import base64
import hashlib
import os
import select
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

from .errors import ConnectionFailed, HostKeyError, RemoteCommandError


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self):
        return self.rc == 0


@dataclass
class SSHSettings:
    """Connection settings, from the inventory (``ansible_*`` names) and ~/.ssh/config."""

    name: str
    address: str
    port: int = 22
    user: str = "root"
    key_file: str | None = None
    known_hosts: str | None = None
    connect_timeout: float = 10.0
    become: bool = False

    @classmethod
    def from_vars(cls, name: str, hostvars: dict) -> "SSHSettings":
        """Inventory values win over ~/.ssh/config, which wins over defaults."""
        ssh_config = _user_ssh_config().lookup(hostvars.get("ansible_host") or name)
        key = hostvars.get("ansible_ssh_private_key_file") or (ssh_config.get("identityfile") or [None])[0]
        known = hostvars.get("known_hosts_file") or (ssh_config.get("userknownhostsfile") or "").split(" ")[0] or None
        return cls(
            name=name,
            address=hostvars.get("ansible_host") or ssh_config.get("hostname", name),
            port=int(hostvars.get("ansible_port") or ssh_config.get("port", 22)),
            user=hostvars.get("ansible_user") or ssh_config.get("user", "root"),
            key_file=os.path.expanduser(key) if key else None,
            known_hosts=os.path.expanduser(known) if known else None,
            connect_timeout=float(hostvars.get("connect_timeout", 10)),
            become=bool(hostvars.get("ansible_become", False)),
        )

    @property
    def known_hosts_name(self) -> str:
        """How OpenSSH names this host in known_hosts."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"


def _user_ssh_config() -> paramiko.SSHConfig:
    path = Path.home() / ".ssh" / "config"
    if path.is_file():
        return paramiko.SSHConfig.from_path(str(path))
    return paramiko.SSHConfig()


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_known_hosts(settings: SSHSettings) -> paramiko.HostKeys:
    keys = paramiko.HostKeys()
    for path in ([settings.known_hosts] if settings.known_hosts else []) + [os.path.expanduser("~/.ssh/known_hosts")]:
        if path and os.path.isfile(path):
            keys.load(path)
    return keys


class Connection:
    """What the engine needs from a host: run a script, hold a lock, close."""

    name: str

    def run(self, script: str, timeout: float | None = None, on_output=None) -> Result:
        raise NotImplementedError

    def hold(self, script: str, timeout: float, inline: bool = False) -> "Held":
        """Start ``script`` with its stdin kept open and return it as a `Held`:
        its output is read line by line as it comes, and it ends when the
        connection closes (the host lock and the facts share one such script).

        ``inline``: the script may travel on the command line (it holds no secret),
        which saves a round trip over SSH."""
        raise NotImplementedError

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shell(become: bool, script: str | None = None) -> str:
    """The command a host runs: ``sh -s`` reading the script on stdin, or ``sh -c SCRIPT``."""
    shell = f"sh -c {shlex.quote(script)}" if script is not None else "sh -s"
    return f"sudo -n {shell}" if become else shell


INLINE_MAX = 64 * 1024  # well under sshd's packet and Linux's single-argument limits


class Held:
    """A script that keeps running while we read its output line by line.

    ``recv(seconds)`` returns the next chunk of output, ``None`` when nothing
    came within that time, or ``b""`` when the script's output ended.
    """

    def __init__(self, name: str, recv, close):
        self.name = name
        self._recv = recv
        self._close = close
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
            if chunk == b"":
                self.ended = True
            elif chunk:
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def read_until(self, marker: str, timeout: float) -> tuple[str, bool]:
        """Lines up to the line ``marker`` (excluded), and whether it came
        (False: the script ended before printing it)."""
        deadline = time.monotonic() + timeout
        lines = []
        while True:
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

    def close(self):
        self._close()


class SSHConnection(Connection):
    def __init__(self, settings: SSHSettings):
        self.name = settings.name
        self.settings = settings
        self.client = paramiko.SSHClient()
        self.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        self._held = []

    def open(self) -> "SSHConnection":
        s = self.settings
        known = load_known_hosts(s)
        # paramiko's own client keeps the same table; give it ours
        for hostname in known.keys():
            for keytype, key in known[hostname].items():
                self.client.get_host_keys().add(hostname, keytype, key)
        try:
            self.client.connect(
                s.address, port=s.port, username=s.user, key_filename=s.key_file,
                timeout=s.connect_timeout, banner_timeout=s.connect_timeout, auth_timeout=s.connect_timeout,
                allow_agent=s.key_file is None, look_for_keys=s.key_file is None)
        except paramiko.BadHostKeyException as exc:
            raise HostKeyError(
                f"{s.name}: the host key of {s.known_hosts_name} CHANGED: it offered {fingerprint(exc.key)} "
                f"but known_hosts has {fingerprint(exc.expected_key)}. If the host was reinstalled, remove the "
                f"old key (ssh-keygen -R {shlex.quote(s.known_hosts_name)} -f {s.known_hosts or '~/.ssh/known_hosts'}) "
                f"and run: invoke trust --hosts {s.name}. Otherwise someone may be intercepting the connection.") from exc
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise HostKeyError(
                    f"{s.name}: {s.known_hosts_name} is not in known_hosts"
                    f"{' (' + s.known_hosts + ')' if s.known_hosts else ''}. Check its fingerprint and pin it "
                    f"with: invoke trust --hosts {s.name}") from exc
            raise ConnectionFailed(f"{s.name}: SSH to {s.user}@{s.known_hosts_name} failed: {exc}") from exc
        except (socket.timeout, TimeoutError) as exc:
            raise ConnectionFailed(f"{s.name}: no answer from {s.known_hosts_name} within "
                                   f"{s.connect_timeout:g} s: is the host up?") from exc
        except OSError as exc:
            raise ConnectionFailed(f"{s.name}: cannot reach {s.known_hosts_name}: {exc.strerror or exc}") from exc
        transport = self.client.get_transport()
        transport.set_keepalive(15)
        # Our messages are small requests that wait for their answers: with Nagle's
        # algorithm on, the script behind an exec request waited for a delayed ACK,
        # ~40 ms per command on a LAN.
        transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def _exec(self, timeout, command: str | None = None) -> paramiko.Channel:
        """A session channel running our shell.

        The exec request is sent without waiting for its reply (as OpenSSH's own
        client does): the script follows at once, which saves a round trip per
        command. A refused request closes the channel, which `run` reports."""
        command = command or _shell(self.settings.become)
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
            raise ConnectionFailed(f"{self.name}: the SSH connection was lost: {exc}") from exc
        return channel

    def run(self, script: str, timeout: float | None = None, on_output=None) -> Result:
        channel = self._exec(timeout)
        channel.sendall(script.encode())
        channel.shutdown_write()
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout if timeout else None
        pending = b""
        # Read until the end of output (EOF), not until the exit status: sshd may
        # send the status before the last of the output.
        while True:
            if channel.recv_ready():
                chunk = channel.recv(65536)
                out += chunk
                if on_output:
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        on_output(line.decode(errors="replace"))
                continue
            if channel.recv_stderr_ready():
                err += channel.recv_stderr(65536)
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
                raise ConnectionFailed(f"{self.name}: the SSH connection was lost")
            raise RemoteCommandError(f"{self.name}: the host ended a command without an exit status "
                                     f"(did sshd refuse to run '{_shell(self.settings.become)}'?)", rc=255,
                                     output=out.decode(errors="replace"))
        rc = channel.recv_exit_status()
        channel.close()
        return Result(rc, out.decode(errors="replace"), err.decode(errors="replace"))

    def hold(self, script: str, timeout: float, inline: bool = False) -> Held:
        if inline and len(script) < INLINE_MAX:
            # in the exec request itself: sshd opens a session's window only once the exec
            # is running, so a script on stdin waits one more round trip for it
            channel = self._exec(timeout, _shell(self.settings.become, script))
        else:
            channel = self._exec(timeout)
            channel.sendall(script.encode())
        self._held.append(channel)

        def recv(seconds):
            for _ in range(2):
                if channel.recv_ready():
                    return channel.recv(65536)
                if channel.recv_stderr_ready():  # held scripts send both streams as one
                    return channel.recv_stderr(65536)
                if channel.eof_received or channel.closed:
                    return b""
                if not select.select([channel], [], [], seconds)[0]:
                    return None
            return None

        return Held(self.name, recv, channel.close)

    def close(self):
        for channel in self._held:
            channel.close()
        self.client.close()


class LocalConnection(Connection):
    """The machine we run on, through the same scripts (``--local``)."""

    def __init__(self, name: str = "localhost", become: bool = False):
        self.name = name
        self.become = become
        self._held = []

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

        def recv(seconds):
            ready, _, _ = select.select([proc.stdout], [], [], seconds)
            return os.read(proc.stdout.fileno(), 65536) if ready else None

        def close():
            self._release(proc)
            self._held.remove(proc)

        return Held(self.name, recv, close)

    @staticmethod
    def _release(proc):
        try:
            proc.stdin.close()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()

    def close(self):
        for proc in self._held:
            self._release(proc)
        self._held = []


def fetch_host_key(settings: SSHSettings, timeout: float = 10.0) -> paramiko.PKey:
    """The key a host offers, without authenticating (for ``invoke trust``)."""
    sock = socket.create_connection((settings.address, settings.port), timeout=timeout)
    transport = paramiko.Transport(sock)
    try:
        transport.start_client(timeout=timeout)
        return transport.get_remote_server_key()
    finally:
        transport.close()


def pin_host_key(settings: SSHSettings, key: paramiko.PKey) -> str:
    """Append the host's key to its known_hosts file; returns the file."""
    path = settings.known_hosts or os.path.expanduser("~/.ssh/known_hosts")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    line = f"{settings.known_hosts_name} {key.get_name()} {key.get_base64()}\n"
    with open(path, "a", encoding="ascii") as handle:
        handle.write(line)
    return path


def connect(settings: SSHSettings | None, local: bool = False, name: str = "localhost") -> Connection:
    if local:
        return LocalConnection(name).open()
    return SSHConnection(settings).open()
