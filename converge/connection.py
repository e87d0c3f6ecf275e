"""Connections to hosts: one SSH connection per host per run, or the local machine.

Every command is a POSIX shell script sent on standard input to ``sh -s``: the
script (and any secret inside a heredoc) never appears on a command line, and
one script is one round trip. Host keys are checked against known_hosts with
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

    def hold(self, script: str, timeout: float) -> tuple[str, object]:
        """Start ``script`` with its stdin kept open; return its first line of
        output and a handle whose ``close()`` ends it (used for host locks)."""
        raise NotImplementedError

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shell(become: bool) -> str:
    return "sudo -n sh -s" if become else "sh -s"


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
        return self

    def _channel(self, timeout):
        try:
            channel = self.client.get_transport().open_session(timeout=timeout)
        except (paramiko.SSHException, AttributeError, EOFError) as exc:
            raise ConnectionFailed(f"{self.name}: the SSH connection was lost: {exc}") from exc
        return channel

    def run(self, script: str, timeout: float | None = None, on_output=None) -> Result:
        channel = self._channel(timeout)
        channel.exec_command(_shell(self.settings.become))
        channel.sendall(script.encode())
        channel.shutdown_write()
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout if timeout else None
        pending = b""
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
            if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                break
            if deadline and time.monotonic() > deadline:
                channel.close()
                raise RemoteCommandError(f"{self.name}: a command did not finish within {timeout:g} s", rc=124,
                                         output=out.decode(errors="replace"))
            if channel.closed and not channel.exit_status_ready():
                raise ConnectionFailed(f"{self.name}: the SSH connection was lost")
            select.select([channel], [], [], 0.2)
        rc = channel.recv_exit_status()
        channel.close()
        return Result(rc, out.decode(errors="replace"), err.decode(errors="replace"))

    def hold(self, script: str, timeout: float):
        channel = self._channel(timeout)
        channel.exec_command(_shell(self.settings.become))
        channel.sendall(script.encode())
        buf = b""
        deadline = time.monotonic() + timeout
        while b"\n" not in buf:
            if channel.recv_ready():
                buf += channel.recv(4096)
                continue
            if channel.exit_status_ready() or time.monotonic() > deadline:
                break
            select.select([channel], [], [], 0.2)
        first = buf.split(b"\n", 1)[0].decode(errors="replace")
        self._held.append(channel)
        return first, channel

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

    def hold(self, script: str, timeout: float):
        proc = subprocess.Popen(shlex.split(_shell(self.become)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        proc.stdin.write(script.encode())
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        first = proc.stdout.readline().decode(errors="replace").rstrip("\n") if ready else ""
        self._held.append(proc)
        return first, proc

    def close(self):
        for proc in self._held:
            try:
                proc.stdin.close()
                proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


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
