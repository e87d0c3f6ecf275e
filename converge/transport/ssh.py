"""A host over SSH: a Fabric connection (transport.connect: strict host keys,
shared jump hosts) carrying our speed path, which Fabric's ``run`` does not have.

- Pipelined exec: the exec request goes without waiting for its reply (as
  OpenSSH's own client does) and the script follows at once: one script, one
  round trip. paramiko's ``exec_command`` waits for the reply; sending its
  message ourselves needs paramiko's private ``Channel._event_pending`` and
  ``Transport._send_user_message`` (here and nowhere else; paramiko 3 to 5).
- A keepalive watchdog, as OpenSSH's ServerAliveInterval/CountMax: paramiko's own
  keepalive asks for no reply, so a dead link was noticed only by a command's
  timeout, or TCP's, in minutes to hours. Every ALIVE_S seconds the server is
  asked for a reply (the same private send); with none for ALIVE_S * ALIVE_COUNT
  seconds, the connection is closed and says why.
"""
from __future__ import annotations

import select
import socket
import threading
import time

import paramiko

from .. import hostkeys
from ..errors import ConnectionFailed, RemoteCommandError
from ..ssh_settings import SSHSettings
from . import Transport, keep_tail
from .connect import JumpHosts, for_host, open_connection

ALIVE_S = 5.0
ALIVE_COUNT = 3
_LINK_ERRORS = (paramiko.SSHException, EOFError, OSError, AttributeError)


class _Channel:
    def __init__(self, transport: "SSHTransport", channel: paramiko.Channel):
        self.name = transport.name
        self._t = transport
        self._ch = channel
        self._err = bytearray()

    def read(self, seconds):
        ch, deadline = self._ch, time.monotonic() + seconds
        while not ch.recv_ready():
            self.stderr()  # sudo's words land there, apart from the script's lines
            if ch.eof_received or ch.closed:
                return b""
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # the channel's pipe wakes us for standard output and EOF; standard error is polled
            select.select([ch], [], [], min(remaining, 0.5))
        return ch.recv(65536)

    def stderr(self):
        while self._ch.recv_stderr_ready():
            self._err += self._ch.recv_stderr(65536)
            keep_tail(self._err)
        return bytes(self._err)

    def write(self, data):
        try:
            self._ch.sendall(data)
        except _LINK_ERRORS as exc:
            raise self._t.lost(exc) from exc

    def status(self, seconds):
        ch = self._ch
        # a closed channel without a status will not get one: no need to wait for it
        got = ch.status_event.is_set() or (not ch.closed and ch.status_event.wait(seconds))
        rc = ch.recv_exit_status() if got else None
        ch.close()
        # paramiko closes a dead connection's channels with status -1: not the command's
        if self._t.dead_reason or ((rc is None or rc == -1) and not ch.transport.is_active()):
            raise self._t.lost()
        if rc is None:
            raise RemoteCommandError(f"{self.name}: the host ended a command without an exit status "
                                     f"(did sshd refuse to run '{self._t._shell()}'?)", rc=255)
        return rc

    def alive(self):
        if self._t.dead_reason:
            raise self._t.lost()
        return not (self._ch.closed or self._ch.eof_received)

    def kill(self):
        self._ch.close()


class SSHTransport(Transport):
    def __init__(self, settings: SSHSettings, jumps: JumpHosts | None = None):
        self.name = settings.name
        self.settings = settings
        self.become = settings.become
        self._own_jumps = jumps is None  # alone (tests): its jump hosts are its own
        self.jumps = jumps if jumps is not None else JumpHosts()
        self._gateway = self.jumps.gateway(settings)
        self.fabric = for_host(settings, self._gateway)
        self.login_user = self.fabric.user
        self._held: list[paramiko.Channel] = []
        self.dead_reason: str | None = None  # set by the watchdog when the link died
        self._closing = threading.Event()

    def open(self) -> "SSHTransport":
        s = self.settings
        try:
            self.jumps.open_for(s, self._gateway)
            open_connection(self.fabric, s.name, "", s.known_hosts, s.connect_timeout,
                            via=str(s.jumps[-1]) if s.jumps else None)
        except ConnectionFailed:
            self.close()
            raise
        threading.Thread(target=self._watch, name=f"watchdog-{s.name}", daemon=True).start()
        return self

    def lost(self, exc: Exception | None = None) -> ConnectionFailed:
        return ConnectionFailed(self.dead_reason or f"{self.name}: the SSH connection was lost"
                                f"{': ' + str(exc) if exc else ''}")

    def _watch(self):
        transport = self.fabric.client.get_transport()
        while not self._closing.wait(ALIVE_S) and transport.is_active():
            answered = threading.Event()
            transport.completion_event = answered  # set by paramiko at the reply (OpenSSH's "failure" too)
            try:
                _send(transport, paramiko.common.cMSG_GLOBAL_REQUEST, "keepalive@openssh.com", True)
            except _LINK_ERRORS:
                pass
            if not answered.wait(ALIVE_S * ALIVE_COUNT) and not self._closing.is_set():
                where = hostkeys.known_hosts_name(self.fabric.host, self.fabric.port)
                self.dead_reason = (f"{self.name}: no answer from {where} for {ALIVE_S * ALIVE_COUNT:g} s: the "
                                    f"link or the host went down")
                transport.close()

    def _start(self, command, stdin, keep_open, timeout):
        try:
            channel = self.fabric.client.get_transport().open_session(timeout=timeout)
            channel._event_pending()  # paramiko's exec_command, without its wait for the reply
            _send(channel.transport, paramiko.common.cMSG_CHANNEL_REQUEST, channel.remote_chanid, "exec", True,
                  command)
            proc = _Channel(self, channel)
            proc.write(stdin)
            if keep_open:
                self._held.append(channel)
            else:
                channel.shutdown_write()
        except _LINK_ERRORS as exc:
            raise self.lost(exc) from exc
        return proc

    def local_address(self) -> str | None:
        # through jump hosts the link is a channel in the first hop's connection: our
        # address toward that hop, which the host behind it may or may not reach (ask it)
        sock = self.fabric.client.get_transport().sock
        while isinstance(sock, paramiko.Channel):
            sock = sock.get_transport().sock
        return sock.getsockname()[0] if isinstance(sock, socket.socket) else None

    def close(self):
        self._closing.set()
        for channel in self._held:
            channel.close()
        self.fabric.close()
        if self._own_jumps:
            self.jumps.close()


def _send(transport: paramiko.Transport, kind: bytes, *fields):
    """An SSH message sent without waiting for its reply."""
    message = paramiko.Message()
    message.add_byte(kind)
    for value in fields:
        {bool: message.add_boolean, int: message.add_int, str: message.add_string}[type(value)](value)
    transport._send_user_message(message)
